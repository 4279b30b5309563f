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
The paper's hand-made ZB-V order and its executor are in ``paper_order``.

Long because the greedy V-shape list scheduler is one algorithm whose helpers share its tables.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ..costs import StageCosts
from ..rules import EPS
from .timed_order import GreedyResult, RawAction, StageTable, greedy_result


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


def _future_peak_after_f(c: StageCosts) -> float:
    """Highest level one microbatch's activations on this stage will reach, once its F ran."""
    return c.mem_f + max(0.0, c.mem_b)


def _future_peak_after_b(c: StageCosts) -> float:
    return max(0.0, c.mem_f + c.mem_b)


class _VGreedy:
    """The state of one greedy V run; :meth:`decide` is the module docstring's priorities.

    A run makes about one decision per action (p=32, m=128: 25,000), so the state is flat lists
    indexed by stage or rank, and the rank that decides next comes from a heap.
    """

    def __init__(
        self,
        p: int,
        m: int,
        stage_costs: list[StageCosts],
        budget: float,
        strategy: VShapeStrategy,
        give_up_above: float | None = None,
    ) -> None:
        n_stages = 2 * p
        self.p, self.m, self.strategy = p, m, strategy
        self.last = n_stages - 1
        table = StageTable(p, stage_costs)
        self.rank_of = table.rank_of
        self.dur_f, self.dur_b, self.dur_w = table.dur["F"], table.dur["B"], table.dur["W"]
        self.mem_f, self.mem_b, self.mem_w = table.mem["F"], table.mem["B"], table.mem["W"]
        self.down_delay, self.up_delay = table.down_delay, table.up_delay
        self.fp_f = [_future_peak_after_f(c) for c in stage_costs]
        self.fp_b = [_future_peak_after_b(c) for c in stage_costs]
        self.fp_b_minus_f = [b - f for b, f in zip(self.fp_b, self.fp_f)]
        self.limit = budget + EPS  # ``within(x, budget)`` is ``x <= budget + EPS``
        self.lead_cap = [
            None
            if strategy.chunk0_lead is None
            else strategy.chunk0_lead + strategy.lead_slope * (p - 1 - r)
            for r in range(p)
        ]
        # f_in[s][mb]: when F(s - 1, mb)'s activation is on stage s's rank (F runs in microbatch
        # order, so the list grows in microbatch order); stage 0 has its inputs at time 0
        self.f_in: list[list[float]] = [[] for _ in range(n_stages)]
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
        self.order: list[list[RawAction]] = [[] for _ in range(p)]
        self.blocked = [False] * p
        # per rank, the most microbatches a chunk-0 forward that passed every other check left
        # waiting for their chunk 1: a lead cap at or above it never changes a decision
        self.max_waiting = [0] * p
        # (time, rank) of every rank that may decide; an entry whose time is no longer the
        # rank's is stale and skipped (every change of ``time`` pushes a fresh one)
        self.heap: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
        # Giving up: a rank's span will be at least its last end plus the work it has left
        # minus its first start. Once that passes ``give_up_above`` (with a margin far above
        # float rounding), this plan's longest span is certain to be longer.
        self.span_cap = (
            None if give_up_above is None else give_up_above + 1e-6 * max(1.0, give_up_above)
        )
        self.work_left = [
            m * sum(table.dur[k][s] for s in (r, n_stages - 1 - r) for k in ("F", "B", "W"))
            for r in range(p)
        ]
        self.gave_up = False

    def f_start(self, r: int, s: int) -> float | None:
        """When the next F of stage ``s`` may start on rank ``r``: its input's arrival; None if
        there is no next F, its input is not made yet, or the budget does not allow it."""
        mb = self.next_f[s]
        if mb >= self.m:
            return None
        if s == 0:
            arrival = 0.0
        else:
            arrived = self.f_in[s]
            if mb >= len(arrived):
                return None
            arrival = arrived[mb]
        fp = self.fp_f[s]
        if self.reserved[r] + fp > self.limit:
            return None
        if s == r:  # chunk 0
            # Deadlock freedom: the microbatches stuck between this rank's two chunks must leave
            # room for one chunk-1 forward, whatever else is in flight (that drains on its own).
            c1 = self.last - r
            waiting = mb - self.next_f[c1] + 1
            if waiting * fp + self.fp_f[c1] > self.limit:
                return None
            cap = self.lead_cap[r]
            if cap is not None and waiting > cap:
                return None
            if waiting > self.max_waiting[r]:
                self.max_waiting[r] = waiting
        return arrival

    def run_f(self, r: int, s: int, start: float) -> None:
        mb = self.next_f[s]
        self.next_f[s] = mb + 1
        end = self._commit(r, (s, "F", mb), start, self.dur_f[s], self.mem_f[s])
        self.reserved[r] += self.fp_f[s]
        if s == self.last:
            heapq.heappush(self.b_ready[s], (end, mb))
        else:
            at = end + self.down_delay[s]
            self.f_in[s + 1].append(at)
            self.wake(s + 1, at)

    def run_b(self, r: int, s: int, mb: int, start: float) -> None:
        end = self._commit(r, (s, "B", mb), start, self.dur_b[s], self.mem_b[s])
        self.reserved[r] += self.fp_b_minus_f[s]
        self.w_queue[r].append((s, mb))
        if s > 0:
            at = end + self.up_delay[s]
            heapq.heappush(self.b_ready[s - 1], (at, mb))
            self.wake(s - 1, at)

    def run_w(self, r: int, s: int, mb: int, start: float) -> None:
        self._commit(r, (s, "W", mb), start, self.dur_w[s], self.mem_w[s])
        self.reserved[r] -= self.fp_b[s]

    def _commit(self, r: int, step: RawAction, start: float, dur: float, mem: float) -> float:
        end = start + dur
        first = self.first_start[r]
        if first is None:
            first = self.first_start[r] = start
        self.order[r].append(step)
        self.time[r] = self.free[r] = end
        self.remaining[r] -= 1
        self.mem[r] += mem
        self.peak[r] = max(self.peak[r], self.mem[r])
        self.work_left[r] -= dur
        if self.span_cap is not None and end + self.work_left[r] - first > self.span_cap:
            self.gave_up = True
        return end

    def wake(self, dst_stage: int, at: float) -> None:
        # a new dependency: a rank idling until a later arrival (or with nothing to wait for)
        # must reconsider at this arrival instead
        q = self.rank_of[dst_stage]
        if self.blocked[q]:
            self.blocked[q] = False
            self.time[q] = max(self.free[q], at)
        elif self.time[q] > self.free[q]:
            self.time[q] = max(self.free[q], min(self.time[q], at))
        else:
            return
        heapq.heappush(self.heap, (self.time[q], q))

    def decide(self, r: int) -> float | None:
        """Run one action on rank r, or return the time to wake up at (None: wait for events)."""
        t, strategy = self.time[r], self.strategy
        c0, c1 = r, self.last - r
        lim = t + EPS
        q0, q1 = self.b_ready[c0], self.b_ready[c1]
        # the B to run: the earliest arrived microbatch, ties to the later stage (chunk 1)
        ok0 = bool(q0) and q0[0][0] <= lim
        if q1 and q1[0][0] <= lim and (not ok0 or q1[0][1] <= q0[0][1]):
            s_b = c1
        else:
            s_b = c0 if ok0 else -1
        if s_b >= 0 and strategy.f_first:
            for s in (c0, c1):
                a = self.f_start(r, s)
                if a is not None and a <= lim:
                    s_b = -1  # a ready F goes first
                    break
        if s_b >= 0:
            _, mb = heapq.heappop(self.b_ready[s_b])
            self.run_b(r, s_b, mb, t)
            return t
        has_w = self.w_head[r] < len(self.w_queue[r])
        arrivals: list[float] = []
        for s in (c1, c0):
            a = self.f_start(r, s)
            if a is None:
                continue  # if it does not fit, only this rank's own B/W can unblock it
            if a <= lim:
                high_water = self.mem[r] + EPS >= max(self.peak[r], EPS)
                if s == c0 and has_w and strategy.w_before_f and high_water:
                    break
                self.run_f(r, s, t)
                return t
            arrivals.append(a)
        if q1:
            arrivals.append(q1[0][0])
        if q0:
            arrivals.append(q0[0][0])
        if has_w:
            soon = min(arrivals, default=None)
            s, mb = self.w_queue[r][self.w_head[r]]
            if soon is None or soon - t >= strategy.w_wait * self.dur_w[s] - EPS:
                self.w_head[r] += 1
                self.run_w(r, s, mb, t)
                return t
        return min(arrivals) if arrivals else None

    def schedule(self) -> GreedyResult | None:
        """The plan; None if it gave up (its longest rank span exceeds ``give_up_above``)."""
        heap, time, blocked, remaining = self.heap, self.time, self.blocked, self.remaining
        # The live rank with the smallest (time, rank) decides next, as a scan would pick it.
        while heap:
            t, r = heapq.heappop(heap)
            if t != time[r] or blocked[r] or not remaining[r]:
                continue  # stale entry
            wake_at = self.decide(r)
            if self.gave_up:
                return None
            if wake_at is None:
                blocked[r] = True
                continue
            if wake_at > time[r]:
                time[r] = wake_at
            if remaining[r]:
                heapq.heappush(heap, (time[r], r))
        if any(remaining):
            stuck = [r for r in range(self.p) if remaining[r]]
            raise RuntimeError(f"greedy V scheduler deadlocked on ranks {stuck} (bug)")
        return greedy_result(self.order, self.first_start, self.time, self.peak)


