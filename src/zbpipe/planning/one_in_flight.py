"""The plan that holds the least activation memory any plan can: one microbatch in flight.

Every rank finishes a microbatch's backward on its stages before it starts the next forward, so
a rank holds at most one microbatch of each of its stages (the floor every memory budget is
checked against). There is no pipelining: a step takes about ``num_ranks`` times 1F1B's. zbpipe
runs it for the one step that measures what each stage's microbatch holds when a schedule was
given a byte budget (``memory_limit="40GiB"``): that step cannot exceed any budget some plan
fits in.
"""

from __future__ import annotations

from .core import Action, Layout, Plan, loop_placement, make_plan, v_placement
from .rules import check_sizes


def plan_one_in_flight(num_ranks: int, n_microbatches: int, layout: Layout = "loop") -> Plan:
    """One microbatch at a time: F through every stage, then its fused backward (``BW``).

    ``layout`` ``"loop"``: one stage per rank; ``"v"``: two stages per rank in V placement
    (rank ``r`` holds stages ``r`` and ``2p - 1 - r``).
    """
    check_sizes(num_ranks, n_microbatches)
    p, m = num_ranks, n_microbatches
    if layout == "loop":
        placement = loop_placement(p, p)
        order = {r: [a for i in range(m) for a in (Action(r, "F", i), Action(r, "BW", i))]
                 for r in range(p)}  # fmt: skip
    elif layout == "v":
        placement = v_placement(p)
        order = {}
        for r in range(p):
            down, up = r, 2 * p - 1 - r
            order[r] = [
                a
                for i in range(m)
                for a in (
                    Action(down, "F", i),
                    Action(up, "F", i),
                    Action(up, "BW", i),
                    Action(down, "BW", i),
                )
            ]
    else:
        raise ValueError(f"plan_one_in_flight: layout must be 'loop' or 'v', got {layout!r}")
    return make_plan("OneInFlight", p, m, placement, order, layout=layout)
