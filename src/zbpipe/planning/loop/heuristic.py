"""Automatic zero-bubble scheduling: the heuristic of Qi et al. (ICLR 2024, Section 3.1).

Given per-stage costs (T_F, T_B, T_W, T_comm, memory per pass) and a per-rank activation
memory limit, build each rank's F/B/W order by list scheduling on the cost model:

* **Warm-up.** A rank runs as many F as the memory limit allows before its first B arrives.
  A last F that would delay an arriving B is a strategy flag (``f_may_delay_b``).
* **Steady state.** B runs as soon as its input gradient has arrived (B is on the critical
  path); F runs when it is ready and memory allows. A pending W is inserted when the rank
  would otherwise idle for at least T_W, when it would idle for less than T_W and the flag
  ``w_fills_small_gaps`` is set, or when the next F would overflow the memory limit (a W
  recycles memory). The result is the paper's steady 1F-1B-1W pattern.
* **Keep ahead.** Stage ``i`` keeps at least one more F than stage ``i + 1`` while F remain:
  when stage ``i + 1`` has consumed every F stage ``i`` produced, F takes priority over B
  on stage ``i`` (flag ``keep_ahead``; without it, the downstream stage may starve).
* **Drain.** When F and B are used up, the remaining W run one by one.

Every combination of the three flags is tried (the paper's grid search), together with two
safe baselines that need no more memory than 1F1B: ZB-H1 (``plan_zbh1``) and 1F1B with each W
right after its B (never slower than 1F1B: the same per-rank order with an earlier input
gradient). The shortest makespan wins; ties go to the earlier candidate, so the result is
deterministic.

The scheduler decides ranks in global time order (a heap keyed by the time each rank is
free), so when a rank decides at time ``t``, every action another rank has not yet scheduled
starts at ``t`` or later: a not-yet-produced dependency arrives no earlier than a known bound,
which is what the gap tests use. Its timing rules are ``simulate``'s, so the makespan it
computes is the simulated one (the tests check this).

Long because the paper's heuristic (Section 3.1) and its strategies are one algorithm, kept in one
file.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..core import Action, Plan, PlanError, loop_placement, make_plan
from ..costs import Costs, StageCosts
from ..rules import EPS, check_sizes, fits, within
from ..yardsticks import minimum_memory, onef1b_peak

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AutoStrategy:
    """The heuristic's binary hyperparameters (Section 3.1); every combination is tried."""

    f_may_delay_b: bool | tuple[bool, ...] = True
    """Run a ready F even if the pending B arrives before it ends (fills the warm-up tail); a
    tuple decides per stage."""
    w_fills_small_gaps: bool = False
    """Insert a W into an idle gap shorter than T_W (delays the next F/B a little)."""
    keep_ahead: bool = True
    """Give F priority over B when the next stage has consumed every F this stage produced."""
    max_inflight: tuple[int, ...] | None = None
    """Cap on F-done-B-not-done microbatches per stage (handcrafted ZB-H2); None: memory decides."""


class ListSchedule(NamedTuple):
    """One heuristic pass's result."""

    orders: dict[int, list[Action]]
    makespan: float
    span: float
    """The longest rank span (one rank's first start to last end): the bubble rate's denominator."""
    rank_spans: tuple[float, ...]


@dataclass
class _Stage:
    t: float = 0.0  # when the rank is free (or wakes up to decide again)
    nf: int = 0
    nb: int = 0
    nw: int = 0
    mem: float = 0.0
    idle: int = 0  # consecutive decisions without progress at the same time (orders the heap)


class _Ready(NamedTuple):
    """What one stage could run at its decision time ``t``."""

    f_left: bool
    f_mem_ok: bool
    f_allowed: bool
    tf: float  # when the next F's input is here (inf: no F left)
    b_left: bool
    tb: float  # when the next B's input gradient is here (inf: no B pending)
    b_exact: bool  # tb is exact (else a lower bound: its producer has not decided yet)
    b_mem_ok: bool
    w_left: bool
    starving: bool  # the next stage has consumed every F this one produced

    def next_event(self, t: float) -> float:
        """The earliest time something may become runnable; a ready F held back waits for B."""
        if self.f_allowed and self.tf <= t and self.b_left:
            return self.tb
        return min(self.tf if self.f_allowed else math.inf, self.tb if self.b_left else math.inf)


