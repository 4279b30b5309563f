"""The greedy, cost-aware list scheduler behind ZB-V, V-Half and V-Min (pure Python, no torch).

A V plan has ``2p`` stages; rank ``r`` holds stage ``r`` (its "chunk 0", on the way down) and
stage ``2p - 1 - r`` (its "chunk 1", on the way back up). The scheduler plays the pipeline as
events in time with the real F, B, W and comm costs: the rank that is free earliest decides
next, so everything it can see as ready is final. Its priorities are the Zero Bubble ones:

* B first: the input gradient is on the critical path of every earlier stage;
* then F, chunk 1 before chunk 0 (a chunk-1 forward brings the microbatch's B closer),
  but only if the rank's activation-memory budget allows it;
* W fills what is left: when nothing else is ready, or when memory blocks every F.

Memory is what makes the three V schedules differ: they run this same scheduler with a
smaller or larger per-rank budget. Deadlock freedom comes from one reservation rule: a
chunk-0 forward is allowed only if the rank could still afford the chunk-1 forward of the same
microbatch afterwards, so the oldest unfinished microbatch can always go all the way to its
last stage, and B and W (which only free memory in the usual cost models) never wait for it.

A few strategy knobs change tie-breaks; ``plan_zbv`` tries each and keeps the shortest plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .core import Action
from .costs import StageCosts
from .rules import EPS


@dataclass(frozen=True)
class VShapeStrategy:
    """Tie-break knobs of the greedy V scheduler (each combination gives one candidate plan)."""

    chunk0_lead: int | None = None
    """At most this many microbatches may be past chunk 0 but not yet through chunk 1 on a rank,
    on top of the memory budget (``None``: the budget alone limits the warm-up)."""
    lead_slope: int = 0
    """Rank ``r`` may have ``chunk0_lead + lead_slope * (p - 1 - r)`` such microbatches: early
    ranks wait longest for their chunk-1 forwards (ZB-V's warm-up has slope 2)."""
    w_wait: float = 0.0
    """When nothing is ready but a W is pending, wait instead of starting the W if a known F/B
    arrives within ``w_wait * W-time`` (0: always fill the gap with W)."""
    f_first: bool = False
    """Prefer a ready F over a ready B (memory then paces the forwards, as in ZB-V's steady
    state) instead of B first (the critical-path choice)."""
    w_before_f: bool = False
    """Run a pending W before a ready chunk-0 F once the rank has reached its memory high-water
    mark (keeps memory headroom for chunk-1 forwards)."""


@dataclass(frozen=True)
class GreedyResult:
    """The per-rank orders the greedy produced, with its own timing estimate."""

    order: dict[int, tuple[Action, ...]]
    makespan: float
    longest_span: float
    peak_memory: dict[int, float]


def _future_peak_after_f(c: StageCosts) -> float:
    """Highest level one microbatch's activations on this stage will reach, once its F ran."""
    return c.mem_f + max(0.0, c.mem_b)


def _future_peak_after_b(c: StageCosts) -> float:
    return max(0.0, c.mem_f + c.mem_b)


def min_budget(stage_costs: list[StageCosts], num_ranks: int) -> float:
    """The smallest per-rank budget the reservation rule can work with."""
    p = num_ranks
    return max(
        _future_peak_after_f(stage_costs[r]) + _future_peak_after_f(stage_costs[2 * p - 1 - r])
        for r in range(p)
    )


def greedy_v(
    num_ranks: int,
    n_microbatches: int,
    stage_costs: list[StageCosts],
    budget: float,
    strategy: VShapeStrategy,
) -> GreedyResult:
    """Build per-rank orders for a V placement by event-driven greedy list scheduling."""
    p, m = num_ranks, n_microbatches
    n_stages = 2 * p
    rank_of = [s if s < p else n_stages - 1 - s for s in range(n_stages)]
    chunks = [(r, n_stages - 1 - r) for r in range(p)]  # (chunk 0, chunk 1) of each rank

    f_end: dict[tuple[int, int], float] = {}
    next_f = [0] * n_stages  # F runs in microbatch order on each stage
    b_ready: list[list[tuple[float, int]]] = [[] for _ in range(n_stages)]  # heap (arrival, mb)
    w_queue: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # FIFO (stage, mb) per rank
    w_head = [0] * p
    time = [0.0] * p  # when the rank next decides (>= free: it may be idling until an arrival)
    free = [0.0] * p  # when the rank's last committed action ends
    reserved = [0.0] * p  # sum of future peaks of this rank's in-flight microbatches
    mem = [0.0] * p
    peak = [0.0] * p
    first_start: list[float | None] = [None] * p
    remaining = [3 * 2 * m] * p
    order: list[list[Action]] = [[] for _ in range(p)]
    blocked = [False] * p

    def arrival(src_stage: int, dst_stage: int, end: float) -> float:
        same = rank_of[src_stage] == rank_of[dst_stage]
        return end if same else end + stage_costs[src_stage].comm

    def f_arrival(s: int) -> float | None:
        mb = next_f[s]
        if mb >= m:
            return None
        if s == 0:
            return 0.0
        prev = f_end.get((s - 1, mb))
        return None if prev is None else arrival(s - 1, s, prev)

    def f_fits(r: int, s: int) -> bool:
        fp = _future_peak_after_f(stage_costs[s])
        if reserved[r] + fp > budget + EPS:
            return False
        c0, c1 = chunks[r]
        if s == c0:
            # Deadlock freedom: the microbatches stuck between this rank's two chunks must leave
            # room for one chunk-1 forward, whatever else is in flight (that drains on its own).
            waiting = next_f[c0] - next_f[c1] + 1
            if waiting * fp + _future_peak_after_f(stage_costs[c1]) > budget + EPS:
                return False
            lead = strategy.chunk0_lead
            if lead is not None and waiting > lead + strategy.lead_slope * (p - 1 - r):
                return False
        return True

    def run(r: int, a: Action, start: float) -> None:
        c = stage_costs[a.stage]
        end = start + c.time(a.kind)
        if first_start[r] is None:
            first_start[r] = start
        order[r].append(a)
        time[r] = free[r] = end
        remaining[r] -= 1
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            mem[r] += c.mem_f
            peak[r] = max(peak[r], mem[r])
            reserved[r] += _future_peak_after_f(c)
            next_f[s] += 1
            f_end[(s, mb)] = end
            if s == n_stages - 1:
                heapq.heappush(b_ready[s], (end, mb))
            else:
                wake(s + 1, arrival(s, s + 1, end))
        elif a.kind == "B":
            mem[r] += c.mem_b
            peak[r] = max(peak[r], mem[r])
            reserved[r] += _future_peak_after_b(c) - _future_peak_after_f(c)
            w_queue[r].append((s, mb))
            if s > 0:
                heapq.heappush(b_ready[s - 1], (arrival(s, s - 1, end), mb))
                wake(s - 1, arrival(s, s - 1, end))
        else:
            mem[r] += c.mem_w
            peak[r] = max(peak[r], mem[r])
            reserved[r] -= _future_peak_after_b(c)

    def wake(dst_stage: int, at: float) -> None:
        # a new dependency: a rank idling until a later arrival (or with nothing to wait for)
        # must reconsider at this arrival instead
        q = rank_of[dst_stage]
        if blocked[q]:
            blocked[q] = False
            time[q] = max(free[q], at)
        elif time[q] > free[q]:
            time[q] = max(free[q], min(time[q], at))

    def any_f_ready(r: int, t: float) -> bool:
        for s in chunks[r]:
            a = f_arrival(s)
            if a is not None and a <= t + EPS and f_fits(r, s):
                return True
        return False

    def decide(r: int) -> float | None:
        """Run one action on rank r, or return the time to wake up at (None: wait for events)."""
        t = time[r]
        c0, c1 = chunks[r]
        # B: the earliest arrived; ties to the later stage (deeper in the backward chain)
        best_b = None
        for s in (c1, c0):
            if b_ready[s] and b_ready[s][0][0] <= t + EPS:
                key = (b_ready[s][0][1], -s)
                if best_b is None or key < best_b[0]:
                    best_b = (key, s)
        if best_b is not None and not (strategy.f_first and any_f_ready(r, t)):
            s = best_b[1]
            _, mb = heapq.heappop(b_ready[s])
            run(r, Action(s, "B", mb), t)
            return t
        has_w = w_head[r] < len(w_queue[r])
        arrivals: list[float] = []
        for s in (c1, c0):
            a = f_arrival(s)
            if a is None:
                continue
            if not f_fits(r, s):
                continue  # only this rank's own B/W can unblock it
            if a <= t + EPS:
                if s == c0 and has_w and strategy.w_before_f and mem[r] + EPS >= max(peak[r], EPS):
                    break
                run(r, Action(s, "F", next_f[s]), t)
                return t
            arrivals.append(a)
        for s in (c1, c0):
            if b_ready[s]:
                arrivals.append(b_ready[s][0][0])
        if has_w:
            soon = min(arrivals, default=None)
            s, mb = w_queue[r][w_head[r]]
            w_time = stage_costs[s].w
            if soon is None or soon - t >= strategy.w_wait * w_time - EPS:
                w_head[r] += 1
                run(r, Action(s, "W", mb), t)
                return t
        if arrivals:
            return min(arrivals)
        return None

    while True:
        live = [r for r in range(p) if remaining[r] > 0 and not blocked[r]]
        if not live:
            if any(remaining):
                stuck = [r for r in range(p) if remaining[r]]
                raise RuntimeError(f"greedy V scheduler deadlocked on ranks {stuck} (bug)")
            break
        r = min(live, key=lambda q: (time[q], q))
        wake_at = decide(r)
        if wake_at is None:
            blocked[r] = True
        elif wake_at > time[r]:
            time[r] = wake_at

    return _greedy_result(order, first_start, time, peak)


def zbv_fb_order(
    num_ranks: int, n_microbatches: int, with_w: bool = False
) -> dict[int, list[Action]]:
    """The order of the ZB-V paper's hand-made schedule (Qi et al. 2024, Sec. 6).

    Rank ``r``: ``2(p - r) - 1`` chunk-0 forwards; ``r`` pairs (chunk-1 F, chunk-0 F);
    ``p - r`` pairs (chunk-1 F, chunk-1 B); then the steady (F0 B0 F1 B1) rounds, and the
    cool-down backwards. Without ``with_w`` W is left out and the executor places it where the
    real costs leave gaps; with it, W follows its B in warm-up and steady state and the
    cool-down's W come last, as in the paper's figure.
    Microbatches beyond ``n_microbatches`` (the warm-up needs ``2p - 1``) are dropped.
    """
    p = num_ranks
    mm = max(2 * p - 1, n_microbatches)
    out: dict[int, list[Action]] = {}
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        nf = {c0: 0, c1: 0}
        nb = {c0: 0, c1: 0}
        seq: list[Action] = []

        def f(s: int) -> None:
            seq.append(Action(s, "F", nf[s]))
            nf[s] += 1

        nw = {c0: 0, c1: 0}

        def b(s: int, w: bool = True) -> None:
            seq.append(Action(s, "B", nb[s]))
            nb[s] += 1
            if with_w and w:
                seq.append(Action(s, "W", nw[s]))
                nw[s] += 1

        for _ in range(2 * (p - r) - 1):
            f(c0)
        for _ in range(r):
            f(c1)
            f(c0)
        for _ in range(p - r):
            f(c1)
            b(c1)
        while nf[c1] < nf[c0] or nf[c0] < mm:
            if nf[c0] < mm:
                f(c0)
            b(c0)
            f(c1)
            b(c1)
        for _ in range(r):
            b(c0, w=False)
            b(c1, w=False)
        while nb[c0] < mm:
            b(c0)
        if with_w:
            for s in (c1, c0):
                while nw[s] < mm:
                    seq.append(Action(s, "W", nw[s]))
                    nw[s] += 1
        out[r] = [a for a in seq if a.microbatch < n_microbatches]
    return out


def execute_fb_order(
    num_ranks: int,
    n_microbatches: int,
    stage_costs: list[StageCosts],
    budget: float,
    fb_order: dict[int, list[Action]],
    eager_w: bool,
) -> GreedyResult | None:
    """Run a fixed per-rank F/B order and place every W by the real costs.

    A W runs when the rank's next F/B has not arrived yet (filling the gap), when that F
    would overflow ``budget``, or right after its B if ``eager_w``. Returns None if the
    order cannot be completed within ``budget`` (an F blocked by memory with no W to run).
    """
    p = num_ranks
    n_stages = 2 * p
    rank_of = [s if s < p else n_stages - 1 - s for s in range(n_stages)]
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    time = [0.0] * p
    first: list[float | None] = [None] * p
    mem = [0.0] * p
    peak = [0.0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    order: list[list[Action]] = [[] for _ in range(p)]

    def run(r: int, a: Action, start: float) -> None:
        c = stage_costs[a.stage]
        if first[r] is None:
            first[r] = start
        time[r] = start + c.time(a.kind)
        done[(a.kind, a.stage, a.microbatch)] = time[r]
        order[r].append(a)
        if a.kind == "F":
            mem[r] += c.mem_f
        elif a.kind == "B":
            mem[r] += c.mem_b
            if not fixed_w:
                pending_w[r].append((a.stage, a.microbatch))
        else:
            mem[r] += c.mem_w
        peak[r] = max(peak[r], mem[r])

    def arrival(a: Action) -> float | None:
        deps: list[tuple[str, int, int]] = []
        if a.kind == "F" and a.stage > 0:
            deps.append(("F", a.stage - 1, a.microbatch))
        if a.kind == "W":
            deps.append(("B", a.stage, a.microbatch))
        if a.kind == "B":
            deps.append(("F", a.stage, a.microbatch))
            if a.stage < n_stages - 1:
                deps.append(("B", a.stage + 1, a.microbatch))
        t = 0.0
        for d in deps:
            if d not in done:
                return None
            extra = stage_costs[d[1]].comm if rank_of[d[1]] != rank_of[a.stage] else 0.0
            t = max(t, done[d] + extra)
        return t

    def pop_w(r: int) -> None:
        s, mb = pending_w[r].pop(0)
        run(r, Action(s, "W", mb), time[r])

    fixed_w = any(a.kind == "W" for acts in fb_order.values() for a in acts)
    total = sum(len(v) for v in fb_order.values())
    finished = 0
    while finished < total:
        progress = False
        # the rank whose next action could start earliest goes first: causal, like a simulator
        cands = []
        for r in range(p):
            if pos[r] < len(fb_order[r]):
                a = fb_order[r][pos[r]]
                t = arrival(a)
                if t is not None:
                    cands.append((max(t, time[r]), r))
        if not cands:
            return None
        start, r = min(cands)
        a = fb_order[r][pos[r]]
        c = stage_costs[a.stage]
        if eager_w and pending_w[r]:
            pop_w(r)
            continue
        if a.kind == "F" and mem[r] + c.mem_f > budget + EPS:
            if not pending_w[r]:
                return None
            pop_w(r)
            continue
        if start > time[r] + EPS and pending_w[r]:
            pop_w(r)  # fill the gap before the next F/B arrives
            continue
        run(r, a, start)
        pos[r] += 1
        finished += 1
        progress = True
        assert progress
    for r in range(p):
        while pending_w[r]:
            pop_w(r)
    return _greedy_result(order, first, time, peak)


def _greedy_result(order: dict, first_start: list, ends: list, peak: list) -> GreedyResult:
    """Package a timed per-rank order (start of each rank's first action, end of its last)."""
    p = len(ends)
    starts = [fs or 0.0 for fs in first_start]
    return GreedyResult(
        order={r: tuple(order[r]) for r in range(p)},
        makespan=max(ends) - min(starts),
        longest_span=max(e - s for s, e in zip(starts, ends)),
        peak_memory={r: peak[r] for r in range(p)},
    )
