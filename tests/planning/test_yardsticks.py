"""The memory yardsticks (planning/yardsticks.py) against hand-counted cases, and the planners'
budgets against them when B holds more than F (the graph engine, activation checkpointing)."""

from __future__ import annotations

import pytest

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.yardsticks import (
    least_memory,
    onef1b_peak,
    onef1b_rank_peaks,
    promised_peak,
    v_budget,
    v_minimum_memory,
)

EPS = 1e-9


def _costs(mem_f, mem_b, **times):
    n = len(mem_f)
    return Costs(
        **times, mem_f=mem_f, mem_b=mem_b, mem_w=[-(f + b) for f, b in zip(mem_f, mem_b)][:n]
    )


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (3, 3)])
def test_onef1b_counts_forwards_in_flight_when_b_frees(p, m):
    # B frees half of what F held: rank r's peak is its min(p - r, m) forwards in flight
    c = _costs([1.0 + r for r in range(p)], [-0.5 - r / 2 for r in range(p)])
    assert onef1b_rank_peaks(p, m, c) == {r: min(p - r, m) * (1.0 + r) for r in range(p)}


def test_onef1b_counts_what_a_backward_holds_beyond_its_forward():
    # checkpointing: F holds 1, B holds 10 more until its W. Rank r of 1F1B: min(p - r, m) - 1
    # forwards still in flight while one backward holds 1 + 10 (its W right after its B).
    p, m = 4, 8
    c = _costs([1.0] * p, [10.0] * p)
    assert onef1b_rank_peaks(p, m, c) == {r: (min(p - r, m) - 1) + 11.0 for r in range(p)}
    assert onef1b_peak(p, m, c) == 14.0


def test_v_budgets_by_hand():
    p, m = 4, 8
    sc = _costs([1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0], [0.5] * 8).per_stage(8)
    # stage 0 of the 4-stage model = chunks 0 and 1: F holds 3, B adds 1
    assert v_budget(p, m, sc, "half") == pytest.approx((p + 2) / 2 * 3 + 1)
    assert v_budget(p, m, sc, "min") == pytest.approx((p + 4) / 3 * 3 + 1)
    # ZB-V: 1F1B on chunks joined in pairs (3, 2, 2, 4 held after F; 1 more after B)
    assert v_budget(p, m, sc, "zb") == pytest.approx(max(4 * 3, 3 * 2, 2 * 2, 1 * 4) + 1)
    # the least a V rank holds: rank 0 has chunks 0 and 7 in flight, after their Bs
    assert v_minimum_memory(sc, p) == pytest.approx(1.5 + 3.5)
    assert least_memory(_costs([1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0], [0.5] * 8), p, "v") == 5


# F holds 1 per stage, B holds 6 more until W (checkpointed blocks); the last stage's head is
# not checkpointed (F holds 4, B frees 1). Times: B and W dearer than F, as recomputation makes.
AC = dict(f=1.0, b=2.0, w=1.0)


@pytest.mark.parametrize("name", ["ZBH1", "ZB1P", "ZB2P"])
def test_loop_plans_keep_their_promise_when_b_holds_more_than_f(name):
    p, m = 4, 12
    c = _costs([1.0, 1.0, 1.0, 4.0], [6.0, 6.0, 6.0, -1.0], **AC)
    r = simulate(plan(name, p, m, costs=c), c)
    assert max(r.peak_memory.values()) <= promised_peak(name, p, m, c) + EPS
    base = onef1b_peak(p, m, c)
    assert promised_peak(name, p, m, c) == (2 if name == "ZB2P" else 1) * base


def test_v_plans_keep_their_promises_and_v_half_holds_less_than_zbv():
    p, m = 4, 12
    c = _costs([0.5] * 7 + [2.0], [3.0] * 7 + [-0.5], **{k: v / 2 for k, v in AC.items()})
    peaks = {}
    for name in ("ZBV", "ZBVHalf", "ZBVMin"):
        r = simulate(plan(name, p, m, costs=c), c)
        peaks[name] = max(r.peak_memory.values())
        assert peaks[name] <= promised_peak(name, p, m, c, stages_per_rank=2) + EPS, name
    assert peaks["ZBVMin"] <= peaks["ZBVHalf"] < peaks["ZBV"]
    assert promised_peak("ZBVHalf", p, m, c, 2) < promised_peak("ZBV", p, m, c, 2)
