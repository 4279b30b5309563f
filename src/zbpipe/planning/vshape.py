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
from .rules import EPS, Value, makes, needs, within


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


class _VGreedy:
    """The state of one greedy V run; :meth:`decide` is the module docstring's priorities."""

    def __init__(
        self, p: int, m: int, stage_costs: list[StageCosts], budget: float, strategy: VShapeStrategy
    ) -> None:
        n_stages = 2 * p
        self.p, self.m, self.sc, self.budget, self.strategy = p, m, stage_costs, budget, strategy
        self.n_stages = n_stages
        self.rank_of = [s if s < p else n_stages - 1 - s for s in range(n_stages)]
        self.chunks = [(r, n_stages - 1 - r) for r in range(p)]  # (chunk 0, chunk 1) per rank
        self.f_end: dict[tuple[int, int], float] = {}
        self.next_f = [0] * n_stages  # F runs in microbatch order on each stage
        self.b_ready: list[list[tuple[float, int]]] = [[] for _ in range(n_stages)]  # (arr, mb)
        self.w_queue: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # FIFO (stage, mb)
        self.w_head = [0] * p
        self.time = [0.0] * p  # when the rank next decides (>= free: it may idle to an arrival)
        self.free = [0.0] * p  # when the rank's last committed action ends
        self.reserved = [0.0] * p  # sum of future peaks of this rank's in-flight microbatches
        self.mem = [0.0] * p
        self.peak = [0.0] * p
        self.first_start: list[float | None] = [None] * p
        self.remaining = [3 * 2 * m] * p
        self.order: list[list[Action]] = [[] for _ in range(p)]
        self.blocked = [False] * p

    def arrival(self, src_stage: int, dst_stage: int, end: float) -> float:
        same = self.rank_of[src_stage] == self.rank_of[dst_stage]
        return end if same else end + self.sc[src_stage].comm

    def f_arrival(self, s: int) -> float | None:
        mb = self.next_f[s]
        if mb >= self.m:
            return None
        if s == 0:
            return 0.0
        prev = self.f_end.get((s - 1, mb))
        return None if prev is None else self.arrival(s - 1, s, prev)

    def f_fits(self, r: int, s: int) -> bool:
        fp = _future_peak_after_f(self.sc[s])
        if not within(self.reserved[r] + fp, self.budget):
            return False
        c0, c1 = self.chunks[r]
        if s == c0:
            # Deadlock freedom: the microbatches stuck between this rank's two chunks must leave
            # room for one chunk-1 forward, whatever else is in flight (that drains on its own).
            waiting = self.next_f[c0] - self.next_f[c1] + 1
            if not within(waiting * fp + _future_peak_after_f(self.sc[c1]), self.budget):
                return False
            lead = self.strategy.chunk0_lead
            if lead is not None and waiting > lead + self.strategy.lead_slope * (self.p - 1 - r):
                return False
        return True

    def run(self, r: int, a: Action, start: float) -> None:
        c = self.sc[a.stage]
        end = start + c.time(a.kind)
        if self.first_start[r] is None:
            self.first_start[r] = start
        self.order[r].append(a)
        self.time[r] = self.free[r] = end
        self.remaining[r] -= 1
        self.mem[r] += c.mem(a.kind)
        self.peak[r] = max(self.peak[r], self.mem[r])
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            self.reserved[r] += _future_peak_after_f(c)
            self.next_f[s] += 1
            self.f_end[(s, mb)] = end
            if s == self.n_stages - 1:
                heapq.heappush(self.b_ready[s], (end, mb))
            else:
                self.wake(s + 1, self.arrival(s, s + 1, end))
        elif a.kind == "B":
            self.reserved[r] += _future_peak_after_b(c) - _future_peak_after_f(c)
            self.w_queue[r].append((s, mb))
            if s > 0:
                heapq.heappush(self.b_ready[s - 1], (self.arrival(s, s - 1, end), mb))
                self.wake(s - 1, self.arrival(s, s - 1, end))
        else:
            self.reserved[r] -= _future_peak_after_b(c)

    def wake(self, dst_stage: int, at: float) -> None:
        # a new dependency: a rank idling until a later arrival (or with nothing to wait for)
        # must reconsider at this arrival instead
        q = self.rank_of[dst_stage]
        if self.blocked[q]:
            self.blocked[q] = False
            self.time[q] = max(self.free[q], at)
        elif self.time[q] > self.free[q]:
            self.time[q] = max(self.free[q], min(self.time[q], at))

    def any_f_ready(self, r: int, t: float) -> bool:
        for s in self.chunks[r]:
            a = self.f_arrival(s)
            if a is not None and a <= t + EPS and self.f_fits(r, s):
                return True
        return False

    def ready_b(self, r: int, t: float) -> int | None:
        """The stage whose B runs now: the earliest arrived, ties to the later stage."""
        best: tuple[tuple[int, int], int] | None = None
        for s in reversed(self.chunks[r]):
            q = self.b_ready[s]
            if q and q[0][0] <= t + EPS:
                key = (q[0][1], -s)
                if best is None or key < best[0]:
                    best = (key, s)
        return None if best is None else best[1]

    def decide(self, r: int) -> float | None:
        """Run one action on rank r, or return the time to wake up at (None: wait for events)."""
        t, strategy = self.time[r], self.strategy
        c0, c1 = self.chunks[r]
        s_b = self.ready_b(r, t)
        if s_b is not None and not (strategy.f_first and self.any_f_ready(r, t)):
            _, mb = heapq.heappop(self.b_ready[s_b])
            self.run(r, Action(s_b, "B", mb), t)
            return t
        has_w = self.w_head[r] < len(self.w_queue[r])
        arrivals: list[float] = []
        for s in (c1, c0):
            a = self.f_arrival(s)
            if a is None or not self.f_fits(r, s):
                continue  # if it does not fit, only this rank's own B/W can unblock it
            if a <= t + EPS:
                high_water = self.mem[r] + EPS >= max(self.peak[r], EPS)
                if s == c0 and has_w and strategy.w_before_f and high_water:
                    break
                self.run(r, Action(s, "F", self.next_f[s]), t)
                return t
            arrivals.append(a)
        arrivals += [self.b_ready[s][0][0] for s in (c1, c0) if self.b_ready[s]]
        if has_w:
            soon = min(arrivals, default=None)
            s, mb = self.w_queue[r][self.w_head[r]]
            if soon is None or soon - t >= strategy.w_wait * self.sc[s].w - EPS:
                self.w_head[r] += 1
                self.run(r, Action(s, "W", mb), t)
                return t
        return min(arrivals) if arrivals else None

    def schedule(self) -> GreedyResult:
        p = self.p
        while True:
            live = [r for r in range(p) if self.remaining[r] > 0 and not self.blocked[r]]
            if not live:
                if any(self.remaining):
                    stuck = [r for r in range(p) if self.remaining[r]]
                    raise RuntimeError(f"greedy V scheduler deadlocked on ranks {stuck} (bug)")
                break
            r = min(live, key=lambda q: (self.time[q], q))
            wake_at = self.decide(r)
            if wake_at is None:
                self.blocked[r] = True
            elif wake_at > self.time[r]:
                self.time[r] = wake_at
        return _greedy_result(self.order, self.first_start, self.time, self.peak)


