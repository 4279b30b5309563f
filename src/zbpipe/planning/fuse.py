"""Fuse a split backward back together where the plan gains nothing from splitting it.

Where a rank's order runs W(s, m) right after B(s, m), nothing happens between the two, so one
fused backward BW(s, m) does the same work at the same place: it sends the input gradient when
B would have, holds no activations after, and skips the split's overhead (a second pass over
the queued GEMMs, or over the graph). The runtime lowers plans through this; the plan a user
prints and simulates is left as generated.
"""

from __future__ import annotations

import dataclasses

from .core import Action, Plan

__all__ = ["fuse_adjacent_backward"]


def fuse_adjacent_backward(plan: Plan) -> Plan:
    """``plan`` with every B immediately followed on its rank by its own W replaced by one BW."""
    order: dict[int, tuple[Action, ...]] = {}
    for rank, actions in plan.order.items():
        fused: list[Action] = []
        i = 0
        while i < len(actions):
            a = actions[i]
            nxt = actions[i + 1] if i + 1 < len(actions) else None
            if (
                a.kind == "B"
                and nxt is not None
                and nxt.kind == "W"
                and (nxt.stage, nxt.microbatch) == (a.stage, a.microbatch)
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
