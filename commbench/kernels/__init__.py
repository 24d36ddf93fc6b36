"""Local compute the collectives and benchmarks need."""

from commbench.kernels.bucket import pack, unpack
from commbench.kernels.reduce import reduce_into

__all__ = ["pack", "reduce_into", "unpack"]
