"""Bucket pack and unpack: many gradient tensors to one flat buffer and back."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless ``tensors`` fit the contiguous 1-D ``flat`` exactly, in its dtype and on its
    device, dense, and apart from it: a copy would otherwise convert them silently (a bucket of a
    lower precision rounds every gradient it carries), move them between devices, fail halfway
    (a sparse tensor) or read what it had already overwritten (a view of ``flat`` elsewhere than
    its own slice, or memory of another storage over the same bytes: two ``torch.from_numpy``
    views of one array). All is checked before anything is copied."""
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"the bucket must be a tensor, got {type(flat).__name__}")
    if flat.dim() != 1:
        raise ValueError(f"the bucket must be 1-D, got shape {tuple(flat.shape)}")
    if flat.layout is not torch.strided:
        raise ValueError(f"the bucket must be a dense tensor, got {flat.layout}")
    if not flat.is_contiguous():  # the overlap check below counts its elements as adjacent
        raise ValueError(f"the bucket must be contiguous, got stride {flat.stride(0)}")
    dtype, device, size = flat.dtype, flat.device, flat.element_size()
    addressed = device.type != "meta"  # meta tensors have no memory, every address 0
    lo = own = flat.data_ptr()  # own: where the tensor's own slice of flat starts
    hi = lo + flat.numel() * size
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {i} is a {type(t).__name__}, not a tensor")
        if t.dtype != dtype:
            raise ValueError(f"tensor {i} is {t.dtype} but the bucket is {dtype}; convert it first")
        if t.device != device:
            raise ValueError(f"tensor {i} is on {t.device} but the bucket is on {device}")
        if t.layout is not torch.strided:
            raise ValueError(
                f"tensor {i} is {t.layout}; only dense tensors go into a bucket, convert it first"
            )
        n = t.numel()
        p = t.data_ptr()
        if n and addressed and not (p == own and t.is_contiguous()):
            span = 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True))
            if p < hi and p + span * size > lo:
                raise ValueError(
                    f"tensor {i} shares memory with the bucket other than as its own slice "
                    f"(elements {(own - lo) // size} to {(own - lo) // size + n}); copy it first"
                )
        own += n * size
    total = (own - lo) // size
    if total != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} elements, tensors have {total}")


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` one after another into the flat ``out`` and return it.

    Args:
        tensors: same dtype and device as ``out``; their element counts sum to ``out.numel()``.
        out: 1-D destination.

    Raises:
        ValueError: when they do not match, or one is a view of ``out`` other than its own slice;
            nothing is converted, moved or copied.
    """
    tensors = list(tensors)  # a generator was used up by the check, and nothing was copied
    _check(out, tensors)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].view_as(t).copy_(t)
        offset += n
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of the flat buffer back into ``tensors`` (the inverse of ``pack``,
    with the same checks, and each of ``tensors`` one a copy may write: no element of it over
    another, as an expanded tensor's, no leaf that requires grad (or view of one) while autograd
    records, and no inference tensor outside inference mode)."""
    tensors = list(tensors)
    _check(flat, tensors)
    for i, t in enumerate(tensors):
        if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
            raise ValueError(f"tensor {i} has elements over one another (an expanded tensor); give a copy")
        leaf = t if t._base is None else t._base
        if t.requires_grad and leaf.is_leaf and leaf.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"tensor {i} is a leaf that requires grad{'' if t is leaf else ', or a view of one'}; "
                "unpack under torch.no_grad()"
            )
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"tensor {i} is an inference tensor; unpack under torch.inference_mode()")
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
