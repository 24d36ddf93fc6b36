"""commbench: measure the communication of distributed deep learning, from the wire up."""

__version__ = "0.1.0"