class _ListScheduler:
    """The heuristic's state: stages decide in global time order (a heap keyed by free time)."""

    def __init__(self, m: int, sc: list[StageCosts], limit: float, strategy: AutoStrategy) -> None:
        p = len(sc)
        self.m, self.sc, self.limit, self.strategy = m, sc, limit, strategy
        self.last = p - 1
        self.st = [_Stage() for _ in range(p)]
        self.end_f = [[0.0] * m for _ in range(p)]
        self.end_b = [[0.0] * m for _ in range(p)]
        self.orders: dict[int, list[Action]] = {r: [] for r in range(p)}
        self.first = [math.inf] * p
        self.makespan = 0.0

    def arrival_f(self, s: int) -> tuple[float, bool]:
        """When F(s, nf)'s input is here, and whether that time is exact (else a lower bound)."""
        st, sc, j = self.st, self.sc, self.st[s].nf
        if s == 0:
            return 0.0, True
        if j < st[s - 1].nf:
            return self.end_f[s - 1][j] + sc[s - 1].comm, True
        return st[s - 1].t + sc[s - 1].f + sc[s - 1].comm, False

    def arrival_b(self, s: int) -> tuple[float, bool]:
        st, sc, j = self.st, self.sc, self.st[s].nb
        if s == self.last:
            return self.end_f[s][j], True
        if j < st[s + 1].nb:
            return max(self.end_f[s][j], self.end_b[s + 1][j] + sc[s + 1].comm), True
        return max(self.end_f[s][j], st[s + 1].t + sc[s + 1].b + sc[s + 1].comm), False

    def ready(self, s: int) -> _Ready:
        x, c, m, cap = self.st[s], self.sc[s], self.m, self.strategy.max_inflight
        f_left = x.nf < m
        f_mem_ok = within(x.mem + c.mem_f, self.limit) and within(
            x.mem + c.mem_f + max(0.0, c.mem_b), self.limit
        )
        f_allowed = f_left and f_mem_ok and (cap is None or x.nf - x.nb < cap[s])
        tf = self.arrival_f(s)[0] if f_left else math.inf
        b_left = x.nb < x.nf
        tb, b_exact = self.arrival_b(s) if b_left else (math.inf, True)
        # Only in the steady state: during warm-up the downstream stage is one F behind by nature.
        starving = s < self.last and f_left and x.nb > 0 and x.nf == self.st[s + 1].nf
        b_mem_ok = within(x.mem + c.mem_b, self.limit)
        return _Ready(
            f_left, f_mem_ok, f_allowed, tf, b_left, tb, b_exact, b_mem_ok, x.nw < x.nb, starving
        )

    def choose(self, s: int, t: float, r: _Ready) -> str | None:
        """The kind stage ``s`` runs at ``t`` (the module docstring's rules), or None to idle."""
        strat, c = self.strategy, self.sc[s]
        f_ready = r.f_allowed and r.tf <= t
        if f_ready and strat.keep_ahead and r.starving:
            return "F"
        if r.b_left and r.tb <= t and r.b_mem_ok:
            return "B"
        may_delay = strat.f_may_delay_b
        if not isinstance(may_delay, bool):
            may_delay = may_delay[s]
        if f_ready and (may_delay or not r.b_left or not r.b_exact or r.tb >= t + c.f):
            return "F"
        if not r.w_left:
            return None
        gap = r.next_event(t) - t
        if (
            gap >= c.w - EPS
            or (strat.w_fills_small_gaps and gap > EPS)
            or (r.f_left and not r.f_mem_ok)  # recycle memory for the next F
            or (r.b_left and not r.b_mem_ok)
            or (not r.f_allowed and not r.b_left)  # drain
        ):
            return "W"
        return None

    def run(self, s: int, kind: str, start: float) -> None:
        x, c = self.st[s], self.sc[s]
        if kind == "F":
            j, x.nf = x.nf, x.nf + 1
            self.end_f[s][j] = start + c.f
        elif kind == "B":
            j, x.nb = x.nb, x.nb + 1
            self.end_b[s][j] = start + c.b
        else:
            j, x.nw = x.nw, x.nw + 1
        x.mem += c.mem(kind)
        x.t = start + c.time(kind)
        self.first[s] = min(self.first[s], start)
        self.makespan = max(self.makespan, x.t)
        self.orders[s].append(Action(s, kind, j))

    def schedule(self) -> ListSchedule | None:
        p = len(self.st)
        heap = [(0.0, 0, s) for s in range(p)]
        stalls = 0
        while heap:
            t, _, s = heapq.heappop(heap)
            x = self.st[s]
            if x.nw == self.m:
                continue
            r = self.ready(s)
            choice = self.choose(s, t, r)
            if choice is not None:
                self.run(s, choice, t)
                x.idle = stalls = 0
                heapq.heappush(heap, (x.t, 0, s))
                continue
            # Idle until the earliest next event (a lower bound if its producer has not decided).
            nxt = r.next_event(t)
            if r.tb <= t and not r.b_mem_ok or math.isinf(nxt):
                return None  # memory too small for this strategy: no W to free it, nothing can run
            x.t = max(t, nxt)
            if x.t <= t:
                x.idle += 1
                stalls += 1
                if stalls > 4 * p + 8:
                    return None
            heapq.heappush(heap, (x.t, x.idle, s))
        if any(x.nw < self.m for x in self.st):
            return None
        spans = tuple(self.st[s].t - self.first[s] for s in range(p))
        return ListSchedule(self.orders, self.makespan, max(spans), spans)


