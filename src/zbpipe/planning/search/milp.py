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
* objective ``"makespan"``: ``C >= S_a + T_a`` for all ``a``; minimise ``C``. Objective
  ``"span"`` (the bubble rate's denominator): ``C >= S_a + T_a - S_F(s,0)`` for every ``a`` on
  stage ``s``, with ``S_F(s,0)`` fixed at its as-soon-as-possible start (every rank starts with
  F0, which waits only for F0 upstream). The plan's value is an incumbent cut ``C <= C_plan``
  (scipy's HiGHS interface takes no initial solution).

Solved with ``scipy.optimize.milp`` (HiGHS) under a time limit; the order of each rank is read
from the solution's start times and rebuilt as a Plan. The result reports a **proven lower
bound** on the objective (over plans that keep the module's convention): the larger of HiGHS's
MIP dual bound (``mip_dual_bound``, the best bound of its branch and bound when it stops) and a
combinatorial one (:func:`warmup_bound`), so ``gap`` says how far from optimal the plan can be.
Exact solutions are practical for small cases (p <= 4, m <= 8); larger ones give a plan no worse
than the input and a bound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from ..core import Action, Plan
from ..costs import Costs, StageCosts
from ..rules import forced_before

if TYPE_CHECKING:
    from scipy.optimize import OptimizeResult

    from ..simulator import SimResult

log = logging.getLogger(__name__)

Objective = Literal["makespan", "span"]


@dataclass(frozen=True)
class RefineResult:
    """What ``refine`` found."""

    plan: Plan
    """The best plan known (the input if the solver found nothing better)."""
    makespan: float
    """Its simulated makespan."""
    lower_bound: float
    """A proven lower bound on the optimal ``objective`` (see ``bound_source``)."""
    gap: float
    """``(value - lower_bound) / value``: 0 means proven optimal."""
    optimal: bool
    """``value`` equals ``lower_bound``: no plan (keeping the convention) is better."""
    solver_log: str
    objective: Objective
    value: float
    """The plan's simulated ``objective``: makespan, or longest rank span."""
    bound_source: str
    """Where ``lower_bound`` comes from: "MILP optimum", "HiGHS dual bound" or "warm-up"."""
    bubble_rate: float
    """The plan's simulated bubble rate."""
    bubble_rate_bound: float
    """With ``objective="span"``, no plan has a lower bubble rate (else the same as bubble_rate)."""


class _Milp:
    """Variables and rows of the model for one plan's sizes and costs."""

    def __init__(self, p: int, m: int, sc: list[StageCosts]) -> None:
        self.p, self.m, self.sc = p, m, sc
        self.acts = [Action(s, k, j) for s in range(p) for j in range(m) for k in ("F", "B", "W")]
        self.idx = {a: i for i, a in enumerate(self.acts)}
        self.dur = [sc[a.stage].time(a.kind) for a in self.acts]
        self.pairs: list[tuple[Action, Action]] = []
        for s in range(p):
            mine = [a for a in self.acts if a.stage == s]
            for i, a in enumerate(mine):
                self.pairs.extend(
                    (a, b)
                    for b in mine[i + 1 :]
                    if not (forced_before(a, b) or forced_before(b, a))
                )
        self.obj = len(self.acts)  # the objective variable C
        self.y = {pr: self.obj + 1 + k for k, pr in enumerate(self.pairs)}
        self.nv = self.obj + 1 + len(self.pairs)
        self.rows: list[tuple[dict[int, float], float, float]] = []  # (coeffs, lo, hi)

    def at_least(self, coeffs: dict[int, float], lo: float) -> None:
        self.rows.append((coeffs, lo, float("inf")))

    def before(self, a: Action, b: Action) -> tuple[dict[int, float], float]:
        """``[a before b]`` as (coeffs, const): a y, 1 - y, or a constant."""
        if forced_before(a, b):
            return {}, 1.0
        if forced_before(b, a):
            return {}, 0.0
        if (a, b) in self.y:
            return {self.y[(a, b)]: 1.0}, 0.0
        return {self.y[(b, a)]: -1.0}, 1.0

    def first_starts(self) -> list[float]:
        """As-soon-as-possible start of F0 on each stage (each rank's first action)."""
        out, t = [], 0.0
        for c in self.sc:
            out.append(t)
            t += c.f + c.comm
        return out


def _add_no_overlap(model: _Milp, big_m: float) -> None:
    for a, b in model.pairs:
        ia, ib, y = model.idx[a], model.idx[b], model.y[(a, b)]
        model.at_least({ib: 1.0, ia: -1.0, y: -big_m}, model.dur[ia] - big_m)
        model.at_least({ia: 1.0, ib: -1.0, y: big_m}, model.dur[ib])


def _add_dependencies(model: _Milp) -> None:
    idx, dur, sc, p, m = model.idx, model.dur, model.sc, model.p, model.m
    for s in range(p):
        for j in range(m):
            f, b, w = idx[Action(s, "F", j)], idx[Action(s, "B", j)], idx[Action(s, "W", j)]
            model.at_least({b: 1.0, f: -1.0}, dur[f])
            model.at_least({w: 1.0, b: -1.0}, dur[b])
            if j + 1 < m:
                for k in ("F", "B", "W"):
                    i0, i1 = idx[Action(s, k, j)], idx[Action(s, k, j + 1)]
                    model.at_least({i1: 1.0, i0: -1.0}, dur[i0])
            if s > 0:
                fp = idx[Action(s - 1, "F", j)]
                model.at_least({f: 1.0, fp: -1.0}, dur[fp] + sc[s - 1].comm)
            if s < p - 1:
                bn = idx[Action(s + 1, "B", j)]
                model.at_least({b: 1.0, bn: -1.0}, dur[bn] + sc[s + 1].comm)


def _add_objective(model: _Milp, objective: Objective) -> None:
    C = model.obj
    for i, a in enumerate(model.acts):
        first = model.idx[Action(a.stage, "F", 0)]
        if objective == "makespan":
            model.at_least({C: 1.0, i: -1.0}, model.dur[i])
        elif i != first:
            model.at_least({C: 1.0, i: -1.0, first: 1.0}, model.dur[i])
    for s in range(model.p):  # F(s, 0) runs first on its rank, and the rank then has all its work
        work = sum(model.dur[model.idx[a]] for a in model.acts if a.stage == s)
        first = model.idx[Action(s, "F", 0)]
        model.at_least({C: 1.0, first: -1.0} if objective == "makespan" else {C: 1.0}, work)


def _add_memory(model: _Milp, limit: float) -> None:
    """The paper's constraint 7: after ``b``, the memory of ``b`` and everything before it fits."""
    for s in range(model.p):
        mine = [a for a in model.acts if a.stage == s]
        for b in mine:
            coeffs: dict[int, float] = {}
            const = model.sc[s].mem(b.kind)
            for a in mine:
                if a == b:
                    continue
                cf, c0 = model.before(a, b)
                d = model.sc[s].mem(a.kind)
                const += d * c0
                for k, v in cf.items():
                    coeffs[k] = coeffs.get(k, 0.0) + d * v
            model.rows.append((coeffs, -float("inf"), limit - const))


def _solve(
    model: _Milp, objective: Objective, incumbent: float, big_m: float, time_limit: float
) -> OptimizeResult:
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    A = lil_matrix((len(model.rows), model.nv))
    lo, hi = np.empty(len(model.rows)), np.empty(len(model.rows))
    for r, (coeffs, low, high) in enumerate(model.rows):
        for k, v in coeffs.items():
            A[r, k] = v
        lo[r], hi[r] = low, high
    c = np.zeros(model.nv)
    c[model.obj] = 1.0
    integrality = np.zeros(model.nv)
    integrality[model.obj + 1 :] = 1
    lb_vars, ub_vars = np.zeros(model.nv), np.full(model.nv, big_m)
    ub_vars[model.obj + 1 :] = 1.0
    ub_vars[model.obj] = incumbent + 1e-6  # incumbent cut from the input plan
    if objective == "span":  # every rank's first action starts as soon as it can
        for s, t in enumerate(model.first_starts()):
            lb_vars[model.idx[Action(s, "F", 0)]] = ub_vars[model.idx[Action(s, "F", 0)]] = t
    return milp(
        c,
        constraints=LinearConstraint(A.tocsr(), lo, hi),
        integrality=integrality,
        bounds=Bounds(lb_vars, ub_vars),
        options={"time_limit": time_limit, "disp": False},
    )


def warmup_bound(
    p: int, m: int, sc: list[StageCosts], limit: float | None, objective: Objective = "span"
) -> float:
    """A lower bound on the longest rank span (or the makespan) of any plan, from the warm-up.

    Rank ``r`` cannot start a B before its first microbatch has gone down the pipeline and its
    input gradient come back: ``F_r + sum_{s>r} (F_s + B_s) + the 2 (p - 1 - r) sends``. Until
    then it can only run forwards, at most ``min(m, limit / mem_f)`` of them, so it idles for
    the rest; its span is at least its work plus that idle.
    """
    best = 0.0
    offset = 0.0
    for r in range(p):
        c = sc[r]
        round_trip = c.f + sum(sc[s].f + sc[s].b for s in range(r + 1, p))
        round_trip += sum(sc[s].comm for s in range(r, p - 1)) + sum(
            sc[s].comm for s in range(r + 1, p)
        )
        k = m if limit is None or c.mem_f <= 0 else min(m, int(limit / c.mem_f + 1e-9))
        work = m * (c.f + c.b + c.w)
        span = work + max(0.0, round_trip - k * c.f)
        best = max(best, span if objective == "span" else offset + span)
        offset += c.f + c.comm
    return best


def _value(result: SimResult, objective: Objective) -> float:
    if objective == "makespan":
        return result.makespan
    return max(ivs[-1].end - ivs[0].start for ivs in result.timeline.values() if ivs)


def _read_orders(model: _Milp, starts: list[float]) -> dict[int, list[Action]]:
    """Each rank's actions sorted by the solution's start times (ties: F, B, W, microbatch)."""
    orders = {}
    for s in range(model.p):
        mine = [a for a in model.acts if a.stage == s]
        orders[s] = sorted(
            mine,
            key=lambda a: (round(starts[model.idx[a]], 6), "FBW".index(a.kind), a.microbatch),
        )
    return orders


def refine(
    plan: Plan,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    time_limit: float = 30.0,
    objective: Objective = "makespan",
) -> RefineResult:
    """Improve ``plan`` (F/B/W, one stage per rank) with the MILP; see the module docstring.

    ``objective="span"`` minimises the longest rank span, which is what the bubble rate measures.
    The returned plan is never worse than ``plan`` in ``objective``; ``result.plan.meta["refine"]``
    records the bound and the gap.

    Long because the MILP's variables and constraints are declared in one place, in the paper's
    order (Appendix G).
    """
    from ..simulator import simulate

    costs = costs or Costs()
    p, m = plan.num_ranks, plan.n_microbatches
    if plan.num_stages != p or any(a.kind == "BW" for acts in plan.order.values() for a in acts):
        raise ValueError(
            "refine: needs a one-stage-per-rank plan with split backward (F, B, W); "
            f"{plan.name} has {plan.num_stages} stages or fused BW"
        )
    sc = costs.per_stage(p)
    base = simulate(plan, costs, memory_limit)
    incumbent = _value(base, objective)
    model = _Milp(p, m, sc)
    # big-M: an upper bound on every end in any plan at least as good as the incumbent
    big_m = incumbent + (model.first_starts()[-1] if objective == "span" else 0.0)
    _add_no_overlap(model, big_m)
    _add_dependencies(model)
    _add_objective(model, objective)
    if memory_limit is not None:
        _add_memory(model, memory_limit)
    res = _solve(model, objective, incumbent, big_m, time_limit)
    solver_log = (
        f"HiGHS status {res.status}: {res.message}; {len(model.pairs)} ordering binaries, "
        f"{len(model.rows)} rows"
    )
    log.info("refine %s p=%d m=%d: %s", plan.name, p, m, solver_log)
    best, best_sim = plan, base
    if res.x is not None:
        new = Plan(
            name=plan.name,
            num_ranks=p,
            n_microbatches=m,
            placement=plan.placement,
            order={r: tuple(a) for r, a in _read_orders(model, list(res.x[: model.obj])).items()},
            layout=plan.layout,
            meta={**dict(plan.meta), "refined": True},
        )
        new.validate()
        got = simulate(new, costs, memory_limit)
        if objective == "makespan" and got.makespan > res.fun + 1e-6 * max(1.0, res.fun):
            raise RuntimeError(
                f"refine: simulated makespan {got.makespan} exceeds the MILP objective {res.fun}"
            )
        if _value(got, objective) <= incumbent:
            best, best_sim = new, got
    return _result(
        best, best_sim, res, objective, warmup_bound(p, m, sc, memory_limit, objective), solver_log
    )


def _result(
    plan: Plan,
    sim: SimResult,
    res: OptimizeResult,
    objective: Objective,
    warmup: float,
    solver_log: str,
) -> RefineResult:
    """The bound is the best of: proven optimality, HiGHS's dual bound, the warm-up bound."""
    import math

    value = _value(sim, objective)
    dual = getattr(res, "mip_dual_bound", None)
    bounds = [(warmup, "warm-up")]
    if dual is not None and math.isfinite(dual):
        bounds.append((float(dual), "HiGHS dual bound"))
    if res.status == 0 and res.x is not None:  # solved: the MILP optimum bounds every plan
        bounds.append((float(res.fun), "MILP optimum"))
    lower, source = max(bounds)
    lower = min(lower, value)
    optimal = value - lower <= 1e-9 * max(1.0, value)
    busy = sum(sim.busy.values())
    bubble = sim.bubble_rate
    bubble_bound = bubble
    if objective == "span" and lower > 0:  # bubble = 1 - busy / (p span): monotone in the span
        bubble_bound = max(0.0, 1 - busy / (plan.num_ranks * lower))
    gap = (value - lower) / value if value else 0.0
    info = {
        "objective": objective,
        "value": value,
        "lower_bound": lower,
        "gap": gap,
        "bound_source": source,
        "optimal": optimal,
        "bubble_rate_bound": bubble_bound,
        "warmup_bound": warmup,
        "highs_dual_bound": float(dual) if dual is not None else None,
        "highs_status": int(res.status),
    }
    plan = replace(plan, meta={**dict(plan.meta), "refine": info})
    return RefineResult(
        plan,
        sim.makespan,
        lower,
        gap,
        optimal,
        solver_log,
        objective,
        value,
        source,
        bubble,
        bubble_bound,
    )
