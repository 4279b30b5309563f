"""Memory budgets written as people write them: ``"40GiB"``, ``"512 MB"``, ``"80%"`` (pure Python).

A byte budget is per rank: what the activations held for backward may reach on the busiest
rank. Units are case-insensitive, binary (KiB, MiB, GiB, TiB: powers of 1024) or decimal (KB,
MB, GB, TB: powers of 1000), or plain bytes (``"B"``, or a bare integer string). A percentage
is a share of the device's memory and is resolved where the device is known (the runtime).
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*|%)\s*$")


def is_budget_string(value: object) -> bool:
    """Is ``value`` a byte budget (``"40GiB"``, ``"80%"``), not a name like ``"1p"``?"""
    return isinstance(value, str) and _PATTERN.match(value) is not None and not _is_name(value)


def _is_name(value: str) -> bool:
    return value.strip().lower() in ("1p", "2p")


def parse_budget(text: str) -> tuple[float, bool]:
    """``(value, is_fraction)``: bytes for ``"40GiB"``; a fraction of the device for ``"80%"``.

    Raises ``ValueError`` naming the accepted forms.
    """
    m = _PATTERN.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else ""
    if m is None or (unit != "%" and unit not in _UNITS):
        raise ValueError(
            f"memory_limit {text!r} is not a byte budget: write a number and a unit, e.g. "
            "'40GiB', '512MiB', '1.5GB' (KiB/MiB/GiB/TiB or KB/MB/GB/TB or B), or a share of "
            "the device's memory like '80%'"
        )
    number = float(m.group(1))
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"memory_limit {text!r}: a percentage must be in (0, 100]")
        return number / 100, True
    value = number * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"memory_limit {text!r} must be more than 0 bytes")
    return value, False


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (``"1.5 GiB"``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes:.0f} B"


def budget_option(nbytes: float) -> str:
    """``nbytes`` as a budget a schedule name option takes (``"6.83MiB"``), 3 significant
    digits in the largest binary unit that keeps it >= 1, rounded up: the budget named holds
    what was measured."""
    unit, size = "B", 1
    for name, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= s:
            unit, size = name, s
            break
    value = nbytes / size
    if value <= 0:
        return "1B"
    exponent = math.floor(math.log10(value))
    step = 10.0 ** (exponent - 2)
    return f"{math.ceil(value / step - 1e-9) * step:.{max(0, 2 - exponent)}f}{unit}"
