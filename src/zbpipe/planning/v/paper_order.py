"""The ZB-V paper's hand-made order, and an executor that times a fixed F/B order (pure Python).

``plan_zbv`` times the paper's order with the real costs as one of its candidates: the
executor keeps each rank's F/B order and places every W where the real costs leave a gap
(or right after its B, or where memory needs it), the way a simulator would run the ord"""

from __future__ import annotations

import heapq
from collections import deque

from ..core import Action
from ..costs import StageCosts
from ..rules import EPS, within
from .timed_order import GreedyResult, RawAction, StageTable, greedy_result


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

    # Step 1, warm-up down the V: 2(p - r) - 1 forwards of chunk 0.
    for _ in range(2 * (p - r) - 1):
        f(c0)
    # Step 2, warm-up of chunk 1: r pairs (F chunk 1, F chunk 0), as chunk 1's inputs come back
    # from rank r + 1.
    for _ in range(r):
        f(c1)
        f(c0)
    # Step 3, the first backwards: p - r pairs (F chunk 1, B chunk 1), as the gradients from the
    # V's end (chunk 1 of rank 0, the last stage) reach rank r.
    for _ in range(p - r):
        f(c1)
        b(c1)
    # Step 4, steady state: rounds (F0 B0 F1 B1) until every forward of both chunks has run.
    while nf[c1] < nf[c0] or nf[c0] < mm:
        if nf[c0] < mm:
            f(c0)
        b(c0)
        f(c1)
        b(c1)
    # Step 5, cool-down: r pairs (B chunk 0, B chunk 1), their Ws left for the drain.
    for _ in range(r):
        b(c0, w=False)
        b(c1, w=False)
    # Step 6, cool-down of chunk 0: its remaining backwards.
    while nb[c0] < mm:
        b(c0)
    # Step 7, drain (with_w only): the Ws step 5 left, chunk 1's then chunk 0's.
    if with_w:
        for s in (c1, c0):
            while nw[s] < mm:
                seq.append(Action(s, "W", nw[s]))
                nw[s] += 1
    return seq


class _FixedOrder:
    """The state of one :func:`execute_fb_order` run: the rules' dependencies, real costs.

    Each value of :mod:`.rules` is a slot in a per-stage list holding when it was made (-1: not
    yet). A rank's next action can only become startable when the rank itself runs or when a
    value it needs is made on a neighbour stage, so each rank's earliest start is cached and
    recomputed only then, and a heap gives the earliest rank: a step costs O(log p), not a scan
    of every rank with its dependencies looked up again.
    """

    def __init__(self, p: int, stage_costs: list[StageCosts], fb_order: dict[int, list[Action]]):
        self.p = p
        self.steps: list[list[RawAction]] = [
            [(a.stage, a.kind, a.microbatch) for a in fb_order[r]] for r in range(p)
        ]
        n = 2 * p
        self.last = n - 1
        table = StageTable(p, stage_costs)
        self.rank_of, self.dur, self.mem_of = table.rank_of, table.dur, table.mem
        self.down_delay, self.up_delay = table.down_delay, table.up_delay
        m = 1 + max((a.microbatch for acts in fb_order.values() for a in acts), default=0)
        # when each value was made: F(s, mb)'s activation, B/BW(s, mb)'s input gradient, B(s, mb)
        self.f_done = [[-1.0] * m for _ in range(n)]
        self.g_done = [[-1.0] * m for _ in range(n)]
        self.b_done = [[-1.0] * m for _ in range(n)]
        self.pos = [0] * p
        self.time = [0.0] * p
        self.first: list[float | None] = [None] * p
        self.mem = [0.0] * p
        self.peak = [0.0] * p
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.order: list[list[RawAction]] = [[] for _ in range(p)]
        self.fixed_w = any(a.kind == "W" for acts in fb_order.values() for a in acts)
        self.dirty = set(range(p))  # ranks whose next action's start must be recomputed
        self.version = [0] * p
        self.heap: list[tuple[float, int, int]] = []  # (start, rank, version)

    def run(self, r: int, step: RawAction, start: float) -> None:
        s, kind, mb = step
        if self.first[r] is None:
            self.first[r] = start
        end = self.time[r] = start + self.dur[kind][s]
        self.order[r].append(step)
        self.mem[r] += self.mem_of[kind][s]
        self.peak[r] = max(self.peak[r], self.mem[r])
        self.dirty.add(r)
        # what this action makes, and the neighbour rank that may be waiting for it
        if kind == "F":
            self.f_done[s][mb] = end
            if s < self.last:
                self.dirty.add(self.rank_of[s + 1])
        elif kind != "W":
            self.g_done[s][mb] = end
            if kind == "B":
                self.b_done[s][mb] = end
                if not self.fixed_w:
                    self.pending_w[r].append((s, mb))
            if s > 0:
                self.dirty.add(self.rank_of[s - 1])

    def arrival(self, step: RawAction) -> float | None:
        """When everything ``step`` needs is on its rank; None if something is not made yet."""
        s, kind, mb = step
        if kind == "F":
            if s == 0:
                return 0.0
            done = self.f_done[s - 1][mb]
            return None if done < 0.0 else done + self.down_delay[s - 1]
        if kind == "W":
            done = self.b_done[s][mb]
            return None if done < 0.0 else done
        t = self.f_done[s][mb]  # B or BW: its own F (same rank) and the gradient from s + 1
        if t < 0.0:
            return None
        if s < self.last:
            g = self.g_done[s + 1][mb]
            if g < 0.0:
                return None
            t = max(t, g + self.up_delay[s + 1])
        return t

    def pop_w(self, r: int) -> None:
        s, mb = self.pending_w[r].popleft()
        self.run(r, (s, "W", mb), self.time[r])

    def next_ready(self) -> tuple[float, int] | None:
        """The rank whose next action could start earliest (causal, like a simulator)."""
        heap = self.heap
        for r in self.dirty:
            self.version[r] += 1
            if self.pos[r] < len(self.steps[r]):
                t = self.arrival(self.steps[r][self.pos[r]])
                if t is not None:
                    heapq.heappush(heap, (max(t, self.time[r]), r, self.version[r]))
        self.dirty.clear()
        while heap and heap[0][2] != self.version[heap[0][1]]:
            heapq.heappop(heap)  # stale: that rank's start was recomputed since
        return (heap[0][0], heap[0][1]) if heap else None


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
        a = ex.steps[r][ex.pos[r]]
        f_overflows = a[1] == "F" and not within(ex.mem[r] + stage_costs[a[0]].mem_f, budget)
        if f_overflows and not ex.pending_w[r]:
            return None
        if ex.pending_w[r] and (eager_w or f_overflows or start > ex.time[r] + EPS):
            # right after its B, to free memory, or to fill the gap before ``a`` arrives
            ex.pop_w(r)
            continue
        ex.run(r, a, start)
        ex.pos[r] += 1
        remaining -= 1
    for r in range(num_ranks):
        while ex.pending_w[r]:
            ex.pop_w(r)
    return greedy_result(ex.order, ex.first, ex.time, ex.peak)
