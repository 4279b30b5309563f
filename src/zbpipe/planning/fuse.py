"""Fuse a split backward back together where the plan gains nothing from splitting it.

Where a rank's order runs W(s, m) right after B(s, m), nothing happens between the two, so one
fused backward BW(s, m) does the same work at the same place, holds no activations after, and
skips the split's overhead (a second pass over the queued GEMMs, or over the graph).

Only where no other rank waits for B's input gradient, though: a fused BW sends that gradient
when the whole backward ends, W's time later than B would have, and the previous stage's rank
stalls for it (on equal costs, fusing every adjacent pair lengthens ZB-1p, ZB-V and V-Min plans
by up to a third). So a pair is fused on the first stage (its input gradient goes nowhere) and
where the previous stage lives on the same rank (V placement's turn: its consumer runs later in
this order anyway, after the W). The B of an overlapped pair is never fused: the pair runs B
only, its W apart. The runtime lowers plans through this; the plan a user prints and simulates
is left as generated.

A step that measures what a backward holds until its W (the memory probe's first step) keeps
some pairs split (``keep_split``): a fused backward waits for nothing, so it says nothing about
what B holds, and a stage whose every pair was fused (the first stage, often) would be planned
as if its B held no more than its F (under activation checkpointing it holds several times
more: the recomputed inputs of its weight GEMMs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

from .core import Action, Plan

__all__ = ["fuse_adjacent_backward"]


def fuse_adjacent_backward(plan: Plan, keep_split: Container[tuple[int, int]] = ()) -> Plan:
    """``plan`` with a B immediately followed on its rank by its own W replaced by one BW,
    wherever that delays no other rank (see the module docstring), except the ``(stage,
    microbatch)`` pairs in ``keep_split``."""
    order: dict[int, tuple[Action, ...]] = {}
    paired = {b for _, b in plan.pairs}  # an overlapped pair's B stays a B (its W is apart)
    for rank, actions in plan.order.items():
        fused: list[Action] = []
        i = 0
        while i < len(actions):
            a = actions[i]
            nxt = actions[i + 1] if i + 1 < len(actions) else None
            if (
                a.kind == "B"
                and a not in paired
                and nxt is not None
                and nxt.kind == "W"
                and (nxt.stage, nxt.microbatch) == (a.stage, a.microbatch)
                and _gradient_stays_on(plan, a.stage, rank)
                and (a.stage, a.microbatch) not in keep_split
            ):
                fused.append(Action(a.stage, "BW", a.microbatch))
                i += 2
            else:
                fused.append(a)
                i += 1
        order[rank] = tuple(fused)
    if order == dict(plan.order):
        return plan
    out = dataclasses.replace(plan, order=order)
    out.validate()
    return out


def _gradient_stays_on(plan: Plan, stage: int, rank: int) -> bool:
    """No other rank waits for ``stage``'s input gradient: it is the first stage, or the previous
    stage lives on ``rank`` too."""
    return stage == 0 or plan.placement[stage - 1] == rank
