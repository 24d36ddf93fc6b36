"""Reusable scratch memory for the hand-written algorithms.

Fresh large buffers cost page faults on every call (on the CI-class VM, first touch of 32 MiB
takes about 20 ms, longer than sending it), so callers that run collectives repeatedly pass a
Workspace and the buffers are allocated once. A Workspace is owned by its caller (no global
cache) and serves one thread: give each thread that runs collectives its own.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named scratch buffers that grow on demand and are reused across calls."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``shape`` with ``like``'s dtype and device; contents are undefined."""
        numel = math.prod(shape)
        key = (name, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.zeros(numel, dtype=like.dtype, device=like.device)  # touch pages now
            self._buffers[key] = buf
        return buf[:numel].view(shape)


def scratch(
    workspace: Workspace | None, name: str, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """Scratch from ``workspace`` when given, else a fresh uninitialised tensor."""
    if workspace is None:
        return like.new_empty(shape)
    return workspace.get(name, shape, like)
