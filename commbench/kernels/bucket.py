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


def _offsets(t: torch.Tensor) -> torch.Tensor:
    """Each element's offset from ``t``'s first, in elements, in one flat tensor."""
    off = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        off = off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return off.flatten()


def _apart(tensors: Sequence[torch.Tensor]) -> int | None:
    """The index of the first tensor with an element over another of its own or of an earlier
    tensor's, None when all are apart. Tensors whose dimensions nest (each stride past the reach
    of the smaller ones) and whose address ranges are disjoint, the common case (parameters, or
    slices of one buffer in turn), pass at once; only the others have their elements' addresses
    compared."""
    spans, doubtful = [], set()
    for i, t in enumerate(tensors):
        if t.numel() == 0 or t.device.type == "meta":  # no memory to share
            continue
        if t.is_contiguous():
            reach = t.numel()
        else:
            reach = 1  # elements from the first to the last of the dimensions so far, plus one
            for stride, size in sorted((s, d) for d, s in zip(t.shape, t.stride(), strict=True) if d > 1):
                if stride < reach:
                    doubtful.add(i)  # interleaved dimensions, or elements over one another
                reach += (size - 1) * stride
        p = t.data_ptr()
        spans.append((p, p + reach * t.element_size(), i))
    spans.sort()
    reach_end, widest = -1, -1  # the furthest end of the spans so far, and whose it is
    for start, end, i in spans:
        if start < reach_end:  # over an earlier span, not only the one just before it
            doubtful.update((i, widest))
        if end > reach_end:
            reach_end, widest = end, i
    if not doubtful:
        return None
    size = tensors[0].element_size()
    ordered = sorted(doubtful)
    at = torch.cat([_offsets(tensors[i]) * size + tensors[i].data_ptr() for i in ordered])
    who = torch.cat([torch.full((tensors[i].numel(),), i, dtype=torch.int64) for i in ordered])
    at, order = at.sort(stable=True)
    who = who[order]
    clash = (at[1:] - at[:-1]) < size
    if not bool(clash.any()):
        return None
    return int(torch.maximum(who[:-1][clash], who[1:][clash]).min())


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of the flat buffer back into ``tensors`` (the inverse of ``pack``,
    with the same checks, and each of ``tensors`` one a copy may write: no element of it over
    another of its own (an expanded tensor) or of another tensor's, nothing autograd would record
    the copy in (a tensor that requires grad, or a view of one) unless under torch.no_grad(), and
    no inference tensor outside inference mode). A failed check leaves every tensor as it was."""
    tensors = list(tensors)
    _check(flat, tensors)
    for i, t in enumerate(tensors):
        if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
            raise ValueError(f"tensor {i} has elements over one another (an expanded tensor); give a copy")
        base = t if t._base is None else t._base
        if torch.is_grad_enabled() and (t.requires_grad or base.requires_grad):
            # A view of a tensor that requires grad made by unbind, split or chunk, or made under
            # no_grad, raised from inside copy_ after the tensors before it had been written.
            what = "a leaf that requires grad" if base.is_leaf else "a tensor that requires grad"
            view = "" if t is base else ", or a view of one"
            raise ValueError(f"tensor {i} is {what}{view}; unpack under torch.no_grad()")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"tensor {i} is an inference tensor; unpack under torch.inference_mode()")
    if (i := _apart(tensors)) is not None:
        raise ValueError(f"tensor {i} has elements over one another or over an earlier tensor's; give copies")
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
