"""The chooser at run time, on 2 gloo ranks: the byte budget picks the plan the simulator says is
fastest within it for the bytes the first step measured, the measured peak stays under the
budget, and a budget nothing fits raises on every rank.

Budgets are set from torch-free arithmetic on this model's bytes (``_memory_default_cases``):
generous (no limit in practice), 1F1B's peak plus a little, and 1 KiB (below one microbatch).
The expected plan is computed here from the measured costs with ``simulate``, independently of
the chooser's code path.
"""

from __future__ import annotations

import pytest

from tests.schedules import _memory_default_cases as cases
from zbpipe.planning import Costs, plan, simulate
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

M = 4
BUDGETS = ["64MiB", "620KiB", "1KiB", "ZBAuto:620KiB", "ZBAuto:1KiB"]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return run_ranks(cases.chooser_rows, 2, M, BUDGETS, timeout=300)


def _expected(row: dict, budget_bytes: float) -> str:
    costs = Costs(**row["costs"])
    best = None
    for name in ("1F1B", "ZBH1", "ZB1P", "ZB2P"):
        try:
            p = plan(name, 2, M, costs=costs)
        except ValueError:
            continue
        r = simulate(p, costs)
        if max(r.peak_memory.values()) * row["unit_bytes"] <= budget_bytes * (1 + 1e-9):
            if best is None or r.makespan < best[0] - 1e-9:
                best = (r.makespan, name)
    assert best is not None
    return best[1]


@pytest.mark.parametrize("budget,nbytes", [("64MiB", 64 * 2**20), ("620KiB", 620 * 2**10)])
def test_each_budget_picks_the_fastest_plan_that_fits(rows, budget, nbytes):
    for out in rows:
        row = out[budget]
        assert "error" not in row, row.get("error")
        assert row["first_plan"] == "OneInFlight"  # the measuring step holds the least memory
        assert row["plan"] == _expected(row, nbytes), row
        assert max(row["peaks"][1:]) <= nbytes, (budget, row["peaks"])
    assert rows[0][budget]["plan"] == rows[1][budget]["plan"]


def test_the_budgets_choose_different_plans(rows):
    assert rows[0]["64MiB"]["plan"] != rows[0]["620KiB"]["plan"]


def test_an_unreachable_budget_raises_on_every_rank_after_the_measuring_step(rows):
    for out in rows:
        row = out["1KiB"]
        assert "no loop-placement schedule fits memory_limit 1 KiB" in row["error"], row
        assert row["steps_done"] == 0  # the measuring step itself raised at its end


def test_given_bytes_raise_at_construction_before_any_communication(rows):
    row = rows[0]["64MiB"]
    costs = dict(row["costs"])
    costs["mem_f"] = [f * row["unit_bytes"] for f in costs["mem_f"]]
    costs["mem_b"] = [f * row["unit_bytes"] for f in costs["mem_b"]]
    costs["mem_w"] = [f * row["unit_bytes"] for f in costs["mem_w"]]
    out = run_ranks(cases.chooser_from_given_bytes, 2, M, "1KiB", costs, timeout=120)
    assert all(o.startswith("ValueError: ScheduleAuto: no loop-placement") for o in out), out


def test_zbauto_with_a_byte_budget_runs_its_plan_within_it(rows):
    for out in rows:
        row = out["ZBAuto:620KiB"]
        assert "error" not in row, row.get("error")
        assert row["first_plan"] == "OneInFlight" and row["plan"] == "ZB2P"
        assert max(row["peaks"][1:]) <= 620 * 2**10, row["peaks"]


def test_zbauto_with_an_unreachable_byte_budget_raises_on_every_rank(rows):
    for out in rows:
        assert "ScheduleZBAuto: memory_limit 1 KiB per rank is below" in out["ZBAuto:1KiB"]["error"]


def test_v_stages_get_the_v_chooser_and_its_fastest_plan_within_the_budget():
    """Two stages per rank in V placement: ScheduleAutoV, choosing among ZB-V, V-Half and V-Min
    for the bytes its first step measured; gradients still equal the unpipelined model's."""
    budget = 64 * 2**20
    out = run_ranks(cases.chooser_v_row, 2, M, "64MiB", timeout=300)
    for row in out:
        assert row["cls"] == "ScheduleAutoV" and row["first_plan"] == "OneInFlight"
        assert row["grad_diff"] < 1e-5, row["grad_diff"]
        assert row["peak"] <= budget
    costs = Costs(**out[0]["costs"])
    fastest = None
    for name in ("ZBV", "ZBVHalf", "ZBVMin"):
        r = simulate(plan(name, 2, M, costs=costs), costs)
        if max(r.peak_memory.values()) * out[0]["unit_bytes"] <= budget:
            if fastest is None or r.makespan < fastest[0] - 1e-9:
                fastest = (r.makespan, name)
    assert fastest is not None and out[0]["plan"] == fastest[1]
