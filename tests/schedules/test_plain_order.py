"""Never slower than the plain order (issue 47): where a schedule's zero-bubble plan is slower in
simulation than the plain order of its placement for the costs it plans with, and the plain
order keeps the plan's memory budget, the plain order runs and rank 0 says so once at INFO."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.v.plain import plan_v_1f1b

#: a heavy last chunk and W heavy in the middle chunks (tests/schedules/_plain_order_cases.py)
COSTS = Costs(f=[1.0, 1.0, 1.0, 3.0], b=[1.0, 1.0, 1.0, 3.0], w=[0.2, 3.0, 3.0, 0.2])


def _sched(p: int, m: int, layout: str) -> SimpleNamespace:
    chunks = 2 if layout == "v" else 1
    return SimpleNamespace(
        pp_group_size=p, _n_microbatches=m, _num_stages=chunks * p, layout=layout, rank=0,
        _plan_options={},
    )  # fmt: skip


def test_v_plain_order_is_zbvs_fb_order_with_whole_backwards():
    # the reference: the paper's F/B order, each B a fused BW and no W; 1F1B's memory (joined)
    from zbpipe.planning.v.paper_order import zbv_fb_order

    for p, m in ((2, 4), (3, 5), (4, 8)):
        pl = plan_v_1f1b(p, m)
        fb = zbv_fb_order(p, m)
        for r in range(p):
            assert [(a.stage, a.microbatch) for a in pl.order[r]] == [
                (a.stage, a.microbatch) for a in fb[r]
            ]
            assert {a.kind for a in pl.order[r]} == {"F", "BW"}
        joined = Costs().joined(2)
        onef1b_peak = max(simulate(plan("1F1B", p, m, costs=joined), joined).peak_memory.values())
        assert max(simulate(pl, Costs()).peak_memory.values()) <= onef1b_peak


def test_a_slower_zero_bubble_plan_gives_way_to_the_plain_order_once_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from zbpipe.schedules.plain_order import INSTEAD_OF, never_slower

    p, m = 2, 4
    zbv = plan("ZBV", p, m, costs=Costs())  # planned for equal costs, run with COSTS
    plain = plan_v_1f1b(p, m, COSTS)
    assert simulate(plain, COSTS).makespan < simulate(zbv, COSTS).makespan  # the premise
    sched = _sched(p, m, "v")
    caplog.set_level(logging.DEBUG, logger="zbpipe.schedules.plain_order")
    chosen = never_slower(sched, zbv, COSTS)
    again = never_slower(sched, zbv, COSTS)  # a re-plan: the same choice, not said again
    assert chosen.order == plain.order == again.order and chosen.meta[INSTEAD_OF] == "ZBV"
    lines = [r for r in caplog.records if r.name == "zbpipe.schedules.plain_order"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "runs the plain order of its placement (V1F1B) instead of its ZBV plan" in (
        lines[0].getMessage()
    )


def test_a_zero_bubble_plan_made_for_the_costs_stays():
    # the planners' own plans beat the plain order (or tie: then the plan stays)
    for p, m, layout, name, costs in (
        (2, 4, "v", "ZBV", COSTS),
        (2, 4, "loop", "ZBH1", Costs(w=0.0, comm=3.0)),  # W ~ 0, long sends: a tie
        (3, 6, "loop", "ZB1P", Costs(b=2.0, w=0.5, comm=1.0)),
    ):
        from zbpipe.schedules.plain_order import never_slower

        made = plan(name, p, m, costs=costs)
        assert never_slower(_sched(p, m, layout), made, costs) is made


def test_the_plain_order_is_not_run_where_it_breaks_the_budget():
    from zbpipe.schedules.plain_order import never_slower

    p, m = 2, 4
    zbv = plan("ZBV", p, m, costs=Costs(), memory_limit=3.0)  # below the plain order's 4 units
    assert simulate(plan_v_1f1b(p, m, COSTS), COSTS).makespan < simulate(zbv, COSTS).makespan
    assert max(simulate(plan_v_1f1b(p, m), Costs()).peak_memory.values()) > 3.0
    assert never_slower(_sched(p, m, "v"), zbv, COSTS) is zbv


@pytest.mark.dist
def test_the_plain_order_runs_with_the_reference_gradients_and_says_so_once():
    from tests.schedules import _plain_order_cases as cases
    from zbpipe.testing import run_ranks

    got = run_ranks(cases.plain_order_runs_with_reference_grads, 2, 4, timeout=180)
    assert [name for name, _ in got] == ["V1F1B", "V1F1B"]
    assert [said for _, said in got] == [1, 0]  # rank 0 only, once