def greedy_v(
    num_ranks: int,
    n_microbatches: int,
    stage_costs: list[StageCosts],
    budget: float,
    strategy: VShapeStrategy,
) -> GreedyResult:
    """Build per-rank orders for a V placement by event-driven greedy list scheduling."""
    res = _VGreedy(num_ranks, n_microbatches, stage_costs, budget, strategy).schedule()
    assert res is not None  # it gives up only below a bound
    return res


def greedy_candidates(
    num_ranks: int,
    n_microbatches: int,
    stage_costs: list[StageCosts],
    budget: float,
    strategies: list[VShapeStrategy],
    bar: Callable[[], float | None] = lambda: None,
) -> Iterator[tuple[VShapeStrategy, GreedyResult | None]]:
    """:func:`greedy_v` for each strategy, in order, or None for one that cannot beat ``bar()``.

    ``bar()`` is the longest rank span of the best plan so far (None: no bar): a run gives up
    as soon as its own is certain to be longer (see ``_VGreedy.span_cap``), since such a plan
    would not be chosen. The bar only goes down, so a result below may be one that the current
    bar would have cut short; the choice among the candidates is the same either way.

    No schedule is run twice. A strategy seen before gets the same result. So does one whose
    lead cap would never bind: a run without a cap records, per rank, the most microbatches any
    chunk-0 forward it allowed left waiting (``max_waiting``); a cap at or above that on every
    rank rejects none of them, so the capped run makes every decision the uncapped one made
    (and gives up where it gave up, under a bar as low or lower).
    """
    p = num_ranks
    done: dict[VShapeStrategy, GreedyResult | None] = {}
    uncapped: dict[VShapeStrategy, tuple[GreedyResult | None, list[int]]] = {}
    for st in strategies:
        if st not in done:
            free = replace(st, chunk0_lead=None, lead_slope=0)
            ref = uncapped.get(free)
            lead = st.chunk0_lead
            if ref is not None and lead is not None:
                res, most = ref
                if all(most[r] <= lead + st.lead_slope * (p - 1 - r) for r in range(p)):
                    done[st] = res
        if st not in done:
            run = _VGreedy(num_ranks, n_microbatches, stage_costs, budget, st, bar())
            done[st] = run.schedule()
            if st.chunk0_lead is None:
                uncapped[replace(st, lead_slope=0)] = (done[st], run.max_waiting)
        yield st, done[st]
