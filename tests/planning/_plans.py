"""Plans made once per test session and shared by the tests that check them (plan layer only).

Several tests check different promises of the same plan (ZB-V's V-Half at p = 8, m = 16 is
checked for its memory, its bubble and its speed against 1F1B), and making a plan is what costs:
a V plan is a search (greedy candidates, then local search), a second of CPU at p = 32. A plan
generator is deterministic (DESIGN.md: every rank computes the same plan) and a ``Plan`` is
frozen, so a test handed a shared plan sees exactly what a fresh call would give it.

A plain module, imported like ``_strategies.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zbpipe.planning import Plan

_MADE: dict[str, Plan] = {}


def made(generator: Callable[..., Plan], *args: Any, **kwargs: Any) -> Plan:
    """``generator(*args, **kwargs)``, made on the first call with these arguments only.

    The key is the arguments' ``repr``: ``Costs`` is a frozen dataclass whose repr lists every
    field (floats by their exact repr), but may hold lists, so it is not always hashable.
    """
    key = repr((generator.__module__, generator.__qualname__, args, sorted(kwargs.items())))
    if key not in _MADE:
        _MADE[key] = generator(*args, **kwargs)
    return _MADE[key]
