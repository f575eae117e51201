"""Sizes and bandwidths as people type them."""

from __future__ import annotations

import pytest

from partitioner import format_bytes, parse_bandwidth, parse_bytes


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("16GiB", 16 * 2**30),
        ("16 GiB", 16 * 2**30),
        ("512MB", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("1.5KiB", 1536),
        ("80GB", 80 * 10**9),
        ("1000", 1000),
        ("64B", 64),
        ("8bit", 1),
        (12345, 12345),
        (0.5, 1),
    ],
)
def test_parse_bytes(text: str | float, want: int) -> None:
    assert parse_bytes(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("25GB/s", 25e9),
        ("100Gbit/s", 12.5e9),
        ("100Gbps", 12.5e9),
        ("300 GiB/s", 300 * 2**30),
        ("1e9B/s", 1e9),
        (5e9, 5e9),
    ],
)
def test_parse_bandwidth(text: str | float, want: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(want)


@pytest.mark.parametrize("text", ["16 gigs", "GB", "-1GB", "12XB", ""])
def test_bad_sizes_say_how_to_write_them(text: str) -> None:
    with pytest.raises(ValueError, match="16GiB|size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["25GB", "0GB/s", "fast"])
def test_bad_bandwidths_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


def test_format_bytes_reads_back() -> None:
    for size in (512, 3 * 2**20, 5 * 2**30 + 2**29):
        text = format_bytes(size).replace(" ", "")
        assert parse_bytes(text) == pytest.approx(size, rel=0.01)
