"""Exact refinement: the scheduling problem as a MILP (Qi et al., ICLR 2024, Appendix G).

Model (one stage per rank, loop placement; ``n = 3m`` actions per rank):

* continuous ``S_a >= 0``: start of action ``a``; its end is ``S_a + T_a``; ``C``: the makespan.
* binary ``y_ab`` for each *unordered pair on the same rank* (``a`` before ``b`` iff 1): only
  same-rank pairs need ordering variables, since a rank runs one action at a time. Pairs whose
  order is forced are fixed, not modelled: F before B before W of one microbatch, and
  microbatches of one kind in increasing order on a stage (the heuristic's and the runtime's
  convention; it removes the symmetric solutions). Transitivity then comes for free from the
  time constraints below.
* no overlap (big-M with ``M`` = the heuristic's makespan, an upper bound on every end):
  ``S_b >= S_a + T_a - M (1 - y_ab)`` and ``S_a >= S_b + T_b - M y_ab``.
* dependencies with communication: ``S_F(s,j) >= S_F(s-1,j) + T_F + comm``,
  ``S_B(s,j) >= S_B(s+1,j) + T_B + comm`` and ``>= S_F(s,j) + T_F``, ``S_W >= S_B + T_B``.
* memory (the paper's constraint 7): after action ``b`` a rank holds
  ``dM_b + sum_a dM_a y_ab <= M_limit``: the memory of the actions ordered before ``b``. That is
  linear in the ordering binaries, so no time-indexed memory variables are needed.
* ``C >= S_a + T_a`` for all ``a``; minimise ``C``. The heuristic's makespan is an incumbent cut
  ``C <= C_heur`` (scipy's HiGHS interface takes no initial solution).

Solved with ``scipy.optimize.milp`` (HiGHS) under a time limit; the order of each rank is read
from the solution's start times and rebuilt as a Plan, whose simulated makespan is checked
against the solver's objective. Practical for small cases (p <= 4, m <= 8).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .core import Action, Plan, make_plan
from .costs import Costs
from .rules import forced_before

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefineResult:
    """What ``refine`` found."""

    plan: Plan
    """The best plan known (the heuristic's if the solver found nothing better)."""
    makespan: float
    """Its simulated makespan."""
    lower_bound: float
    """The solver's proven lower bound on the optimal makespan."""
    gap: float
    """``(makespan - lower_bound) / makespan``: 0 means proven optimal."""
    optimal: bool
    solver_log: str


def refine(
    plan: Plan,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    time_limit: float = 30.0,
) -> RefineResult:
    """Improve ``plan`` (F/B/W, one stage per rank) with the MILP; see the module docstring."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    from .simulator import simulate

    costs = costs or Costs()
    p, m = plan.num_ranks, plan.n_microbatches
    if plan.num_stages != p or any(a.kind == "BW" for acts in plan.order.values() for a in acts):
        raise ValueError(
            "refine: needs a one-stage-per-rank plan with split backward (F, B, W); "
            f"{plan.name} has {plan.num_stages} stages or fused BW"
        )
    sc = costs.per_stage(p)
    base = simulate(plan, costs, memory_limit)
    ub = base.makespan
    acts = [Action(s, k, j) for s in range(p) for j in range(m) for k in ("F", "B", "W")]
    idx = {a: i for i, a in enumerate(acts)}
    n_t = len(acts)
    pairs = []
    for s in range(p):
        mine = [a for a in acts if a.stage == s]
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if not (forced_before(a, b) or forced_before(b, a)):
                    pairs.append((a, b))
    yidx = {pr: n_t + 1 + k for k, pr in enumerate(pairs)}
    nv = n_t + 1 + len(pairs)
    C = n_t
    dur = [sc[a.stage].time(a.kind) for a in acts]
    M = ub
    rows: list[tuple[dict[int, float], float, float]] = []  # (coeffs, lo, hi)
    inf = np.inf

    def before(a: Action, b: Action) -> tuple[dict[int, float], float]:
        """``[a before b]`` as (coeffs, const): a y, 1 - y, or a constant."""
        if forced_before(a, b):
            return {}, 1.0
        if forced_before(b, a):
            return {}, 0.0
        if (a, b) in yidx:
            return {yidx[(a, b)]: 1.0}, 0.0
        return {yidx[(b, a)]: -1.0}, 1.0

    for a, b in pairs:  # no overlap on a rank
        ia, ib, y = idx[a], idx[b], yidx[(a, b)]
        rows.append(({ib: 1.0, ia: -1.0, y: -M}, dur[ia] - M, inf))
        rows.append(({ia: 1.0, ib: -1.0, y: M}, dur[ib], inf))
    for s in range(p):
        for j in range(m):
            f, b, w = idx[Action(s, "F", j)], idx[Action(s, "B", j)], idx[Action(s, "W", j)]
            rows.append(({b: 1.0, f: -1.0}, dur[f], inf))
            rows.append(({w: 1.0, b: -1.0}, dur[b], inf))
            if j + 1 < m:
                for k in ("F", "B", "W"):
                    i0, i1 = idx[Action(s, k, j)], idx[Action(s, k, j + 1)]
                    rows.append(({i1: 1.0, i0: -1.0}, dur[i0], inf))
            if s > 0:
                fp = idx[Action(s - 1, "F", j)]
                rows.append(({f: 1.0, fp: -1.0}, dur[fp] + sc[s - 1].comm, inf))
            if s < p - 1:
                bn = idx[Action(s + 1, "B", j)]
                rows.append(({b: 1.0, bn: -1.0}, dur[bn] + sc[s + 1].comm, inf))
    for i in range(n_t):
        rows.append(({C: 1.0, i: -1.0}, dur[i], inf))
    for s in range(p):  # F(s, 0) runs first on its rank, and the rank then has all its work to do
        work = sum(dur[idx[a]] for a in acts if a.stage == s)
        rows.append(({C: 1.0, idx[Action(s, "F", 0)]: -1.0}, work, inf))
    if memory_limit is not None:
        for s in range(p):
            mine = [a for a in acts if a.stage == s]
            for b in mine:
                coeffs: dict[int, float] = {}
                const = sc[s].mem(b.kind)
                for a in mine:
                    if a == b:
                        continue
                    cf, c0 = before(a, b)
                    d = sc[s].mem(a.kind)
                    const += d * c0
                    for k, v in cf.items():
                        coeffs[k] = coeffs.get(k, 0.0) + d * v
                rows.append((coeffs, -inf, memory_limit - const))
    A = lil_matrix((len(rows), nv))
    lo, hi = np.empty(len(rows)), np.empty(len(rows))
    for r, (coeffs, l, h) in enumerate(rows):
        for k, v in coeffs.items():
            A[r, k] = v
        lo[r], hi[r] = l, h
    c = np.zeros(nv)
    c[C] = 1.0
    integrality = np.zeros(nv)
    integrality[n_t + 1 :] = 1
    ub_vars = np.full(nv, M)
    ub_vars[n_t + 1 :] = 1.0
    ub_vars[C] = ub + 1e-6  # incumbent cut from the heuristic
    res = milp(
        c,
        constraints=LinearConstraint(A.tocsr(), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(nv), ub_vars),
        options={"time_limit": time_limit, "disp": False},
    )
    solver_log = f"HiGHS status {res.status}: {res.message}; {len(pairs)} ordering binaries, {len(rows)} rows"
    log.info("refine %s p=%d m=%d: %s", plan.name, p, m, solver_log)
    raw = getattr(res, "mip_dual_bound", None)
    bound = float(raw) if raw is not None else np.nan
    if res.x is None:
        lb = bound if np.isfinite(bound) else 0.0
        return RefineResult(plan, ub, lb, (ub - lb) / ub if ub else 0.0, False, solver_log)
    starts = res.x[:n_t]
    orders = {}
    for s in range(p):
        mine = [a for a in acts if a.stage == s]
        orders[s] = sorted(
            mine, key=lambda a: (round(starts[idx[a]], 6), "FBW".index(a.kind), a.microbatch)
        )
    new = make_plan(plan.name, p, m, plan.placement, orders, refined=True, **dict(plan.meta))
    got = simulate(new, costs, memory_limit)
    obj = float(res.fun)
    if got.makespan > obj + 1e-6 * max(1.0, obj):
        raise RuntimeError(
            f"refine: simulated makespan {got.makespan} exceeds the MILP objective {obj}"
        )
    best, span = (new, got.makespan) if got.makespan <= ub else (plan, ub)
    lb = min(bound if np.isfinite(bound) else obj, span)
    optimal = res.status == 0
    if optimal:
        lb = span
    gap = (span - lb) / span if span else 0.0
    return RefineResult(best, span, lb, gap, optimal, solver_log)
