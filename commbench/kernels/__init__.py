"""Local compute the collectives and benchmarks need."""

from commbench.kernels.reduce import reduce_into

__all__ = ["reduce_into"]
