"""Reusable scratch memory for the hand-written algorithms.

Fresh large buffers cost page faults on every call (on the CI-class VM, first touch of 32 MiB
takes about 20 ms, longer than sending it), so callers that run collectives repeatedly pass a
Workspace and the buffers are allocated once. A Workspace is owned by its caller (no global
cache) and serves one thread: give each thread that runs collectives its own.

A Workspace also keeps the last few schedules (:func:`plan`): a ring's list of
segment views costs about 0.1 ms of Python to build, paid before its first message leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")
PLANS_KEPT = 4  # schedules a Workspace keeps; each holds views of the tensors it was built for


class Workspace:
    """Named scratch buffers that grow on demand and are reused across calls."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}
        self._plans: dict[Hashable, object] = {}

    def get(
        self, name: str, shape: tuple[int, ...], like: torch.Tensor, *, pinned: bool = False
    ) -> torch.Tensor:
        """A tensor of ``shape`` with ``like``'s dtype and device; contents are undefined. With
        ``pinned``, page-locked host memory instead, wherever ``like`` lives (for CUDA staging)."""
        numel = math.prod(shape)
        device = torch.device("cpu") if pinned else like.device
        key = (name, like.dtype, device, pinned)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None:
                # Kept schedules may view the outgrown buffer and would hold it beside the new one
                # (ring@1M then ring held both): they go with it, to be built again on the new one.
                self._plans.clear()
            # zeros, not empty: touch the pages now
            buf = torch.zeros(numel, dtype=like.dtype, device=device, pin_memory=pinned)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def plan(self, key: Hashable, build: Callable[[], T]) -> T:
        """The schedule kept for ``key``, else ``build()``, kept (see :func:`plan`)."""
        plans = self._plans
        if key in plans:
            plans[key] = plans.pop(key)  # most recent last
            return plans[key]  # type: ignore[return-value]
        made = build()
        plans[key] = made
        while len(plans) > PLANS_KEPT:
            del plans[next(iter(plans))]
        return made


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share memory."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous tensors of one size that may share memory: torch refuses a
    copy between two that overlap in part, so such a ``src`` is copied aside first. (An all_gather's
    input may lie anywhere in its output, as the backend's own takes it.)"""
    if dst.data_ptr() != src.data_ptr() and overlaps(dst, src):
        src = src.clone()
    dst.copy_(src)


def scratch(
    workspace: Workspace | None,
    name: str,
    shape: tuple[int, ...],
    like: torch.Tensor,
    *,
    pinned: bool = False,
) -> torch.Tensor:
    """Scratch from ``workspace`` when given, else a fresh uninitialised tensor (page-locked host
    memory with ``pinned``)."""
    if workspace is None:
        if pinned:
            return torch.empty(shape, dtype=like.dtype, pin_memory=True)
        return like.new_empty(shape)
    return workspace.get(name, shape, like, pinned=pinned)


def plan(workspace: Workspace | None, key: Hashable, build: Callable[[], T]) -> T:
    """``build()``, reused from ``workspace`` when the same ``key`` was built recently.

    A key names the tensors a schedule views by their data pointers. A kept schedule holds
    views of those tensors, so their memory stays allocated while it is kept, and no other
    tensor can be given the same address: a pointer in a key names one allocation. Only the
    last ``PLANS_KEPT`` keys are kept, which bounds the memory held for callers that pass a
    fresh tensor each time.
    """
    if workspace is None:
        return build()
    return workspace.plan(key, build)
