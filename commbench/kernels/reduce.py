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
        out: destination, same shape, dtype and device as ``a`` and ``b``.
        a, b: operands.
        op: one of sum, avg, prod, max, min (avg accumulates as sum).

    Raises:
        ValueError: when the three differ in shape, dtype or device (torch would broadcast a
            smaller operand or promote a dtype without a word, hiding a wrong-sized buffer), or
            ``op`` is none of the above.
        TypeError: when one of the three is not a tensor.
    """
    binary = _BINARY.get(op) if isinstance(op, str) else None  # a list raised "unhashable type"
    if binary is None:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(_BINARY)}")
    for name, t in (("out", out), ("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):  # a list raised AttributeError on its .shape
            raise TypeError(f"reduce_into needs tensors, got {name} {type(t).__name__}")
    if not out.shape == a.shape == b.shape:
        raise ValueError(
            f"reduce_into needs one shape, got out {tuple(out.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if not out.dtype == a.dtype == b.dtype:
        raise ValueError(f"reduce_into needs one dtype, got out {out.dtype}, a {a.dtype}, b {b.dtype}")
    if not out.device == a.device == b.device:
        raise ValueError(f"reduce_into needs one device, got out {out.device}, a {a.device}, b {b.device}")
    return binary(a, b, out=out)
