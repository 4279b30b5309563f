"""What each generator and memory mode promises, one property each, as README.md states it.

ZB-H1, ZB-H2, ZB-1p, ZB-2p and ZB-V: never slower than 1F1B on the same model (simulated makespan;
ZB-V from two microbatches on, test_plan_zbv.py's xfail records a one-microbatch loss).
V-Half and V-Min: within their memory budget, (p+2)/2 and (p+4)/3 units of one p-stage microbatch.
Their makespan against 1F1B is *not* promised (docs/reference/zbv-tables.md reports it): the last
test
records one case where they are slower, so the README cannot drift back to promising it.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.planning._strategies import costs_st
from zbpipe.planning import Costs, simulate
from zbpipe.planning.loop.heuristic import plan_zb1p, plan_zb2p
from zbpipe.planning.loop.onef1b import plan_1f1b
from zbpipe.planning.loop.zbh1 import plan_zbh1
from zbpipe.planning.loop.zbh2 import plan_zbh2
from zbpipe.planning.v.zbv import plan_zbv

EPS = 1e-9  # simulated times are sums of the same floats: only rounding can differ


def onef1b_makespan(p, m, costs):
    return simulate(plan_1f1b(p, m, costs), costs).makespan


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 16), costs=costs_st)
@pytest.mark.parametrize(
    "gen", [plan_zbh1, plan_zbh2, plan_zb1p, plan_zb2p], ids=lambda g: g.__name__
)
def test_zb_family_never_slower_than_1f1b(gen, p, m, costs):
    assert simulate(gen(p, m, costs), costs).makespan <= onef1b_makespan(p, m, costs) + EPS


# 15 drawn cases (25 in the two tests before) and the corners written out
@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(2, 32), costs=costs_st)
@example(p=1, m=2, costs=Costs(f=0.2, b=2, w=0.1, comm=0.3))
@example(p=8, m=2, costs=Costs(f=2, b=0.2, w=2, comm=0.0))
@example(p=8, m=32, costs=Costs(f=1, b=1.2, w=0.6, comm=0.05))
def test_zbv_never_slower_than_1f1b_on_the_same_model(p, m, costs):
    """Replaces this test (p 1..6, m 1..16, 15 cases) and test_plan_zbv.py's
    test_zbv_makespan_not_worse_than_1f1b (p 1..8, m 2..32, 10 cases), which checked the same.

    From m = 2 on: with one microbatch ZB-V can lose to 1F1B (test_plan_zbv.py's strict xfail
    records the case, p = 2, m = 1, w = 0.125, comm = 0.25, inside these ranges), so m = 1 made
    this flaky; the tolerance is this file's EPS (the other test's 1e-6 was looser).
    """
    # V runs the same model in 2p half-size chunks; 1F1B runs it in p stages.
    whole = costs.joined(2)
    r = simulate(plan_zbv(p, m, costs, memory="zb"), costs)
    assert r.makespan <= onef1b_makespan(p, m, whole) + EPS


UNITS = {"half": lambda p: (p + 2) / 2, "min": lambda p: (p + 4) / 3}


# 14 drawn cases over the three modes (40 in the three tests before: a V plan is a search, a
# quarter to half a second of CPU from p * m = 100 on) and the corners written out
@settings(max_examples=14, deadline=None)
@given(
    p=st.integers(1, 8),
    m=st.integers(1, 32),
    costs=costs_st,
    mode=st.sampled_from(["zb", "half", "min"]),
)
@example(p=1, m=1, costs=Costs(f=0.2, b=2, w=0.1, comm=0.3), mode="min")
@example(p=2, m=1, costs=Costs(f=2, b=0.2, w=2, comm=0.0), mode="half")
@example(p=8, m=16, costs=Costs(f=1, b=1.5, w=0.5, comm=0.3), mode="min")
@example(p=8, m=32, costs=Costs(f=1, b=1.2, w=0.6, comm=0.05), mode="zb")
def test_v_plans_complete_deadlock_free_and_within_their_budget(p, m, costs, mode):
    """Replaces test_v_half_and_v_min_within_their_budget[half, min] (p 2..6, m 1..16, 15 cases
    each) and test_plan_zbv.py's test_any_case_complete_deadlock_free_within_budget (p 1..8,
    m 1..32, 10 cases over the three modes): both planned, simulated under a budget and checked
    the peak, on overlapping ranges.

    Every plan is complete, deadlock-free and within its budget; V-Half's and V-Min's within
    (p+2)/2 and (p+4)/3 units of one p-stage microbatch, or the floor (one microbatch of a rank's
    two chunks) where that is more.
    """
    pl = plan_zbv(p, m, costs, memory=mode)
    pl.validate()  # complete: every (stage, microbatch) has F, B and W
    budget = pl.meta["memory_budget"]
    r = simulate(pl, costs, memory_limit=budget)  # raises on deadlock / overflow
    peak = max(r.peak_memory.values())
    assert peak <= budget + EPS
    if mode != "zb":
        unit = 2 * costs.mem_f  # one microbatch of a p-stage stage = two chunks' forwards
        assert peak <= max(UNITS[mode](p) * unit, budget) + EPS


def test_v_half_and_v_min_may_be_slower_than_1f1b():
    # Issue 13's case: p = 8, m = 24, f = 1, b = 1.2, w = 0.6, comm = 0.05 per chunk.
    chunk = Costs(f=1, b=1.2, w=0.6, comm=0.05)
    whole = chunk.joined(2)
    base = onef1b_makespan(8, 24, whole)
    slower = [
        mode
        for mode in ("half", "min")
        if simulate(plan_zbv(8, 24, chunk, memory=mode), chunk).makespan > base
    ]
    assert slower, "V-Half/V-Min now beat 1F1B here: README may say so only if a test promises it"
