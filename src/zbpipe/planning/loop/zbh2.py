"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.2 / Figure 3).

The handcrafted zero-bubble schedule for ``T_F = T_B = T_W``: more warm-up F than 1F1B fill
the bubble before the first B, and the W passes at the tail are reordered so the schedule is
a parallelogram instead of 1F1B's trapezoid.

Rank ``r`` (0-indexed) runs ``2(p - r) - 1`` warm-up F: exactly the F that fit before the first
B arrives with unit costs (the first microbatch needs ``2(p - 1 - r) + 1`` units to go down
and come back). At most ``2p - 1`` microbatches are in flight (F done, W not) on any rank,
the paper's ``(2p - 2r - 1) M_B + 2r M_W`` with ``M_W = M_B``. Under those two caps the order is
the unit-cost list schedule "B as soon as its gradient has arrived, else F, else W; a W when
the next F would exceed ``2p - 1`` in flight". With unit costs and ``m >= 2p - 1`` that is the
paper's parallelogram: makespan ``3m + p - 1``, bubble rate 0 (each rank busy ``3m`` without
a gap from its first start). Any ``m >= 1`` gives a valid plan.

The order does not depend on ``costs`` (it is handcrafted): ``costs`` and ``memory_limit`` only
check that the plan fits. Under other costs use ``plan_zb2p``, which adapts to them.
"""

from __future__ import annotations

from ..core import Plan, loop_placement, make_plan
from ..costs import Costs
from ..rules import check_sizes, peak_memory, within
from .heuristic import AutoStrategy, list_schedule


def plan_zbh2(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
) -> Plan:
    """The ZB-H2 plan; ``ValueError`` if its peak memory under ``costs`` exceeds the limit."""
    p, m = num_ranks, n_microbatches
    check_sizes(p, m)
    costs = costs or Costs()
    costs.check(p)
    # The phases of the order this builds on rank r (docs/reference/orders/zbh2_p4_m8.csv):
    #   1. warm-up: 2(p - r) - 1 forwards, all that fit before the first gradient comes back
    #      (warmup_cap: the in-flight cap of each rank);
    #   2. steady state: each B as soon as its gradient arrives, a forward in the gap while one
    #      is left, a W when the next F would exceed 2p - 1 in flight (the memory cap);
    #   3. cool-down: the last Bs, Ws filling the gaps between them;
    #   4. drain: the remaining Ws, back to back (with m >= 2p - 1 the parallelogram's edge).
    warmup_cap = tuple(2 * (p - r) - 1 for r in range(p))
    unit = Costs().per_stage(p)  # F=B=W=1, one memory unit per microbatch in flight
    result = list_schedule(p, m, unit, float(2 * p - 1), AutoStrategy(max_inflight=warmup_cap))
    assert result is not None, "the unit-cost ZB-H2 schedule cannot stall"  # B always arrives
    plan = make_plan("ZBH2", p, m, loop_placement(p, p), result.orders)
    if memory_limit is not None:
        sc = costs.per_stage(p)
        for r, acts in plan.order.items():
            peak = peak_memory(acts, sc)
            if not within(peak, memory_limit):
                raise ValueError(
                    f"ZBH2: rank {r} needs peak memory {peak:g} above memory_limit "
                    f"{memory_limit:g} "
                    f"(ZB-H2 keeps up to 2p - 1 = {2 * p - 1} microbatches in flight); raise "
                    "memory_limit, or use the ZB2P / ZB1P plans (ScheduleZBAuto), which respect "
                    "a limit"
                )
    return plan
