"""Byte sizes: parsed once at the edge ("512GiB", "1.5TiB", "200MB"), printed in binary units.

Shapes and counts are printed here too, one formatter each.
"""

from __future__ import annotations

import numbers

import re

from bigmem.errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_BINARY = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
# The largest size accepted: 2^63 - 1 bytes (8 EiB), the most a signed 64-bit byte count (the
# kernel's, HDF5's, numpy's int64) holds; anything larger is a typo, not a machine.
MAX_BYTES = 2**63 - 1


def parse_bytes(text: str | int, *, flag: str = "size") -> int:
    """Parse '512GiB', '1.5 TiB', '200MB' or a plain integer into integer bytes.

    Decimal suffixes (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, ...) powers of 1024,
    as in IEC 80000-13.

    Args:
        text: the size as typed, or an integer number of bytes.
        flag: the flag or setting it came from, for the message (default 'size').

    Returns:
        The size in integer bytes, 0 to ``MAX_BYTES``.

    Raises:
        UsageError: not a size, negative, or larger than ``MAX_BYTES`` (8 EiB), e.g. ``1e999``.

    Example:
        >>> parse_bytes("1.5GiB"), parse_bytes("200MB")
        (1610612736, 200000000)
    """
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"Invalid {flag} {text}: expected a non-negative size.")
        if text > MAX_BYTES:
            raise UsageError(f"Invalid {flag} {text}: expected a size below 8 EiB (2^63 bytes).")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"Invalid {flag} {text!r}: expected a size such as 512GiB, 1.5TiB, 200MB or 1048576."
        )
    value = float(match.group(1)) * _UNITS[unit]  # inf for '1e999': never rounded to an int
    if not value < MAX_BYTES:
        raise UsageError(f"Invalid {flag} {text!r}: expected a size below 8 EiB (2^63 bytes).")
    return int(round(value))


def format_bytes(num_bytes: int | float) -> str:
    """Format a byte count in binary units: 1536 -> '1.50 KiB'."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1024:
        return f"{sign}{int(value)} B"
    unit = 0
    while value >= 1024 and unit < len(_BINARY) - 1:
        value /= 1024
        unit += 1
    return f"{sign}{value:.2f} {_BINARY[unit]}"


def as_shape(volume) -> tuple[int, int, int]:
    """A cube edge N as ``(N, N, N)``; a ``(D, H, W)`` (any sequence, numpy ints too) as a tuple of ints.

    Example:
        >>> as_shape(64), as_shape([240, 240, 155])
        ((64, 64, 64), (240, 240, 155))
    """
    if isinstance(volume, numbers.Integral):
        return (int(volume),) * 3
    return tuple(int(s) for s in volume)


def format_shape(shape) -> str:
    """A spatial shape as messages print it: a cube as '128^3', any other as '240x240x144'.

    Example:
        >>> format_shape((128, 128, 128)), format_shape([240, 240, 144])
        ('128^3', '240x240x144')
    """
    shape = tuple(int(s) for s in shape)
    return f"{shape[0]}^3" if len(set(shape)) == 1 else "x".join(map(str, shape))


def format_count(number: int, noun: str, plural: str | None = None) -> str:
    """A count and its noun as messages print it: '1 case', '2 cases' (``plural`` default: noun + 's').

    Example:
        >>> format_count(1, "case"), format_count(3, "case"), format_count(2, "class", "classes")
        ('1 case', '3 cases', '2 classes')
    """
    return f"{number} {noun if number == 1 else (plural or noun + 's')}"
