"""Element-wise reduction of two tensors into a third: the local step of every reducing collective."""

from __future__ import annotations

import torch

_BINARY = {
    "sum": torch.add,
    "avg": torch.add,  # averaging is a sum followed by one division at the end
    "prod": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
}


def reduce_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    """Write ``a (op) b`` into ``out`` (which may alias ``a``) and return ``out``.

    Args:
        out: destination, same shape and dtype as ``a`` and ``b``.
        a, b: operands.
        op: one of sum, avg, prod, max, min (avg accumulates as sum).
    """
    return _BINARY[op](a, b, out=out)
