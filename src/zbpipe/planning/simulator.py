"""Event-driven simulator: run a plan on the cost model and validate it (pure Python).

Semantics (shared with the runtime):

* each rank runs its order strictly in sequence;
* ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` / ``BW(s, m)`` need ``F(s, m)`` and the input
  gradient from ``B``/``BW(s+1, m)`` (the last stage needs only its ``F``); ``W(s, m)`` needs
  ``B(s, m)``;
* a dependency produced on another rank arrives ``comm`` (of the producing stage) after it
  ends; on the same rank there is no communication;
* sends never block (torch posts isend/irecv), so only a receive can stall a rank;
* ``F`` allocates ``mem_f`` when it starts, ``B``/``W``/``BW`` change memory when they end.

Every action's start time is fixed once its dependencies' end times are, so the simulator
schedules an action as soon as the actions it needs are scheduled (a worklist over ranks):
each action is looked at O(1) times, and p=32, m=256 takes a fraction of a second.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from .core import Action, Plan, PlanError
from .costs import Costs, StageCosts
from .metrics import bubble_rate as _bubble_rate
from .rules import Value, describe, first_overflow, makes, needs, peak_memory


@dataclass(frozen=True)
class Interval:
    """One action as it ran in the simulation."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What ``simulate`` measured."""

    makespan: float
    """First start to last end over all ranks (what throughput comparisons use)."""
    bubble_rate: float
    """``1 - sum(busy) / (num_ranks * longest rank span)``: the paper's definition."""
    peak_memory: dict[int, float]
    """Per rank, the peak activation memory in the units of ``Costs``."""
    timeline: dict[int, tuple[Interval, ...]]
    """Per rank, its actions with start and end times, in execution order."""
    busy: dict[int, float]
    """Per rank, the total compute time."""

    def summary(self) -> str:
        """A few lines for a terminal: makespan, bubble rate, per-rank peak memory."""
        peaks = " ".join(f"{r}:{v:g}" for r, v in sorted(self.peak_memory.items()))
        return (
            f"makespan {self.makespan:.4g}  bubble rate {self.bubble_rate:.2%}  "
            f"max peak memory {max(self.peak_memory.values(), default=0.0):g}\n"
            f"peak memory per rank: {peaks}"
        )


def _check_same_rank_order(plan: Plan, where: dict[Value, tuple[int, int]]) -> None:
    """A dependency on the same rank must come earlier in that rank's order."""
    last = plan.num_stages - 1
    for rank, actions in plan.order.items():
        for step, a in enumerate(actions):
            for key in needs(a, last):
                src_rank, src_step = where[key]
                if src_rank == rank and src_step > step:
                    raise PlanError(
                        f"plan {plan.name}: rank {rank} step {step} ({a}) needs "
                        f"{describe(key)}, which the same rank runs later at step {src_step}; "
                        "reorder so the producer comes first"
                    )


def simulate(
    plan: Plan, costs: Costs | None = None, memory_limit: float | None = None
) -> SimResult:
    """Run ``plan`` on the cost model; raise ``PlanError`` if it is wrong, deadlocks or overflows.

    ``memory_limit`` is per rank, in the memory units of ``costs``.
    """
    costs = costs or Costs()
    costs.check(plan.num_stages)
    plan.validate()
    sc = [costs.stage(s) for s in range(plan.num_stages)]
    last = plan.num_stages - 1

    where: dict[Value, tuple[int, int]] = {}
    for rank, actions in plan.order.items():
        for step, a in enumerate(actions):
            for key in makes(a):
                where[key] = (rank, step)
    _check_same_rank_order(plan, where)
    peak = _peak_memory(plan, sc, memory_limit)

    ready_at: dict[Value, float] = {}  # when a produced value can be used, per consuming rank kind
    produced_on: dict[Value, int] = {}
    waiting: dict[Value, list[int]] = defaultdict(list)
    pos = {r: 0 for r in plan.order}
    free = {r: 0.0 for r in plan.order}
    timeline: dict[int, list[Interval]] = {r: [] for r in plan.order}
    todo = list(plan.order)
    while todo:
        rank = todo.pop()
        actions = plan.order[rank]
        while pos[rank] < len(actions):
            a = actions[pos[rank]]
            start = free[rank]
            blocked = None
            for key in needs(a, last):
                if key not in ready_at:
                    blocked = key
                    break
                t = ready_at[key]
                if produced_on[key] != rank:
                    t += sc[key[0]].comm
                start = max(start, t)
            if blocked is not None:
                waiting[blocked].append(rank)
                break
            end = start + sc[a.stage].time(a.kind)
            timeline[rank].append(Interval(rank, a, start, end))
            free[rank] = end
            pos[rank] += 1
            for key in makes(a):
                ready_at[key] = end
                produced_on[key] = rank
                todo.extend(waiting.pop(key, ()))

    stuck = {r: pos[r] for r in plan.order if pos[r] < len(plan.order[r])}
    if stuck:
        raise PlanError(_deadlock_message(plan, stuck, ready_at, where))

    intervals = {r: [(iv.start, iv.end) for iv in ivs] for r, ivs in timeline.items()}
    starts = [ivs[0].start for ivs in timeline.values() if ivs]
    ends = [ivs[-1].end for ivs in timeline.values() if ivs]
    return SimResult(
        makespan=max(ends) - min(starts),
        bubble_rate=_bubble_rate(intervals),
        peak_memory=peak,
        timeline={r: tuple(ivs) for r, ivs in timeline.items()},
        busy={r: sum(iv.end - iv.start for iv in ivs) for r, ivs in timeline.items()},
    )


def _peak_memory(plan: Plan, sc: list[StageCosts], memory_limit: float | None) -> dict[int, float]:
    """Per-rank peak memory (see :mod:`.rules`); raise if ``memory_limit`` is exceeded."""
    if memory_limit is not None:
        for rank, actions in plan.order.items():
            over = first_overflow(actions, sc, memory_limit)
            if over is not None:
                step, mem = over
                raise PlanError(
                    f"plan {plan.name}: rank {rank} step {step} ({actions[step]}) raises "
                    f"activation memory to {mem:g}, above memory_limit {memory_limit:g}; raise "
                    "the limit or use a schedule with fewer microbatches in flight"
                )
    return {rank: peak_memory(actions, sc) for rank, actions in plan.order.items()}


def _deadlock_message(
    plan: Plan,
    stuck: Mapping[int, int],
    ready_at: Mapping[Value, float],
    where: Mapping[Value, tuple[int, int]],
) -> str:
    last = plan.num_stages - 1
    lines = [f"plan {plan.name} deadlocks: ranks {sorted(stuck)} wait on each other"]
    for rank, step in sorted(stuck.items()):
        a = plan.order[rank][step]
        missing = [k for k in needs(a, last) if k not in ready_at]
        for key in missing:
            src_rank, src_step = where[key]
            lines.append(
                f"  rank {rank} step {step} ({a}) waits for {describe(key)}, "
                f"run by rank {src_rank} at step {src_step} ({plan.order[src_rank][src_step]})"
            )
    return "\n".join(lines)
