"""Parsing and formatting sizes: K, M, G are 2^10, 2^20, 2^30 bytes; GB/s are 10^9 bytes a second."""

from __future__ import annotations

import operator
import re

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def whole_number(value: object) -> int | None:
    """``value`` as a Python int where it is an integer (NumPy's too), else None; a bool is not one."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


class AmbiguousSize(ValueError):
    """A size given in KB, MB or GB; its message says which binary form to write instead."""


def parse_size(text: str) -> int:
    """Bytes in ``text``: a whole number with an optional K, M or G (binary) suffix, or KiB, MiB,
    GiB; "1M" = "1MiB" = 1048576. KB, MB and GB are refused: read as 10^3, 10^6 and 10^9 bytes
    elsewhere, and as 2^10, 2^20 and 2^30 here before, they said one size and meant another."""
    # ASCII digits only (\d took other scripts' digits), and "iB" only after K, M or G ("1iB" was 1 byte).
    match = re.fullmatch(r"\s*([0-9]+)\s*(?:([KMG])(IB|B)?|B)?\s*", text.upper())
    # More than Python's 4300 digits raised its own error, naming sys.set_int_max_str_digits.
    if not match or len(match.group(1)) > 30:
        raise ValueError(f"not a size: {text[:40]!r} (use bytes or a K/M/G suffix, e.g. 64K, 16M)")
    digits, suffix, tail = match.groups()
    if tail == "B":
        power = _SUFFIX[suffix].bit_length() - 1
        typed = text.strip()[-2:]  # as written: "Mb" is more often megabits than megabytes
        unit = "bits or bytes" if typed[-1] == "b" else "bytes"
        raise AmbiguousSize(
            f"not a size: {text.strip()[:40]!r} is ambiguous ({typed}: 10^{power * 3 // 10} or 2^{power} "
            f"{unit}?); use {digits}{suffix} or {digits}{suffix}iB for {digits} x 2^{power} bytes"
        )
    return int(digits) * _SUFFIX[suffix or ""]


def format_size(size_bytes: int) -> str:
    """Shortest exact binary form: 1024 -> "1K", 1536 -> "1536"."""
    for suffix in ("G", "M", "K"):
        unit = _SUFFIX[suffix]
        if size_bytes and size_bytes % unit == 0:
            return f"{size_bytes // unit}{suffix}"
    return str(size_bytes)


def amount(size_bytes: float) -> str:
    """Bytes of memory in words: GiB from 1 GiB, else MiB, to one decimal ("1216.3 GiB")."""
    if size_bytes >= 1 << 30:
        return f"{size_bytes / (1 << 30):.1f} GiB"
    return f"{size_bytes / (1 << 20):.1f} MiB"


def rank_count(n: object) -> str:
    """``n`` ranks in words: "1 rank", "4 ranks" (and "? ranks" for an unknown count)."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def size_argument(text: str) -> int:
    """:func:`parse_size` as an argparse ``type``: a bad size is argparse's one-line error."""
    import argparse

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
