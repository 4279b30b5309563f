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
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from dataclasses import dataclass

from .core import Action, Plan, PlanError, loop_placement, make_plan
from .costs import Costs, StageCosts
from .onef1b import onef1b_rank_order

log = logging.getLogger(__name__)

_EPS = 1e-9


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """The heuristic's binary hyperparameters (Section 3.1); every combination is tried."""

    f_may_delay_b: bool = True
    """Run a ready F even if the pending B arrives before it ends (fills the warm-up tail)."""
    w_fills_small_gaps: bool = False
    """Insert a W into an idle gap shorter than T_W (delays the next F/B a little)."""
    keep_ahead: bool = True
    """Give F priority over B when the next stage has consumed every F this stage produced."""
    max_inflight: tuple[int, ...] | None = None
    """Cap on F-done-B-not-done microbatches per stage (handcrafted ZB-H2); None: memory decides."""


@dataclass
class _Stage:
    t: float = 0.0  # when the rank is free (or wakes up to decide again)
    nf: int = 0
    nb: int = 0
    nw: int = 0
    mem: float = 0.0
    idle: int = 0  # consecutive decisions without progress at the same time (orders the heap)


def list_schedule(
    num_ranks: int,
    n_microbatches: int,
    sc: list[StageCosts],
    memory_limit: float,
    strategy: Strategy,
) -> tuple[dict[int, list[Action]], float, float] | None:
    """One heuristic pass: per-rank orders, makespan and longest rank span; None if it stalls."""
    p, m = num_ranks, n_microbatches
    last = p - 1
    st = [_Stage() for _ in range(p)]
    end_f = [[0.0] * m for _ in range(p)]
    end_b = [[0.0] * m for _ in range(p)]
    orders: dict[int, list[Action]] = {r: [] for r in range(p)}
    heap = [(0.0, 0, s) for s in range(p)]
    stalls = 0
    makespan = 0.0
    first = [math.inf] * p

    def arrival_f(s: int) -> tuple[float, bool]:
        """When F(s, nf)'s input is here, and whether that time is exact (else a lower bound)."""
        j = st[s].nf
        if s == 0:
            return 0.0, True
        if j < st[s - 1].nf:
            return end_f[s - 1][j] + sc[s - 1].comm, True
        return st[s - 1].t + sc[s - 1].f + sc[s - 1].comm, False

    def arrival_b(s: int) -> tuple[float, bool]:
        j = st[s].nb
        if s == last:
            return end_f[s][j], True
        if j < st[s + 1].nb:
            return max(end_f[s][j], end_b[s + 1][j] + sc[s + 1].comm), True
        return max(end_f[s][j], st[s + 1].t + sc[s + 1].b + sc[s + 1].comm), False

    def run(s: int, kind: str, start: float) -> None:
        nonlocal makespan
        x, c = st[s], sc[s]
        if kind == "F":
            j, x.nf = x.nf, x.nf + 1
            x.mem += c.mem_f
            end_f[s][j] = start + c.f
        elif kind == "B":
            j, x.nb = x.nb, x.nb + 1
            x.mem += c.mem_b
            end_b[s][j] = start + c.b
        else:
            j, x.nw = x.nw, x.nw + 1
            x.mem += c.mem_w
        x.t = start + c.time(kind)
        first[s] = min(first[s], start)
        makespan = max(makespan, x.t)
        orders[s].append(Action(s, kind, j))

    while heap:
        t, _, s = heapq.heappop(heap)
        x, c = st[s], sc[s]
        if x.nw == m:
            continue
        f_left = x.nf < m
        f_mem_ok = (
            x.mem + c.mem_f <= memory_limit + _EPS
            and x.mem + c.mem_f + max(0.0, c.mem_b) <= memory_limit + _EPS
        )
        f_cap_ok = strategy.max_inflight is None or x.nf - x.nb < strategy.max_inflight[s]
        f_allowed = f_left and f_mem_ok and f_cap_ok
        tf, f_exact = arrival_f(s) if f_left else (math.inf, True)
        b_left = x.nb < x.nf
        tb, b_exact = arrival_b(s) if b_left else (math.inf, True)
        b_mem_ok = x.mem + c.mem_b <= memory_limit + _EPS
        w_left = x.nw < x.nb
        # Only in the steady state: during warm-up the downstream stage is one F behind by nature.
        starving = s < last and f_left and x.nb > 0 and x.nf == st[s + 1].nf

        choice = None
        if f_allowed and tf <= t and strategy.keep_ahead and starving:
            choice = "F"
        elif b_left and tb <= t and b_mem_ok:
            choice = "B"
        elif (
            f_allowed
            and tf <= t
            and (strategy.f_may_delay_b or not b_left or not b_exact or tb >= t + c.f)
        ):
            choice = "F"
        elif w_left:
            f_held = f_allowed and tf <= t
            nxt = (
                tb
                if f_held and b_left
                else min(tf if f_allowed else math.inf, tb if b_left else math.inf)
            )
            gap = nxt - t
            if (
                gap >= c.w - _EPS
                or (strategy.w_fills_small_gaps and gap > _EPS)
                or (f_left and not f_mem_ok)  # recycle memory for the next F
                or (b_left and not b_mem_ok)
                or (not f_allowed and not b_left)  # drain
            ):
                choice = "W"
        if choice is not None:
            run(s, choice, t)
            x.idle = 0
            stalls = 0
            heapq.heappush(heap, (x.t, 0, s))
            continue
        # Idle until the earliest next event (a lower bound if its producer has not decided yet);
        # a ready F held back for an arriving B waits for that B.
        f_held = f_allowed and tf <= t
        nxt = (
            tb
            if f_held and b_left
            else min(tf if f_allowed else math.inf, tb if b_left else math.inf)
        )
        if tb <= t and not b_mem_ok or math.isinf(nxt):
            return None  # memory too small for this strategy: no W to free it, nothing can run
        x.t = max(t, nxt)
        if x.t <= t:
            x.idle += 1
            stalls += 1
            if stalls > 4 * p + 8:
                return None
        heapq.heappush(heap, (x.t, x.idle, s))
    if any(x.nw < m for x in st):
        return None
    return orders, makespan, max(st[s].t - first[s] for s in range(p))


