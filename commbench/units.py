"""Parsing and formatting sizes: K, M, G are 2^10, 2^20, 2^30 bytes; GB/s are 10^9 bytes a second."""

from __future__ import annotations

import re

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a whole number with an optional K, M or G (binary) suffix; "1M" = 1048576."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:IB|B)?\s*", text.upper())
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes or a K/M/G suffix, e.g. 64K, 16M)")
    return int(match.group(1)) * _SUFFIX[match.group(2)]


def format_size(size_bytes: int) -> str:
    """Shortest exact binary form: 1024 -> "1K", 1536 -> "1536"."""
    for suffix in ("G", "M", "K"):
        unit = _SUFFIX[suffix]
        if size_bytes and size_bytes % unit == 0:
            return f"{size_bytes // unit}{suffix}"
    return str(size_bytes)
