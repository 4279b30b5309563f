"""Event-driven simulator: run a plan on the cost model and validate it (pure Python).

Semantics (shared with the runtime):

* each rank runs its order strictly in sequence;
* ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` / ``BW(s, m)`` need ``F(s, m)`` and the input
  gradient from ``B``/``BW(s+1, m)`` (the last stage needs only its ``F``); ``W(s, m)`` needs
  ``B(s, m)``;
* a dependency produced on another rank arrives ``comm`` (of the producing stage) after it
  ends; on the same rank there is no communication;
* sends never block (torch posts isend/irecv), so only a receive can stall a rank;
* ``F`` allocates ``mem_f`` when it starts, ``B``/``W``/``BW`` change memory when they end;
* an F and a B or BW (or F, B and W) each wait for the stage's own collectives (``a2a``), except
  in an overlapped pair (``Plan.pairs``): the pair starts once both halves' inputs are there
  and runs for :func:`~zbpipe.planning.costs.pair_time`; both halves' results are there at its
  end. The timeline draws the pair's two actions one after the other, sharing its time in
  proportion to their compute.

Every action's start time is fixed once its dependencies' end times are, so the simulator
schedules an action as soon as the actions it needs are scheduled (a worklist over ranks):
each action is looked at O(1) times, and p=32, m=256 takes a fraction of a second.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from .core import Action, Plan, PlanError
from .costs import Costs, StageCosts, pair_time
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


def _inputs(
    plan: Plan, sc: list[StageCosts]
) -> tuple[dict[Value, tuple[int, int]], list[tuple[tuple[int, float], ...]]]:
    """Where each value is made (``(rank, step)``); and per action (numbered rank by rank, each
    rank in order) the numbers of the actions it waits for, each with the delay after that one's
    end (the producing stage's ``comm`` if it ran on another rank, else 0).

    Raises ``PlanError`` if a dependency on the same rank comes later in that rank's order.
    """
    last = plan.num_stages - 1
    where: dict[Value, tuple[int, int]] = {}
    for rank, actions in plan.order.items():
        for step, a in enumerate(actions):
            for key in makes(a):
                where[key] = (rank, step)
    first = _first_numbers(plan)
    out: list[tuple[tuple[int, float], ...]] = []
    for rank, actions in plan.order.items():
        for step, a in enumerate(actions):
            inputs = []
            for key in needs(a, last):
                src_rank, src_step = where[key]
                if src_rank == rank and src_step > step:
                    raise PlanError(
                        f"plan {plan.name}: rank {rank} step {step} ({a}) needs "
                        f"{describe(key)}, which the same rank runs later at step {src_step}; "
                        "reorder so the producer comes first"
                    )
                delay = sc[key[0]].comm if src_rank != rank else 0.0
                inputs.append((first[src_rank] + src_step, delay))
            out.append(tuple(inputs))
    return where, out


def _first_numbers(plan: Plan) -> dict[int, int]:
    """The number of each rank's first action when the actions are numbered rank by rank."""
    first, n = {}, 0
    for rank, actions in plan.order.items():
        first[rank] = n
        n += len(actions)
    return first


def simulate(
    plan: Plan,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    microbatch_scale: Sequence[float] | None = None,
) -> SimResult:
    """Run ``plan`` on the cost model; raise ``PlanError`` if it is wrong, deadlocks or overflows.

    ``memory_limit`` is per rank, in the memory units of ``costs``. ``microbatch_scale`` (one
    factor per microbatch, e.g. from :func:`zbpipe.planning.by_cost.token_scales`) multiplies
    every action time of that microbatch: microbatches of different lengths. Memory is not
    scaled (the peak is the equal-microbatch one).
    """
    begin, end, peak = _run(plan, costs, memory_limit, microbatch_scale)
    first = _first_numbers(plan)
    if plan.pairs:
        begin, end = _drawn_pairs(plan, costs or Costs(), begin, end)
    timeline = {
        r: tuple(
            Interval(r, a, begin[first[r] + i], end[first[r] + i]) for i, a in enumerate(actions)
        )
        for r, actions in plan.order.items()
    }
    intervals = {r: [(iv.start, iv.end) for iv in ivs] for r, ivs in timeline.items()}
    starts = [ivs[0].start for ivs in timeline.values() if ivs]
    ends = [ivs[-1].end for ivs in timeline.values() if ivs]
    return SimResult(
        makespan=max(ends) - min(starts),
        bubble_rate=_bubble_rate(intervals),
        peak_memory=peak,
        timeline=timeline,
        busy={r: sum(iv.end - iv.start for iv in ivs) for r, ivs in timeline.items()},
    )


@dataclass(frozen=True)
class Timing:
    """What a plan generator ranks candidates by: :func:`simulate` without the timeline."""

    makespan: float
    longest_span: float
    """The longest rank span (a rank's first start to its last end): the bubble rate's
    denominator."""
    peak_memory: dict[int, float]


def simulate_timing(
    plan: Plan,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    microbatch_scale: Sequence[float] | None = None,
) -> Timing:
    """:func:`simulate`'s checks, errors and numbers, without making an ``Interval`` per action
    (most of a simulation's time when a generator only compares makespans and spans)."""
    begin, end, peak = _run(plan, costs, memory_limit, microbatch_scale)
    first = _first_numbers(plan)
    spans = [
        (begin[first[r]], end[first[r] + len(actions) - 1])
        for r, actions in plan.order.items()
        if actions
    ]
    return Timing(
        makespan=max(e for _, e in spans) - min(s for s, _ in spans),
        longest_span=max(e - s for s, e in spans),
        peak_memory=peak,
    )


def _run(
    plan: Plan,
    costs: Costs | None,
    memory_limit: float | None,
    microbatch_scale: Sequence[float] | None = None,
) -> tuple[list[float], list[float], dict[int, float]]:
    """Check and time ``plan``: each action's start and end (numbered rank by rank, each rank in
    order) and each rank's peak memory."""
    costs = costs or Costs()
    costs.check(plan.num_stages)
    plan.validate()
    scale = _check_scale(microbatch_scale, plan.n_microbatches)
    sc = [costs.stage(s) for s in range(plan.num_stages)]

    # Dependencies resolved once to action numbers: the loop below runs on plain lists.
    where, inputs = _inputs(plan, sc)
    peak = _peak_memory(plan, sc, memory_limit)

    first = _first_numbers(plan)
    end = [-1.0] * sum(len(actions) for actions in plan.order.values())  # -1: not run yet
    durations = _durations(plan, sc, scale)
    paired = _paired_numbers(plan, sc, first, durations, scale)
    begin = [0.0] * len(end)
    waiting: dict[int, list[int]] = defaultdict(list)  # action number -> ranks waiting for it
    pos = {r: 0 for r in plan.order}
    free = {r: 0.0 for r in plan.order}
    todo = list(plan.order)
    while todo:
        rank = todo.pop()
        n_actions, first_id = len(plan.order[rank]), first[rank]
        i, t = pos[rank], free[rank]
        while i < n_actions:
            me = first_id + i
            width = 2 if me in paired else 1  # an overlapped pair: both halves' inputs, one run
            start = t
            blocked = -1
            for src, delay in inputs[me] if width == 1 else inputs[me] + inputs[me + 1]:
                if end[src] < 0.0:
                    blocked = src
                    break
                start = max(start, end[src] + delay)
            if blocked >= 0:
                waiting[blocked].append(rank)
                break
            t = start + durations[me]
            for k in range(me, me + width):
                begin[k], end[k] = start, t
                if k in waiting:
                    todo.extend(waiting.pop(k))
            i += width
        pos[rank], free[rank] = i, t

    stuck = {r: pos[r] for r in plan.order if pos[r] < len(plan.order[r])}
    if stuck:
        made = {key for r in plan.order for a in plan.order[r][: pos[r]] for key in makes(a)}
        raise PlanError(_deadlock_message(plan, stuck, made, where))
    return begin, end, peak


def _durations(plan: Plan, sc: list[StageCosts], scale: list[float] | None) -> list[float]:
    """Each action's time, numbered rank by rank (times its microbatch's factor, if given)."""
    out: list[float] = []
    for actions in plan.order.values():
        if scale is None:
            out += [sc[a.stage].time(a.kind) for a in actions]
        else:
            out += [sc[a.stage].time(a.kind) * scale[a.microbatch] for a in actions]
    return out


def _check_scale(scale: Sequence[float] | None, m: int) -> list[float] | None:
    """``microbatch_scale`` as a list, or a ``ValueError`` that says what is wrong with it."""
    if scale is None:
        return None
    out = [float(x) for x in scale]
    if len(out) != m:
        raise ValueError(f"microbatch_scale has {len(out)} factors for {m} microbatches; give {m}")
    if not all(0.0 < x < float("inf") for x in out):
        raise ValueError(f"microbatch_scale must be finite numbers > 0, got {list(scale)}")
    return out


def _scaled(c: StageCosts, k: float) -> StageCosts:
    """``c`` for a microbatch ``k`` times as costly (times only)."""
    return replace(c, f=c.f * k, b=c.b * k, w=c.w * k, a2a=c.a2a * k)


def _paired_numbers(
    plan: Plan,
    sc: list[StageCosts],
    first: Mapping[int, int],
    durations: list[float],
    scale: list[float] | None = None,
) -> set[int]:
    """The numbers of the F actions that start a pair; each one's duration becomes the pair's."""
    out: set[int] = set()
    if not plan.pairs:
        return out
    starts = plan.paired_first()
    for rank, actions in plan.order.items():
        for step, a in enumerate(actions):
            if a in starts:
                me = first[rank] + step
                b = actions[step + 1]
                ca, cb = sc[a.stage], sc[b.stage]
                if scale is not None:
                    ca, cb = _scaled(ca, scale[a.microbatch]), _scaled(cb, scale[b.microbatch])
                durations[me] = pair_time(ca, cb, b.kind)
                out.add(me)
    return out


def _drawn_pairs(
    plan: Plan, costs: Costs, begin: list[float], end: list[float]
) -> tuple[list[float], list[float]]:
    """Begin and end times with each pair's time shared by its two actions in proportion to
    their compute (for the timeline and its busy time; dependencies used the pair's end)."""
    begin, end = list(begin), list(end)
    first = _first_numbers(plan)
    starts = plan.paired_first()
    for rank, actions in plan.order.items():
        for step, a in enumerate(actions):
            if a in starts:
                me = first[rank] + step
                b = actions[step + 1]
                cf, cb = costs.stage(a.stage).compute("F"), costs.stage(b.stage).compute(b.kind)
                share = cf / (cf + cb) if cf + cb > 0 else 0.5
                end[me] = begin[me + 1] = begin[me] + share * (end[me] - begin[me])
    return begin, end


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
    made: AbstractSet[Value],
    where: Mapping[Value, tuple[int, int]],
) -> str:
    last = plan.num_stages - 1
    lines = [f"plan {plan.name} deadlocks: ranks {sorted(stuck)} wait on each other"]
    starts = plan.paired_first()
    for rank, step in sorted(stuck.items()):
        a = plan.order[rank][step]
        missing = [k for k in needs(a, last) if k not in made]
        if a in starts:  # an overlapped pair waits for its backward's inputs too
            missing += [k for k in needs(plan.order[rank][step + 1], last) if k not in made]
        for key in missing:
            src_rank, src_step = where[key]
            lines.append(
                f"  rank {rank} step {step} ({a}) waits for {describe(key)}, "
                f"run by rank {src_rank} at step {src_step} ({plan.order[src_rank][src_step]})"
            )
    return "\n".join(lines)
