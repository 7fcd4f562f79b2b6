"""Byte sizes are parsed once at the edge and printed in binary units."""

from __future__ import annotations

import pytest

from bigmem.errors import UsageError
from bigmem.units import format_bytes, format_count, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("512GiB", 512 * 2**30), ("1.5TiB", int(1.5 * 2**40)), ("200MB", 200_000_000), ("1048576", 2**20),
    ("64 KiB", 65536), ("2g", 2_000_000_000), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12 parsecs", "-5GiB", "1.5.2GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(UsageError, match=r"Invalid --budget .*: expected a size such as 512GiB"):
        parse_bytes(text, flag="--budget")


@pytest.mark.parametrize("value, expected", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (3 * 2**30, "3.00 GiB"), (int(1.5 * 2**40), "1.50 TiB"),
])
def test_format_bytes(value, expected):
    assert format_bytes(value) == expected


@pytest.mark.parametrize("number, words, expected", [
    (0, ("case",), "0 cases"), (1, ("case",), "1 case"), (2, ("case",), "2 cases"),
    (1, ("class", "classes"), "1 class"), (3, ("class", "classes"), "3 classes"),
])
def test_counts_are_singular_only_for_one(number, words, expected):
    assert format_count(number, *words) == expected
