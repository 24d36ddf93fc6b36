"""Bucket pack and unpack: many gradient tensors to one flat buffer and back."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` one after another into the flat ``out`` and return it.

    Args:
        tensors: same dtype and device as ``out``; their element counts sum to ``out.numel()``.
        out: 1-D destination.
    """
    total = sum(t.numel() for t in tensors)
    if total != out.numel():
        raise ValueError(f"bucket holds {out.numel()} elements, tensors have {total}")
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].view_as(t).copy_(t)
        offset += n
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of the flat buffer back into ``tensors`` (the inverse of ``pack``)."""
    total = sum(t.numel() for t in tensors)
    if total != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} elements, tensors have {total}")
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
