"""Microbatches of different costs: which one goes into which slot of a plan (pure Python).

A plan is made for equal microbatches; when a step's microbatches are sequences of different
lengths, the plan's slots are the same but what each costs is not. Which microbatch runs in
slot 0 sets how long the other ranks wait at the start (its F on every stage), the last slots
set the drain, and a long microbatch's B leaves room for W to fill. :func:`order_by_cost` tries
a few orders of the step's microbatches over the plan's slots and keeps the one whose simulated
makespan (:func:`~zbpipe.planning.simulator.simulate_timing` with ``microbatch_scale``) is
least; data order is one of them and wins ties, so the result is never slower in the simulator.

:func:`token_scales` maps token lengths to the per-microbatch factors the simulator takes: time
linear in tokens plus attention's term, quadratic in the length. :func:`group_by_cost` makes the
microbatches of a packed batch: whole documents, grouped so that each microbatch costs about the
same (:mod:`zbpipe.schedules.packed` slices the tensors).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .core import Action, Plan
from .costs import Costs
from .simulator import simulate_timing

#: up to this many microbatches every order is tried (5! = 120 simulations); above, heuristics
EXHAUSTIVE_UP_TO = 5


def token_scales(lengths: Sequence[int], *, quadratic_at: float | None = None) -> tuple[float, ...]:
    """Each microbatch's cost relative to the mean one, from its token count.

    A microbatch of ``n`` tokens costs ``n + n**2 / quadratic_at``: the linear layers' work grows
    with the tokens, attention's with their square. ``quadratic_at`` is the length at which the
    two are equal: about ``12 * hidden`` for causal attention that skips the masked half (a
    transformer block's linear layers do ``24 h**2`` FLOPs per token, causal attention ``2 n h``),
    ``6 * hidden`` for one that computes the whole matrix; None for linear only. For a microbatch
    of several sequences, give its tokens and apply attention per sequence yourself.
    """
    if not lengths:
        raise ValueError("token_scales needs at least one microbatch length")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"token_scales: lengths must be integers >= 1, got {list(lengths)}")
    if quadratic_at is not None and not quadratic_at > 0:
        raise ValueError(f"token_scales: quadratic_at must be > 0 or None, got {quadratic_at}")
    raw = [n + (n * n / quadratic_at if quadratic_at else 0.0) for n in lengths]
    mean = sum(raw) / len(raw)
    return tuple(x / mean for x in raw)


def group_by_cost(costs: Sequence[float], n_groups: int) -> tuple[tuple[int, ...], ...]:
    """``n_groups`` groups of the items (indices into ``costs``), each item in one group, none
    empty, of about equal total cost: the costliest item first, each into the group with the
    least total so far (lowest index on ties; greedy list scheduling, whose largest total is at
    most the mean total plus the costliest item). Items keep their order inside a group, and
    groups are ordered by their first item, so the result depends only on ``costs``."""
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"group_by_cost: n_groups must be an integer >= 1, got {n_groups!r}")
    if len(costs) < n_groups:
        raise ValueError(
            f"group_by_cost: {len(costs)} items cannot fill {n_groups} groups without an empty "
            "one; give fewer groups or more items"
        )
    if any(not c > 0 for c in costs):
        raise ValueError(f"group_by_cost: costs must be > 0, got {list(costs)}")
    totals = [0.0] * n_groups
    members: list[list[int]] = [[] for _ in range(n_groups)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min(range(n_groups), key=lambda g: (totals[g], g))
        totals[g] += costs[i]
        members[g].append(i)
    return tuple(sorted((tuple(sorted(m)) for m in members), key=lambda m: m[0]))


@dataclass(frozen=True)
class CostOrder:
    """Which microbatch runs in each slot of a plan, and what the simulator says of it."""

    slots: tuple[int, ...]
    """``slots[k]``: the microbatch (in the step's data order) that runs in the plan's slot k."""
    makespan: float
    """Simulated makespan with this order."""
    data_order_makespan: float
    """Simulated makespan with the microbatches in data order (slot k runs microbatch k)."""

    @property
    def is_data_order(self) -> bool:
        return self.slots == tuple(range(len(self.slots)))


def candidate_orders(scales: Sequence[float]) -> list[tuple[int, ...]]:
    """The orders :func:`order_by_cost` tries, data order first, without repeats.

    Every order for up to :data:`EXHAUSTIVE_UP_TO` microbatches; above: data order, cheapest
    first, costliest first, and the two "cheap ends" orders (the cheapest microbatch first and
    the next cheapest last, the costly ones in the middle, descending or ascending): the fill
    waits for slot 0's forward, the drain for the last slot's backward.
    """
    m = len(scales)
    data = tuple(range(m))
    if m <= EXHAUSTIVE_UP_TO:
        return list(itertools.permutations(data))  # data order is the first one
    up = tuple(sorted(data, key=lambda i: (scales[i], i)))
    middle = up[2:] if m > 2 else ()
    found = [
        data,
        up,
        up[::-1],
        (up[0], *middle[::-1], up[1]),
        (up[0], *middle, up[1]),
    ]
    out: list[tuple[int, ...]] = []
    for order in found:
        if order not in out:
            out.append(order)
    return out


def order_by_cost(plan: Plan, costs: Costs | None, scales: Sequence[float]) -> CostOrder:
    """The order of the step's microbatches over ``plan``'s slots with the least simulated
    makespan; data order on ties. ``scales``: one cost factor per microbatch, in data order."""
    if len(scales) != plan.n_microbatches:
        raise ValueError(
            f"order_by_cost: {len(scales)} microbatch costs for a plan of "
            f"{plan.n_microbatches} microbatches; give one per microbatch"
        )
    best: tuple[float, tuple[int, ...]] | None = None
    data_makespan = 0.0
    for slots in candidate_orders(scales):
        t = simulate_timing(plan, costs, microbatch_scale=[scales[i] for i in slots]).makespan
        if best is None:
            data_makespan = t
        if best is None or t < best[0] - 1e-9 * max(1.0, abs(best[0])):
            best = (t, slots)
    assert best is not None
    return CostOrder(slots=best[1], makespan=best[0], data_order_makespan=data_makespan)


def relabel(plan: Plan, slots: Sequence[int]) -> Plan:
    """``plan`` with slot k's actions naming microbatch ``slots[k]``: the plan the step runs,
    in the step's own microbatch numbers (simulate it with the scales in data order)."""
    if sorted(slots) != list(range(plan.n_microbatches)):
        raise ValueError(
            f"relabel: slots {list(slots)} is not an order of the plan's "
            f"{plan.n_microbatches} microbatches"
        )

    def mb(a: Action) -> Action:
        return Action(a.stage, a.kind, slots[a.microbatch])

    return replace(
        plan,
        order={r: tuple(mb(a) for a in acts) for r, acts in plan.order.items()},
        pairs=frozenset((mb(f), mb(b)) for f, b in plan.pairs),
        meta={**plan.meta, "slots": tuple(slots)},
    )
