"""Reduction ops and element types, by name, and which backend can do what."""

from __future__ import annotations

import torch
import torch.distributed as dist

OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "prod")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a supported dtype ("float32"); raises ValueError for others."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; choose from {', '.join(DTYPES)}") from None


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype for a name from DTYPES."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}") from None


def check_op(op: str, dtype: torch.dtype) -> str:
    """Validate a reduction op name for a dtype and return it."""
    if not isinstance(op, str) or op not in _REDUCE_OPS:  # a list raised "unhashable type: 'list'"
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    dtype_name(dtype)
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating-point dtype, got {dtype_name(dtype)}")
    return op


def torch_reduce_op(op: str) -> dist.ReduceOp:
    """The torch.distributed ReduceOp for an op name."""
    return _REDUCE_OPS[op]
