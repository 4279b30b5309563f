"""The MILP refinement: proves optimality on small cases; checked by brute force on p=2, m=2."""

import itertools

import pytest

from zbpipe.planning.core import Action, PlanError, loop_placement, make_plan
from zbpipe.planning.costs import Costs
from zbpipe.planning.loop.heuristic import plan_zb1p, plan_zb2p
from zbpipe.planning.search.milp import refine, warmup_bound
from zbpipe.planning.simulator import simulate

COSTS = [Costs(), Costs(f=1, b=1.5, w=0.7, comm=0.2), Costs(f=1, b=1, w=2, comm=0.5)]


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 4)])
@pytest.mark.parametrize("gen", [plan_zb1p, plan_zb2p])
def test_refine_proves_optimality(gen, p, m, costs):
    plan = gen(p, m, costs)
    limit = plan.meta["memory_limit"]
    res = refine(plan, costs, limit, time_limit=20)
    assert res.optimal and res.gap == pytest.approx(0.0, abs=1e-9)
    assert simulate(res.plan, costs, limit).makespan == pytest.approx(res.makespan, abs=1e-6)
    heur = simulate(plan, costs).makespan
    print(
        f"{plan.name} p={p} m={m} {costs}: heuristic {heur:g} optimum {res.makespan:g} "
        f"gap {(heur - res.makespan) / res.makespan:.2%}"
    )
    assert heur >= res.makespan - 1e-9


def _rank_orders(stage: int, m: int):
    acts = [Action(stage, k, j) for j in range(m) for k in "FBW"]
    for perm in itertools.permutations(acts):
        seen = set()
        ok = True
        for a in perm:
            need = {"F": None, "B": "F", "W": "B"}[a.kind]
            if need and (need, a.microbatch) not in seen:
                ok = False
                break
            seen.add((a.kind, a.microbatch))
        if ok:
            yield perm


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("limit", [1.0, 2.0])
def test_brute_force_p2_m2(costs, limit):
    # Every per-rank order (any microbatch order), simulated: the true optimum.
    best = float("inf")
    for o0 in _rank_orders(0, 2):
        for o1 in _rank_orders(1, 2):
            plan = make_plan("bf", 2, 2, loop_placement(2, 2), {0: o0, 1: o1})
            try:
                best = min(best, simulate(plan, costs, limit).makespan)
            except PlanError:
                pass
    res = refine(plan_zb2p(2, 2, costs, memory_limit=limit), costs, limit, time_limit=20)
    assert res.optimal
    assert res.makespan == pytest.approx(best, abs=1e-9)


def _span(plan, costs, limit):
    r = simulate(plan, costs, limit)
    return max(ivs[-1].end - ivs[0].start for ivs in r.timeline.values())


def _brute_force_spans(costs, limit, convention_only):
    """Simulated longest rank span of every p=2, m=2 plan (optionally only convention-keeping)."""
    spans = []
    for o0 in _rank_orders(0, 2):
        for o1 in _rank_orders(1, 2):
            orders = {0: o0, 1: o1}
            if convention_only and any(
                [a.microbatch for a in o if a.kind == k] != [0, 1]
                for o in orders.values()
                for k in "FBW"
            ):
                continue
            try:
                spans.append(
                    _span(make_plan("bf", 2, 2, loop_placement(2, 2), orders), costs, limit)
                )
            except PlanError:
                pass
    return spans


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("limit", [1.0, 2.0])
def test_span_objective_bound_and_plan_against_brute_force(costs, limit):
    res = refine(plan_zb2p(2, 2, costs, memory_limit=limit), costs, limit, 20, objective="span")
    every = _brute_force_spans(costs, limit, convention_only=False)
    kept = _brute_force_spans(costs, limit, convention_only=True)
    assert res.value == pytest.approx(_span(res.plan, costs, limit), abs=1e-9)
    assert min(every) - 1e-9 <= res.value  # no plan beats the truth
    assert res.lower_bound <= min(kept) + 1e-9  # the bound is a bound
    assert res.value == pytest.approx(min(kept), abs=1e-6)  # and the MILP finds the optimum
    assert res.plan.meta["refine"]["lower_bound"] == res.lower_bound


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("limit", [1.0, 2.0, 3.0])
def test_warmup_bound_never_exceeds_any_plan(costs, limit):
    bound = warmup_bound(2, 2, costs.per_stage(2), limit, "span")
    assert bound <= min(_brute_force_spans(costs, limit, convention_only=False)) + 1e-9


def test_refine_reports_a_bound_and_gap_when_it_cannot_prove_optimality():
    costs = Costs(f=1, b=1.07, w=0.93, comm=0.07, mem_f=1, mem_b=-0.63, mem_w=-0.37)
    plan = plan_zb2p(4, 8, costs)
    limit = plan.meta["memory_limit"]
    res = refine(plan, costs, limit, time_limit=2, objective="span")
    assert 0 < res.lower_bound <= res.value <= _span(plan, costs, limit) + 1e-9
    assert res.gap == pytest.approx((res.value - res.lower_bound) / res.value)
    busy = sum(simulate(res.plan, costs).busy.values())
    assert res.bubble_rate_bound == pytest.approx(max(0.0, 1 - busy / (4 * res.lower_bound)))
