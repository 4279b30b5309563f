"""A step's microbatches ordered by what each costs (``step(..., microbatch_costs=...)``).

The rank of stage 0 is given one cost factor per microbatch (e.g.
:func:`zbpipe.planning.by_cost.token_scales` of their lengths), picks the order of the
microbatches over the plan's slots whose simulated makespan is least
(:func:`zbpipe.planning.by_cost.order_by_cost`; data order on ties) and feeds them in that
order. The order travels to every other rank in the header of the shape exchange's messages
(:mod:`.varlen`; so only with ``variable_shapes=True``), so only stage 0's rank needs the costs;
the last stage's rank takes its targets in the same order and hands the losses (and outputs)
back in the caller's order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

from ..planning import Costs, Plan
from ..planning.by_cost import order_by_cost

T = TypeVar("T")


def check_microbatch_costs(
    sched: Any, costs: Sequence[float] | None, variable_shapes: bool
) -> tuple[float, ...] | None:
    """``costs`` as a tuple, or a ``ValueError`` saying what is wrong (before any message).
    The order reaches the other ranks in the shape exchange's messages: ``variable_shapes``."""
    if costs is None:
        return None
    owner, m = type(sched).__name__, sched._n_microbatches
    if not variable_shapes:
        raise ValueError(
            f"{owner}.step(): microbatch_costs needs the schedule built with "
            "variable_shapes=True (the order they choose travels with each step's shapes); "
            "build it so on every rank, or drop microbatch_costs"
        )
    try:
        values = tuple(float(c) for c in costs)
    except (TypeError, ValueError):
        raise ValueError(
            f"{owner}.step(): microbatch_costs must be a sequence of numbers, got {costs!r}"
        ) from None
    if len(values) != m or not all(math.isfinite(c) and c > 0 for c in values):
        raise ValueError(
            f"{owner}.step(): microbatch_costs needs {m} finite numbers > 0 (one per microbatch, "
            f"e.g. zbpipe.planning.by_cost.token_scales(lengths)), got {list(costs)}"
        )
    return values


class CostOrder:
    """The last few orders chosen (a step's costs often repeat)."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[int, tuple[float, ...]], tuple[int, ...]] = {}

    def slots(self, plan: Plan, costs: Costs, factors: tuple[float, ...]) -> tuple[int, ...]:
        key = (id(plan), factors)
        found = self.chosen.get(key)
        if found is None:
            if len(self.chosen) >= 64:
                self.chosen.clear()
            found = self.chosen[key] = order_by_cost(plan, costs, factors).slots
        return found


def in_slots(items: Sequence[T], slots: Sequence[int]) -> list[T]:
    """``items`` (data order) in slot order: slot k gets ``items[slots[k]]``."""
    return [items[i] for i in slots]


def in_data_order(items: Sequence[T], slots: Sequence[int]) -> list[Any]:
    """The inverse of :func:`in_slots`: slot k's item goes back to place ``slots[k]``."""
    out: list[Any] = [None] * len(items)
    for k, i in enumerate(slots):
        out[i] = items[k]
    return out