def list_schedule(
    num_ranks: int,
    n_microbatches: int,
    sc: list[StageCosts],
    memory_limit: float,
    strategy: AutoStrategy,
) -> ListSchedule | None:
    """One heuristic pass: per-rank orders, makespan and longest rank span; None if it stalls."""
    if len(sc) != num_ranks:
        raise ValueError(f"list_schedule: {len(sc)} stage costs for {num_ranks} ranks")
    return _ListScheduler(n_microbatches, sc, memory_limit, strategy).schedule()


STRATEGIES: tuple[AutoStrategy, ...] = tuple(
    AutoStrategy(f_may_delay_b=a, w_fills_small_gaps=b, keep_ahead=k)
    for a, b, k in itertools.product((True, False), (False, True), (True, False))
)


class Candidate(NamedTuple):
    """One candidate plan of ``plan_auto``, ranked by (span, makespan), ties to the earlier."""

    span: float
    makespan: float
    source: str
    """Where it came from: ``heuristic:<strategy>``, ``w-after-b`` or ``zbh1``."""
    orders: dict[int, list[Action]]

    def rank_key(self) -> tuple[float, float]:
        return (round(self.span, 9), round(self.makespan, 9))


def _heuristic_candidates(p: int, m: int, sc: list[StageCosts], limit: float) -> list[Candidate]:
    out = []
    best: tuple[AutoStrategy, ListSchedule] | None = None
    for strategy in STRATEGIES:
        res = list_schedule(p, m, sc, limit, strategy)
        if res is not None:
            out.append(Candidate(res.span, res.makespan, f"heuristic:{strategy}", res.orders))
            if best is None or _key(res) < _key(best[1]):
                best = (strategy, res)
    if best is not None:
        out.extend(_per_stage_delays(p, m, sc, limit, *best))
    return out


def _key(res: ListSchedule) -> tuple[float, float]:
    return (round(res.span, 9), round(res.makespan, 9))


def _per_stage_delays(
    p: int, m: int, sc: list[StageCosts], limit: float, base: AutoStrategy, res: ListSchedule
) -> list[Candidate]:
    """Decide ``f_may_delay_b`` per stage, starting from the best uniform strategy.

    Whether a rank's last warm-up F may delay its first B is a trade: the F fills the rank's
    own idle gap, the delay reaches every upstream rank. The longest rank span is the bubble
    rate's denominator, so flip the flag of the rank that has it, keep the flip if the result
    is better, and go on with the new longest rank (each rank at most once: <= p passes).
    """
    if not isinstance(base.f_may_delay_b, bool):
        return []
    flags = [base.f_may_delay_b] * p
    tried: set[int] = set()
    out: list[Candidate] = []
    while True:
        rank = max(range(p), key=lambda r: (round(res.rank_spans[r], 9), -r))
        if rank in tried:
            return out
        tried.add(rank)
        flags[rank] = not flags[rank]
        strategy = replace(base, f_may_delay_b=tuple(flags))
        new = list_schedule(p, m, sc, limit, strategy)
        if new is None or _key(new) >= _key(res):
            return out
        res = new
        out.append(Candidate(res.span, res.makespan, f"heuristic:{strategy}", res.orders))


