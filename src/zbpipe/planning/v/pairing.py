"""Make overlapped pairs out of any V plan: an F and a B of the rank's two stages that run one
after the other (or with only W's between them, which then run before the pair) become one pair
where the simulator says the plan gets no longer, or, with
``most=True``, wherever the memory limit allows and no rank deadlocks (pure Python).

A pair waits for both halves' inputs and hands both results over at its end, so pairing can
delay the first half's consumer; with collectives to hide (``Costs.a2a``) it shortens both. So
the candidates are simulated: first all of them at once, and if that is longer than the plan
without pairs, each half of them in turn, and so on down to one, each group kept only if the
plan gets no longer (``most``: if it still simulates within the limit, however long). A ``(B, F)``
neighbourhood is paired as ``(F, B)`` (the F's allocation then comes first: the memory limit is
checked). Deterministic: candidates are tried rank by rank, in order.
"""

from __future__ import annotations

import dataclasses

from ..core import Action, Plan, PlanError
from ..costs import Costs
from ..rules import EPS
from ..simulator import simulate_timing


def pair_neighbours(
    plan: Plan, costs: Costs, memory_limit: float | None, name: str, *, most: bool = False
) -> Plan:
    """``plan`` (renamed ``name``) with neighbouring F and B of different stages paired where it
    makes the plan no longer, or (``most``) wherever the plan stays valid within
    ``memory_limit`` (see the module docstring)."""
    base = dataclasses.replace(plan, name=name)
    best = _length(base, costs, memory_limit)
    if best is None:
        return base
    found = _candidates(base)
    if not found:
        return base
    bar = float("inf") if most else best + EPS
    base, _ = _add(base, found, costs, memory_limit, bar, most)
    return base


def _add(
    base: Plan,
    found: list[tuple[int, int, int]],
    costs: Costs,
    memory_limit: float | None,
    bar: float,
    most: bool,
) -> tuple[Plan, float]:
    """``base`` with the candidates ``found`` added where they keep it valid and no longer than
    ``bar``: all at once if they do, else each half in turn (fewer simulations than one at a
    time when most candidates pass); returns the plan and the bar for later candidates."""
    trial = _with_pairs(base, found)
    length = _length(trial, costs, memory_limit)
    if length is not None and length <= bar:
        return trial, bar if most else length + EPS
    if len(found) == 1:
        return base, bar
    half = len(found) // 2
    base, bar = _add(base, found[:half], costs, memory_limit, bar, most)
    return _add(base, found[half:], costs, memory_limit, bar, most)


def _candidates(plan: Plan) -> list[tuple[int, int, int]]:
    """``(rank, i, j)`` of each F and B of different stages at steps ``i < j`` of a rank with
    only W's between them (moved before the pair when it is made, but the W of the action at
    ``i``, which moves after it), not overlapping."""
    out = []
    in_pairs = {a for pair in plan.pairs for a in pair}
    for rank, actions in plan.order.items():
        i = 0
        while i < len(actions):
            a = actions[i]
            j = i + 1
            while j < len(actions) and actions[j].kind == "W":
                j += 1
            if j < len(actions) and _pairable(a, actions[j], in_pairs):
                out.append((rank, i, j))
                i = j + 1
            else:
                i += 1
    return out


def _pairable(a: Action, b: Action, in_pairs: set[Action]) -> bool:
    return (
        {a.kind, b.kind} == {"F", "B"}
        and a.stage != b.stage
        and a not in in_pairs
        and b not in in_pairs
    )


def _with_pairs(plan: Plan, where: list[tuple[int, int, int]]) -> Plan:
    order = {r: list(acts) for r, acts in plan.order.items()}
    pairs = set(plan.pairs)
    for rank, i, j in where:
        acts = order[rank]
        a, b = acts[i], acts[j]
        f, back = (a, b) if a.kind == "F" else (b, a)
        between = acts[i + 1 : j]
        own = [w for w in between if (w.stage, w.microbatch) == (a.stage, a.microbatch)]
        before = [w for w in between if w not in own]  # they free memory before the F
        acts[i : j + 1] = [*before, f, back, *own]  # (the first action's own W after it)
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
