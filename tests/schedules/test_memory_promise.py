"""The first steps' plan keeps 1F1B's per-rank peak whatever each stage's bytes turn out to be
(one stage per rank), and a re-plan never gives up a faster plan that keeps the promise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.rules import peak_memory
from zbpipe.planning.yardsticks import onef1b_rank_peaks
from zbpipe.schedules.memory_promise import fastest_keeping, first_step_plan


def _sched(name: str, p: int, m: int, costs: Costs, layout: str = "loop") -> SimpleNamespace:
    return SimpleNamespace(
        safe_first_step=True,
        exact=False,
        layout=layout,
        pp_group_size=p,
        _n_microbatches=m,
        _num_stages=p if layout == "loop" else 2 * p,
        costs=costs,
        _plan_options={},
        build_plan=lambda q, n, c, **o: plan(name, q, n, costs=c, **o),
    )


bytes_st = st.lists(
    st.tuples(st.floats(0.01, 100.0), st.floats(-1.0, 30.0)), min_size=6, max_size=6
)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 12), held=bytes_st)
@pytest.mark.parametrize("name", ["ZBH1", "ZB1P"])
def test_first_step_plan_keeps_each_ranks_1f1b_peak_whatever_the_bytes(name, p, m, held):
    # (ZB-1p and ZB-2p run ZB-H1's order in their first step too: it keeps a stricter promise)
    # The plan is made before any byte is known; the bytes are drawn afterwards: F holds f, B
    # frees part of it (b < 0) or holds up to 30 times more until W (checkpointing).
    times = Costs(f=1.0, b=1.2, w=0.8)
    first = first_step_plan(_sched(name, p, m, times))
    assert first is not None
    f = [held[r][0] for r in range(p)]
    b = [max(held[r][1], -1.0) * f[r] for r in range(p)]
    real = Costs(mem_f=f, mem_b=b, mem_w=[-(x + y) for x, y in zip(f, b)])
    yardstick = onef1b_rank_peaks(p, m, real)
    sc = real.per_stage(p)
    for r, acts in first.order.items():
        assert peak_memory(acts, sc) <= yardstick[r] * (1 + 1e-9) + 1e-9, (r, first)


def test_first_step_plan_costs_little_time():
    # the price of not knowing the bytes, in simulated step time against the plan for equal
    # bytes (unit costs): 1/13 at p = 2, m = 4 (the runs' shape); 3/27 at p = 4, m = 8
    for p, m, most in ((2, 4, 14 / 13), (4, 8, 30 / 27)):
        c = Costs()
        first = first_step_plan(_sched("ZBH1", p, m, c))
        assert first is not None
        ratio = simulate(first, c).makespan / simulate(plan("ZBH1", p, m, costs=c), c).makespan
        assert ratio <= most + 1e-9


def test_no_safe_plan_where_the_schedule_has_none():
    s = _sched("ZBH1", 2, 4, Costs())
    s.safe_first_step = False
    assert first_step_plan(s) is None


def test_a_faster_plan_within_the_budget_replaces_the_remade_one():
    c = Costs()
    slow = plan("1F1B", 4, 8, costs=c)
    fast = plan("ZBH1", 4, 8, costs=c)
    peak = max(simulate(fast, c).peak_memory.values())
    assert fastest_keeping([slow, fast], c, peak)[0] is fast
    # over the budget: the re-made plan stays, however slow
    assert fastest_keeping([slow, fast], c, peak - 0.5)[0] is slow
    # no budget known: the re-made plan stays
    assert fastest_keeping([slow, fast], c, None)[0] is slow