def _baseline_candidates(
    name: str, p: int, m: int, costs: Costs, limit: float
) -> tuple[list[Candidate], float]:
    """ZB-H1 and 1F1B-with-W-after-B, if they fit; and the latter's makespan (inf if not)."""
    from ..simulator import simulate_timing  # the shared simulator times the baselines
    from .zbh1 import plan_zbh1, zbh1_rank_order

    sc = costs.per_stage(p)
    w_after_b = {r: zbh1_rank_order(r, p, m, lag=0) for r in range(p)}
    if not fits(w_after_b, sc, limit):
        return [], math.inf
    baselines = [("w-after-b", w_after_b)]
    try:
        baselines.append(
            ("zbh1", {r: list(a) for r, a in plan_zbh1(p, m, costs, limit).order.items()})
        )
    except ValueError:
        pass  # ZB-H1 needs 1F1B's per-rank memory; a smaller limit just skips it
    out = []
    for label, orders in baselines:
        if not fits(orders, sc, limit):
            continue
        r = simulate_timing(make_plan(name, p, m, loop_placement(p, p), orders), costs)
        out.append(Candidate(r.longest_span, r.makespan, label, orders))
    return out, out[0].makespan


def plan_auto(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    name: str = "ZBAuto",
) -> Plan:
    """The heuristic schedule under ``memory_limit`` (per rank; default: twice 1F1B's peak).

    Raises ``ValueError`` if ``memory_limit`` is below one microbatch in flight.
    """
    p, m = num_ranks, n_microbatches
    check_sizes(p, m)
    costs = costs or Costs()
    sc = costs.per_stage(p)
    limit = 2 * onef1b_peak(p, m, costs) if memory_limit is None else float(memory_limit)
    need = minimum_memory(costs, p)
    if limit < need - EPS:
        raise ValueError(
            f"{name}: memory_limit {limit:g} is below {need:g}, the memory of one microbatch in "
            f"flight on the busiest stage; no plan fits. Raise memory_limit to at least {need:g}"
        )
    # Candidates are ranked by the longest rank span (the paper's objective and bubble rate),
    # then makespan; none may be slower than 1F1B-with-split-backward, the safe baseline.
    baselines, bound = _baseline_candidates(name, p, m, costs, limit)
    cands = _heuristic_candidates(p, m, sc, limit) + baselines
    ok = [c for c in cands if c.makespan <= bound + EPS]
    if not ok:
        raise ValueError(
            f"{name}: no schedule found under memory_limit {limit:g}; raise it to at least "
            f"{max(need, onef1b_peak(p, m, costs)):g} (1F1B's peak)"
        )
    best = min(ok, key=Candidate.rank_key)
    log.debug(
        "%s p=%d m=%d limit=%g: span %g makespan %g from %s",
        name,
        p,
        m,
        limit,
        best.span,
        best.makespan,
        best.source,
    )
    return make_plan(
        name, p, m, loop_placement(p, p), best.orders, memory_limit=limit, source=best.source
    )


def plan_zb1p(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
) -> Plan:
    """ZB-1p: the heuristic under 1F1B's peak memory (``p * mem_f`` with uniform stages)."""
    costs = costs or Costs()
    costs.check(num_ranks)
    limit = onef1b_peak(num_ranks, n_microbatches, costs) if memory_limit is None else memory_limit
    return plan_auto(num_ranks, n_microbatches, costs, limit, name="ZB1P")


def plan_zb2p(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
) -> Plan:
    """ZB-2p: the heuristic under twice 1F1B's peak memory (the paper's near-zero-bubble budget)."""
    costs = costs or Costs()
    costs.check(num_ranks)
    limit = (
        2 * onef1b_peak(num_ranks, n_microbatches, costs) if memory_limit is None else memory_limit
    )
    return plan_auto(num_ranks, n_microbatches, costs, limit, name="ZB2P")


__all__ = [
    "AutoStrategy",
    "Candidate",
    "ListSchedule",
    "list_schedule",
    "minimum_memory",
    "onef1b_peak",
    "plan_auto",
    "plan_zb1p",
    "plan_zb2p",
    "PlanError",
]
