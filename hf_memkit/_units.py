"""Bytes inside, binary units outside (docs/style.md §6); and the two integer rules every
layer checks counts with (``is_positive_int``, ``divisors``)."""

from __future__ import annotations

import math
import re

from ._errors import HfMemkitError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    # Decimal units are accepted as written (1 GB = 10**9 bytes), never confused with GiB.
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """``"20GiB"`` -> 21474836480; ints pass through; ``"16GB"`` is 16 * 10**9 bytes."""
    if isinstance(value, bool):
        raise HfMemkitError(f"memory size `{value}` is not a size; give bytes or e.g. '20GiB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise HfMemkitError(f"memory size {value!r} is not a finite number; give bytes or "
                                "e.g. '20GiB'")
        if value < 0:
            raise HfMemkitError(f"memory size {value} is negative; give a positive size")
        return int(value)
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise HfMemkitError(
            f"cannot read memory size `{value}`; write a number with a unit: "
            "B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal), e.g. '20GiB'"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: int | float | None, *, precision: int = 2) -> str:
    """Binary units with the right spelling: 1.50 GiB, 12.00 MiB."""
    if n is None:
        return "unknown"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"


def is_positive_int(v: object) -> bool:
    """Whether ``v`` is a positive ``int`` (``True`` is not a count)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (found up to its square root)."""
    low, high = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            low.append(k)
            if k * k != n:
                high.append(n // k)
        k += 1
    return low + high[::-1]
