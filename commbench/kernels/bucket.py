"""Bucket pack and unpack: many gradient tensors to one flat buffer and back."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless ``tensors`` fit the 1-D ``flat`` exactly, in its dtype and on its
    device: a copy would otherwise convert them silently (a bucket of a lower precision rounds
    every gradient it carries) or move them between devices."""
    if flat.dim() != 1:
        raise ValueError(f"the bucket must be 1-D, got shape {tuple(flat.shape)}")
    for i, t in enumerate(tensors):
        if t.dtype != flat.dtype:
            raise ValueError(f"tensor {i} is {t.dtype} but the bucket is {flat.dtype}; convert it first")
        if t.device != flat.device:
            raise ValueError(f"tensor {i} is on {t.device} but the bucket is on {flat.device}")
    total = sum(t.numel() for t in tensors)
    if total != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} elements, tensors have {total}")


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` one after another into the flat ``out`` and return it.

    Args:
        tensors: same dtype and device as ``out``; their element counts sum to ``out.numel()``.
        out: 1-D destination.

    Raises:
        ValueError: when they do not match; nothing is converted or moved.
    """
    _check(out, tensors)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].view_as(t).copy_(t)
        offset += n
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of the flat buffer back into ``tensors`` (the inverse of ``pack``,
    with the same checks)."""
    _check(flat, tensors)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
