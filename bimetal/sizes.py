"""Byte sizes as users write them (``65536``, ``64K``, ``4M``, ``1GiB``): one parser for flags and env variables."""

from __future__ import annotations

from bimetal.errors import UserError

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``text``; a size that is not a number with an optional K/M/G unit, or below 4 bytes, is refused."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in UNITS else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise UserError(f"bad message size {text!r}; write sizes like 4K,1M,64M") from None
    if value < 4:
        raise UserError(f"message size {text!r} is below 4 bytes")
    return value
