"""Parse and print sizes and bandwidths such as ``"16GiB"``, ``"512MB"`` or ``"25GB/s"``.

Planning works in bytes and bytes per second; people type units. Decimal prefixes (kB, MB, GB,
TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024. ``B`` or nothing means
bytes; ``bit``/``bits`` (and ``bps`` for rates) means bits. Prefixes and ``B`` are read
case-insensitively, so ``"512mb"`` is 512 megabytes, never megabits.
"""

from __future__ import annotations

import math
import re

_PREFIX = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "p": 10**15,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}
_NUMBER = r"(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE = re.compile(_NUMBER + r"\s*(?P<prefix>[kmgtp]i?)?(?P<unit>b|bytes?|bits?)?$", re.I)
_RATE = re.compile(_NUMBER + r"\s*(?P<prefix>[kmgtp]i?)?(?P<unit>b/s|bytes?/s|bits?/s|bps)$", re.I)


def _value(match: re.Match[str]) -> float:
    prefix = (match.group("prefix") or "").lower()
    unit = (match.group("unit") or "b").lower()
    bits = unit.startswith("bit") or unit == "bps"
    return float(match.group("number")) * _PREFIX[prefix] / (8 if bits else 1)


def parse_bytes(text: str | float) -> int:
    """Bytes in ``text`` (``"16GiB"`` -> 17179869184); numbers pass through, rounded up."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _SIZE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read {text!r} as a size; write e.g. '16GiB', '512MB' or '1000000'"
            )
        value = _value(match)
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"a size must be a finite number of bytes >= 0, got {text!r}")
    return math.ceil(value)


def parse_bandwidth(text: str | float) -> float:
    """Bytes per second in ``text`` (``"25GB/s"`` -> 2.5e10, ``"100Gbit/s"`` -> 1.25e10)."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _RATE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read {text!r} as a bandwidth; write e.g. '25GB/s' or '100Gbit/s'"
            )
        value = _value(match)
    if not value > 0:
        raise ValueError(f"a bandwidth must be > 0 bytes/s, got {text!r}")
    return value


def format_bytes(size: float) -> str:
    """A short binary-prefixed rendering of a byte count, for messages and tables."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"