def greedy_v(
    num_ranks: int,
    n_microbatches: int,
    stage_costs: list[StageCosts],
    budget: float,
    strategy: VShapeStrategy,
) -> GreedyResult:
    """Build per-rank orders for a V placement by event-driven greedy list scheduling."""
    return _VGreedy(num_ranks, n_microbatches, stage_costs, budget, strategy).schedule()


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
    return {
        r: [a for a in _zbv_rank_order(r, p, mm, with_w) if a.microbatch < n_microbatches]
        for r in range(p)
    }


def _zbv_rank_order(r: int, p: int, mm: int, with_w: bool) -> list[Action]:
    """Rank ``r``'s order in :func:`zbv_fb_order`, for ``mm`` microbatches."""
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
    return seq


class _FixedOrder:
    """The state of one :func:`execute_fb_order` run: the rules' dependencies, real costs."""

    def __init__(self, p: int, stage_costs: list[StageCosts], fb_order: dict[int, list[Action]]):
        self.p, self.sc, self.fb_order = p, stage_costs, fb_order
        self.last = 2 * p - 1
        self.rank_of = [s if s < p else self.last - s for s in range(2 * p)]
        self.done: dict[Value, float] = {}  # when each produced value was made
        self.pos = [0] * p
        self.time = [0.0] * p
        self.first: list[float | None] = [None] * p
        self.mem = [0.0] * p
        self.peak = [0.0] * p
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.order: list[list[Action]] = [[] for _ in range(p)]
        self.fixed_w = any(a.kind == "W" for acts in fb_order.values() for a in acts)

    def run(self, r: int, a: Action, start: float) -> None:
        c = self.sc[a.stage]
        if self.first[r] is None:
            self.first[r] = start
        self.time[r] = start + c.time(a.kind)
        for value in makes(a):
            self.done[value] = self.time[r]
        self.order[r].append(a)
        self.mem[r] += c.mem(a.kind)
        self.peak[r] = max(self.peak[r], self.mem[r])
        if a.kind == "B" and not self.fixed_w:
            self.pending_w[r].append((a.stage, a.microbatch))

    def arrival(self, a: Action) -> float | None:
        """When everything ``a`` needs is on its rank; None if something is not made yet."""
        t = 0.0
        for value in needs(a, self.last):
            if value not in self.done:
                return None
            src = value[0]
            extra = self.sc[src].comm if self.rank_of[src] != self.rank_of[a.stage] else 0.0
            t = max(t, self.done[value] + extra)
        return t

    def pop_w(self, r: int) -> None:
        s, mb = self.pending_w[r].pop(0)
        self.run(r, Action(s, "W", mb), self.time[r])

    def next_ready(self) -> tuple[float, int] | None:
        """The rank whose next action could start earliest (causal, like a simulator)."""
        cands = []
        for r in range(self.p):
            if self.pos[r] < len(self.fb_order[r]):
                t = self.arrival(self.fb_order[r][self.pos[r]])
                if t is not None:
                    cands.append((max(t, self.time[r]), r))
        return min(cands) if cands else None


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
    ex = _FixedOrder(num_ranks, stage_costs, fb_order)
    remaining = sum(len(v) for v in fb_order.values())
    while remaining:
        nxt = ex.next_ready()
        if nxt is None:
            return None
        start, r = nxt
        a = fb_order[r][ex.pos[r]]
        f_overflows = a.kind == "F" and not within(ex.mem[r] + stage_costs[a.stage].mem_f, budget)
        if f_overflows and not ex.pending_w[r]:
            return None
        if ex.pending_w[r] and (eager_w or f_overflows or start > ex.time[r] + EPS):
            ex.pop_w(
                r
            )  # right after its B, to free memory, or to fill the gap before ``a`` arrives
            continue
        ex.run(r, a, start)
        ex.pos[r] += 1
        remaining -= 1
    for r in range(num_ranks):
        while ex.pending_w[r]:
            ex.pop_w(r)
    return _greedy_result(ex.order, ex.first, ex.time, ex.peak)


def _greedy_result(
    order: list[list[Action]], first_start: list[float | None], ends: list[float], peak: list[float]
) -> GreedyResult:
    """Package a timed per-rank order (start of each rank's first action, end of its last)."""
    p = len(ends)
    starts = [fs or 0.0 for fs in first_start]
    return GreedyResult(
        order={r: tuple(order[r]) for r in range(p)},
        makespan=max(ends) - min(starts),
        longest_span=max(e - s for s, e in zip(starts, ends)),
        peak_memory={r: peak[r] for r in range(p)},
    )