def minimum_memory(costs: Costs, num_stages: int) -> float:
    """The least per-rank memory limit any plan fits in: one microbatch in flight."""
    return max(max(c.mem_f, c.mem_f + c.mem_b, 0.0) for c in costs.per_stage(num_stages))


def onef1b_peak(num_ranks: int, n_microbatches: int, costs: Costs) -> float:
    """1F1B's peak activation memory over ranks (rank 0 holds ``min(p, m)`` forwards)."""
    peak = 0.0
    for r in range(num_ranks):
        c, mem = costs.stage(r), 0.0
        for a in onef1b_rank_order(r, num_ranks, n_microbatches):
            mem += c.mem(a.kind)
            peak = max(peak, mem)
    return peak


def _peak(order: list[Action], sc: list[StageCosts]) -> float:
    mem = peak = 0.0
    for a in order:
        mem += sc[a.stage].mem(a.kind)
        peak = max(peak, mem)
    return peak


def _fits(
    orders: dict[int, list[Action]] | dict[int, tuple[Action, ...]],
    sc: list[StageCosts],
    limit: float,
) -> bool:
    return all(_peak(list(acts), sc) <= limit + _EPS for acts in orders.values())


STRATEGIES: tuple[Strategy, ...] = tuple(
    Strategy(f_may_delay_b=a, w_fills_small_gaps=b, keep_ahead=k)
    for a, b, k in itertools.product((True, False), (False, True), (True, False))
)


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
    from .simulate import simulate  # the shared simulator times the baselines
    from .zbh1 import plan_zbh1, zbh1_rank_order

    p, m = num_ranks, n_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"num_ranks and n_microbatches must be >= 1, got {p}, {m}")
    costs = costs or Costs()
    sc = costs.per_stage(p)
    limit = 2 * onef1b_peak(p, m, costs) if memory_limit is None else float(memory_limit)
    need = minimum_memory(costs, p)
    if limit < need - _EPS:
        raise ValueError(
            f"{name}: memory_limit {limit:g} is below {need:g}, the memory of one microbatch in "
            f"flight on the busiest stage; no plan fits. Raise memory_limit to at least {need:g}"
        )
    placement = loop_placement(p, p)
    # Candidates are ranked by the longest rank span (the paper's objective and bubble rate),
    # then makespan; none may be slower than 1F1B-with-split-backward, the safe baseline.
    cands: list[tuple[float, float, object, dict]] = []
    for i, strategy in enumerate(STRATEGIES):
        res = list_schedule(p, m, sc, limit, strategy)
        if res is not None:
            cands.append((res[2], res[1], i, res[0]))
    w_after_b = {r: zbh1_rank_order(r, p, m, lag=0) for r in range(p)}
    baselines: list[tuple[str, dict]] = []
    if _fits(w_after_b, sc, limit):
        baselines.append(("w-after-b", w_after_b))
        try:
            baselines.append(("zbh1", dict(plan_zbh1(p, m, costs, memory_limit=limit).order)))
        except ValueError:
            pass  # ZB-H1 needs 1F1B's per-rank memory; a smaller limit just skips it
    bound = math.inf
    for label, orders in baselines:
        if not _fits(orders, sc, limit):
            continue
        r = simulate(make_plan(name, p, m, placement, orders), costs)
        span = max(iv[-1].end - iv[0].start for iv in r.timeline.values() if iv)
        cands.append((span, r.makespan, label, orders))
        if label == "w-after-b":
            bound = r.makespan
    ok = [c for c in cands if c[1] <= bound + _EPS]
    if not ok:
        raise ValueError(
            f"{name}: no schedule found under memory_limit {limit:g}; raise it to at least "
            f"{max(need, onef1b_peak(p, m, costs)):g} (1F1B's peak)"
        )
    best = min(ok, key=lambda c: (round(c[0], 9), round(c[1], 9)))
    source = best[2] if isinstance(best[2], str) else f"heuristic:{STRATEGIES[best[2]]}"
    log.debug(
        "%s p=%d m=%d limit=%g: span %g makespan %g from %s",
        name,
        p,
        m,
        limit,
        best[0],
        best[1],
        source,
    )
    plan = make_plan(name, p, m, placement, best[3], memory_limit=limit, source=source)
    return plan


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
    "Strategy",
    "list_schedule",
    "minimum_memory",
    "onef1b_peak",
    "plan_auto",
    "plan_zb1p",
    "plan_zb2p",
    "PlanError",
]
