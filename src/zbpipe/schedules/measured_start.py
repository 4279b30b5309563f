"""A V schedule's first step measures the bytes before it holds more than one microbatch.

A V rank holds the model's first chunk and its last (the head) together, so no order made before
the bytes are known keeps ZB-V's promise (1F1B's peak) or V-Half's and V-Min's formulas whatever
the head weighs: the order for equal bytes went 1.45x over on a GPT whose head weighs a few
blocks (docs/results/memory-promise.md). Nor does knowing only the forward's bytes: a rank
that holds the head's backward and the first chunk's forwards together can hold more than any
1F1B rank, which holds one stage's. The first step of ``ScheduleZBV`` (all three modes)
therefore runs in two parts:

1. **microbatch 0 through the V and back**, alone: rank ``r`` runs F of its chunk ``r``, F of
   its chunk ``2p - 1 - r``, then their input-gradient passes B in reverse (one microbatch of
   each of its chunks: the least any plan holds, the floor every budget is checked against),
   while the memory probe records what each chunk holds after its F and after its B;
2. one ``all_gather_object`` of those bytes, the plan for them (the re-plan every schedule
   makes after its first step: :meth:`~zbpipe.schedules.memory_replan.MemoryReplanner.choose`),
   and **the rest of the step**: that plan's order without what already ran, lowered to torch's
   actions and run, microbatch 0's W first on every rank but rank 0 (those ranks wait for
   microbatch 1 then) or where the plan puts them: the fastest in simulation that keeps the
   plan's budget (:func:`rest_after`), else one microbatch in flight. From the next step on,
   the plan runs whole.

The price is microbatch 0's round trip with the other ranks idle (simulated at unit costs: 1.16x
a step at p = 2, m = 4; 1.08x at m = 8; 1.24x at p = 4, m = 8) and the plan made in the middle
of the step instead of after it: docs/results/memory-promise.md has what it cost on real runs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .. import _compat as C
from ..planning import Costs, Plan, simulate
from ..planning.core import Action
from ..planning.fuse import fuse_adjacent_backward
from ..planning.one_in_flight import plan_one_in_flight
from ..planning.rules import within
from .action_loop import bind_program
from .memory_promise import promised_budget
from .sends import proven_sends

logger = logging.getLogger(__name__)


def applies(sched: Any) -> bool:
    """A V schedule whose first step is probed for a promise, not for a numeric or byte budget."""
    return (
        sched.layout == "v"
        and bool(getattr(sched, "safe_first_step", False))
        and "memory_limit" not in sched._plan_options
        and getattr(sched, "byte_budget", None) is None
        and not sched.plan.pairs
    )


def round_trip(sched: Any) -> dict[int, list[Action]]:
    """Microbatch 0's passes on each rank: F down and up the V, then B back (W waits)."""
    p = sched.pp_group_size
    return {
        r: [Action(r, "F", 0), Action(2 * p - 1 - r, "F", 0)]
        + [Action(2 * p - 1 - r, "B", 0), Action(r, "B", 0)]
        for r in range(p)
    }


