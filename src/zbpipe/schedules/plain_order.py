"""Never slower than the plain order: a zero-bubble plan that does not beat it is not run.

Splitting the backward pays only where W fills a bubble; where it cannot (a W that costs nearly
nothing, sends long enough that no gap opens, a heavy head on a V rank), the zero-bubble plan
for the costs can be slower in simulation than the plain order of the same placement: 1F1B for
one stage per rank (loop), interleaved 1F1B
(:func:`zbpipe.planning.loop.interleaved.plan_interleaved_1f1b`) for several, the V placement's
1F1B-style order
(:func:`zbpipe.planning.v.plain.plan_v_1f1b`) for two. Every plan a schedule makes, at
construction and in both re-plans (the bytes after the first step,
:mod:`~zbpipe.schedules.memory_replan`; the times under ``costs="profile"``,
:mod:`~zbpipe.schedules.replan`), goes through :func:`never_slower` (from
``PlannedSchedule.make_plan``): where the plain order is strictly faster under the costs the
plan was made for and holds no more than the plan's memory budget, the plain order runs, and
rank 0 says so once at INFO. Both plans are pure functions of the costs, which every rank holds
alike, so every rank makes the same choice without an exchange.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..planning import Costs, Plan, simulate
from ..planning.core import EPS
from .memory_promise import INSTEAD_OF, promised_budget

logger = logging.getLogger(__name__)


def plain_plan(sched: Any, costs: Costs) -> Plan | None:
    """The plain order of ``sched``'s placement (1F1B; interleaved 1F1B for several loop stages
    per rank; the V placement's 1F1B-style order), or None where there is none here."""
    p, m = sched.pp_group_size, sched._n_microbatches
    chunks = sched._num_stages // p
    if sched.layout == "loop" and chunks == 1:
        from ..planning.loop.onef1b import plan_1f1b

        return plan_1f1b(p, m, costs)
    if sched.layout == "loop" and chunks > 1:
        from ..planning.loop.interleaved import plan_interleaved_1f1b

        try:
            return plan_interleaved_1f1b(p, m, costs, chunks)
        except ValueError:  # a microbatch count interleaved 1F1B cannot take: no plain order
            return None
    if sched.layout == "v" and chunks == 2:
        from ..planning.v.plain import plan_v_1f1b

        return plan_v_1f1b(p, m, costs)
    return None


def never_slower(sched: Any, plan: Plan, costs: Costs) -> Plan:
    """``plan``, or the plain order where it is strictly faster in simulation under ``costs``
    and its peak keeps ``plan``'s budget (its meta then says which plan it replaced, and the
    budget, so the re-planners judge it by that plan's promise).

    Left alone: a plan without a split backward (1F1B, one microbatch in flight), one with
    overlapped pairs (DualPipeV: what they hide, the simulator knows only from ``Costs.a2a``).
    """
    if not plan.uses_split_backward() or plan.pairs:
        return plan
    plain = plain_plan(sched, costs)
    if plain is None:
        return plan
    mine, theirs = simulate(plan, costs), simulate(plain, costs)
    if not theirs.makespan < mine.makespan * (1 - 1e-9):
        return plan
    budget = promised_budget(sched, plan, costs)
    if budget is None:  # (no promise known: hold no more than the zero-bubble plan would)
        budget = max(mine.peak_memory.values())
    if max(theirs.peak_memory.values()) > budget * (1 + 1e-9) + EPS:
        return plan
    chosen = dataclasses.replace(
        plain, meta={**plain.meta, INSTEAD_OF: plan.name, "memory_budget": budget}
    )
    if sched.rank == 0 and not getattr(sched, "plain_order_said", False):
        sched.plain_order_said = True
        logger.info(
            "zbpipe: %s runs the plain order of its placement (%s) instead of its %s plan: for "
            "the costs it plans with (%s) the plain order's simulated step time is %.3fx the %s "
            "plan's, within the same memory budget; a re-plan for measured costs may switch back",
            type(sched).__name__,
            plain.name,
            plan.name,
            _describe(costs),
            theirs.makespan / mine.makespan,
            plan.name,
        )
    return chosen


def _describe(costs: Costs) -> str:
    """``F=[..] B=[..] W=[..] comm=[..]``: the time fields, per stage."""

    def fmt(v: Any) -> str:
        return "[" + ",".join(f"{x:g}" for x in (v if isinstance(v, tuple) else (v,))) + "]"

    return f"F={fmt(costs.f)} B={fmt(costs.b)} W={fmt(costs.w)} comm={fmt(costs.comm)}"
