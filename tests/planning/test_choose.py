"""The schedule chooser (pure planning): each budget picks the fastest candidate that fits.

References are the paper's closed forms for unit costs (F = B = W = 1, no comm), p = 4, m = 8,
memory in microbatches of one stage of the model cut into p stages:

* makespans: 1F1B (m + p - 1) x 3 = 33; ZB-H1 3m + (p - 1) = 27 (the paper's formula); ZB-V
  with m >= 2p has no bubble: 3m plus the V's fill of 3 chunk units = 25.5;
* peaks: 1F1B, ZB-H1, ZB-1p and ZB-V p = 4; ZB-2p 2p = 8; V-Half (p + 2) / 2 = 3;
  V-Min (p + 4) / 3 = 2.67 (its plan holds 2.5).
"""

from __future__ import annotations

import pytest

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.budget import parse_budget
from zbpipe.planning.search.within_budget import choose_plan

P, M = 4, 8


@pytest.mark.parametrize(
    "limit,layouts,expected",
    [
        (8.0, ("loop", "v"), "ZBV"),  # 25.5 beats every loop plan (>= 27)
        (4.0, ("loop", "v"), "ZBV"),  # ZB-V holds 1F1B's p
        (3.0, ("loop", "v"), "ZBVHalf"),  # below p: only V-Half (3) and V-Min fit
        (2.7, ("loop", "v"), "ZBVMin"),  # below V-Half's 3
        (8.0, ("loop",), "ZBH1"),  # ZB-2p is no faster at m = 8 (27): ties keep the simpler
        (4.0, ("loop",), "ZBH1"),  # 27 < 1F1B's 33
    ],
)
def test_each_budget_picks_the_expected_plan(limit, layouts, expected):
    choice = choose_plan(P, M, limit, layouts=layouts)
    assert choice.best.name == expected
    assert choice.best.peak <= limit
    # independently: the chosen plan simulated again is within the limit and no fitting
    # candidate is faster
    r = simulate(choice.best.plan, Costs() if choice.best.layout == "loop" else Costs().split(2))
    assert max(r.peak_memory.values()) <= limit
    for c in choice.candidates:
        if c.fits:
            assert choice.best.makespan <= c.makespan + 1e-9


def test_closed_forms_hold_for_the_candidates():
    choice = choose_plan(P, M, 100.0)
    by = {c.name: c for c in choice.candidates}
    assert by["1F1B"].makespan == pytest.approx((M + P - 1) * 3)
    assert by["ZBH1"].makespan == pytest.approx(3 * M + (P - 1))
    assert by["ZB2P"].peak == pytest.approx(2 * P)
    assert by["ZBVHalf"].peak <= (P + 2) / 2 + 1e-9
    assert by["ZBVMin"].peak <= (P + 4) / 3 + 1e-9


def test_an_unreachable_budget_raises_naming_the_least_need():
    with pytest.raises(ValueError, match=r"memory_limit 2 per rank.*2\.5 \(ZBVMin\)"):
        choose_plan(P, M, 2.0)
    with pytest.raises(ValueError, match="no schedule fits"):
        choose_plan(P, M, 3.9, layouts=("loop",))


def test_a_heavy_head_in_bytes_moves_the_choice():
    """A last stage holding 3x the bytes of the others: 1F1B's peak is still rank 0's 4 units,
    but ZB-2p's last rank would hold 4 heavy microbatches; the table prints bytes."""
    gib = 2**30
    heavy = Costs(mem_f=[gib, gib, gib, 3 * gib], mem_w=[-gib, -gib, -gib, -3 * gib])
    choice = choose_plan(P, M, 4 * gib, costs=heavy)
    assert choice.best.peak <= 4 * gib
    for c in choice.candidates:
        expected_fit = max(simulate(c.plan, c.plan and _costs_for(c, heavy)).peak_memory.values())
        assert c.fits == (expected_fit <= 4 * gib * (1 + 1e-9))
    assert "GiB" in choice.table(1.0)


def _costs_for(c, costs):
    return costs if c.layout == "loop" else costs.split(2)


@pytest.mark.parametrize(
    "text,value",
    [("40GiB", 40 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1.5e9), ("4096", 4096.0)],
)
def test_byte_budgets_parse(text, value):
    assert parse_budget(text) == (value, False)


def test_a_percentage_is_a_share_and_nonsense_is_a_clear_error():
    assert parse_budget("80%") == (0.8, True)
    with pytest.raises(ValueError, match="'40GiB'"):
        parse_budget("40 parsecs")


def test_plans_of_the_candidates_are_the_generators_plans():
    choice = choose_plan(P, M, 100.0)
    for c in choice.candidates:
        costs = Costs() if c.layout == "loop" else Costs().split(2)
        assert c.plan.order == plan(c.name, P, M, costs=costs).order
