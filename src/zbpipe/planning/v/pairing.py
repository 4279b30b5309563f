"""Make overlapped pairs out of any V plan: an F and a B of the rank's two stages that run one
after the other become one pair where the simulator says the plan gets no longer (pure Python).

A pair waits for both halves' inputs and hands both results over at its end, so pairing can
delay the first half's consumer; with collectives to hide (``Costs.a2a``) it shortens both. So
each candidate is simulated: first all of them at once, and if that is longer than the plan
without pairs, one at a time in order, each kept only if the plan gets no longer. A ``(B, F)``
neighbourhood is paired as ``(F, B)`` (the F's allocation then comes first: the memory limit is
checked). Deterministic: candidates are tried rank by rank, in order.
"""

from __future__ import annotations

import dataclasses

from ..core import Plan, PlanError
from ..costs import Costs
from ..rules import EPS
from ..simulator import simulate_timing

#: candidates tried one at a time at most (the all-at-once try is always made)
MAX_TRIALS = 256


def pair_neighbours(plan: Plan, costs: Costs, memory_limit: float | None, name: str) -> Plan:
    """``plan`` (renamed ``name``) with neighbouring F and B of different stages paired where it
    makes the plan no longer (see the module docstring)."""
    base = dataclasses.replace(plan, name=name)
    best = _length(base, costs, memory_limit)
    if best is None:
        return base
    found = _candidates(base)
    if not found:
        return base
    together = _with_pairs(base, found)
    length = _length(together, costs, memory_limit)
    if length is not None and length <= best + EPS:
        return together
    for candidate in found[:MAX_TRIALS]:
        trial = _with_pairs(base, [candidate])
        length = _length(trial, costs, memory_limit)
        if length is not None and length <= best + EPS:
            base, best = trial, length
    return base


def _candidates(plan: Plan) -> list[tuple[int, int]]:
    """``(rank, step)`` of each neighbouring F/B of different stages, not overlapping."""
    out = []
    in_pairs = {a for pair in plan.pairs for a in pair}
    for rank, actions in plan.order.items():
        step = 0
        while step + 1 < len(actions):
            a, b = actions[step], actions[step + 1]
            if (
                {a.kind, b.kind} == {"F", "B"}
                and a.stage != b.stage
                and a not in in_pairs
                and b not in in_pairs
            ):
                out.append((rank, step))
                step += 2
            else:
                step += 1
    return out


def _with_pairs(plan: Plan, where: list[tuple[int, int]]) -> Plan:
    order = {r: list(acts) for r, acts in plan.order.items()}
    pairs = set(plan.pairs)
    for rank, step in where:
        a, b = order[rank][step], order[rank][step + 1]
        f, back = (a, b) if a.kind == "F" else (b, a)
        order[rank][step], order[rank][step + 1] = f, back
        pairs.add((f, back))
    return dataclasses.replace(
        plan, order={r: tuple(acts) for r, acts in order.items()}, pairs=frozenset(pairs)
    )


def _length(plan: Plan, costs: Costs, memory_limit: float | None) -> float | None:
    """The plan's makespan; None if it breaks the memory limit (a pair's F moved first)."""
    try:
        return simulate_timing(plan, costs, memory_limit=memory_limit).makespan
    except PlanError:
        return None