class MeasuredStart:
    """Runs a V schedule's first step in two parts (the module docstring)."""

    def __init__(self, sched: Any) -> None:
        self.prefix = round_trip(sched)

    def run(self, sched: Any, ctx: Any) -> None:
        """Run the first step's actions (call in place of the program's ``run``)."""
        # microbatch 0's backward is split (B, then W): its forward opens the engine's scope
        sched.seam.split_keys = {(s, 0) for s in sched.seam.stages}
        sched.seam.store_bw_keys = ()
        self._program(sched, self.prefix).run(ctx)
        sched._sends.wait_all()
        replanner = sched._memory_replanner
        replanner.done = True  # the bytes are measured: the plan is made now, not after the step
        sched.seam.probe = None
        chosen = replanner.choose(sched)
        costs = sched.memory_costs  # None where no plan could be made for the measured bytes
        budget = None if costs is None else promised_budget(sched, chosen, costs)
        rest = rest_after(chosen, self.prefix, costs, budget)
        order = {r: self.prefix[r] + rest[r] for r in rest}
        first = dataclasses.replace(chosen, order=order, pairs=frozenset())
        first.validate()
        executed = fuse_adjacent_backward(
            first, keep_split={(s, 0) for s in range(sched._num_stages)}
        )
        sched.seam.assign(executed.order[sched.rank])
        sched.executed_plan = executed
        sched.plan = chosen  # lowered whole after this step (lowered_for_probe)
        skipped = len(self.prefix[sched.rank])
        self._program(sched, {r: list(a)[skipped:] for r, a in executed.order.items()}).run(ctx)

    def _program(self, sched: Any, order: dict[int, list[Action]]) -> Any:
        """Lower ``order`` (one part of the step: its sends and receives pair up inside it) to
        torch's actions and bind it."""
        C.lower_part(
            sched,
            {
                r: [C.torch_action(a.stage, C.KIND_TO_TORCH[a.kind], a.microbatch) for a in acts]
                for r, acts in order.items()
            },
        )
        placement = sched.plan.placement
        sched._sends.set_proofs(
            proven_sends(C.order_with_comms(sched), sched.rank, placement.__getitem__)
        )
        functions = C.custom_functions(sched)
        return bind_program(
            sched, C.order_with_comms(sched), sched.action_binders, functions, sched._run_action
        )


def rest_after(
    plan: Plan, prefix: dict[int, list[Action]], costs: Costs | None, budget: float | None
) -> dict[int, list[Action]]:
    """``plan``'s order without the passes ``prefix`` ran, with microbatch 0's W first on every
    rank but rank 0, as they are, or first on every rank (microbatch 0 then holds nothing when
    the rest begins: at every point the rest holds at most what the plan holds there): the
    fastest of those that keeps ``budget`` under ``costs`` (the measured bytes; None: not
    measured, no check: the plan's order as it is); else one microbatch in flight."""
    rest = _without(plan.order, prefix)
    if costs is None or budget is None:
        return rest
    # where one microbatch in flight already holds more than the budget, the plan holds that
    # least amount instead (memory_promise): the rest may hold what the plan itself holds
    budget = max(budget, max(simulate(plan, costs).peak_memory.values()))

    def w_first(ranks: range) -> dict[int, list[Action]]:
        return {
            r: sorted(acts, key=lambda a: r in ranks and not (a.kind == "W" and a.microbatch == 0))
            for r, acts in rest.items()
        }

    # Every rank but rank 0 waits for microbatch 1 after its round trip (rank 0 sends it last):
    # its microbatch-0 W fill that wait, and it holds nothing of microbatch 0 when the rest
    # begins. The fastest candidate that keeps the budget (ties: the earlier) runs.
    best: tuple[float, dict[int, list[Action]]] | None = None
    for candidate in (w_first(range(1, plan.num_ranks)), rest, w_first(range(plan.num_ranks))):
        try:
            moved = dataclasses.replace(
                plan, order={r: prefix[r] + candidate[r] for r in candidate}, pairs=frozenset()
            )
            moved.validate()
            sim = simulate(moved, costs)
            if within(max(sim.peak_memory.values()), budget):
                if best is None or sim.makespan < best[0] * (1 - 1e-9):
                    best = (sim.makespan, candidate)
        except ValueError as e:  # running microbatch 0 first deadlocks this order
            logger.debug("zbpipe memory: the first step's rest cannot follow %s (%s)", plan, e)
    if best is not None:
        return best[1]
    return _without(plan_one_in_flight(plan.num_ranks, plan.n_microbatches, "v").order, prefix)


def _without(
    order: dict[int, list[Action]], prefix: dict[int, list[Action]]
) -> dict[int, list[Action]]:
    """``order`` without the passes ``prefix`` ran (microbatch 0's fused BW as its W)."""
    done = {a for acts in prefix.values() for a in acts}
    return {
        r: [b for a in acts if a not in done for b in _split_first(a)] for r, acts in order.items()
    }


def _split_first(a: Action) -> list[Action]:
    """Microbatch 0's fused backward as its W alone (its B ran in the round trip); the plan's
    own order keeps every other action as it is."""
    if a.kind == "BW" and a.microbatch == 0:
        return [Action(a.stage, "W", 0)]
    return [a]
