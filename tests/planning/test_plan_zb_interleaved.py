"""ZB-Interleaved (several loop stages per rank, split backward) against interleaved 1F1B and
closed forms: complete, dependency-correct, deadlock-free (the simulator raises otherwise),
within interleaved 1F1B's memory, never slower than it (planning layer only, no torch)."""

from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.loop.interleaved import plan_interleaved_1f1b
from zbpipe.planning.yardsticks import promised_peak
from zbpipe.schedules.plain_order import plain_plan


def round_of(p, m):
    """Microbatches per round, as torch's Interleaved1F1B counts them (written out here)."""
    return m // max(1, m // p)


def interleaved_in_flight(p, m, v, r):
    """Microbatch-chunks interleaved 1F1B's rank r holds at its peak: its warm-up forwards
    ((v - 1) rounds and two per rank below it) and the first steady-state forward, at most all
    m v."""
    return min((v - 1) * round_of(p, m) + 2 * (p - 1 - r) + 1, m * v)


@st.composite
def cases(draw):
    p = draw(st.integers(2, 4))
    v = draw(st.integers(2, 3))
    # multiples of p, and the counts torch's "flexible" rounds also take (m < p; m = 10, p = 4)
    m = draw(st.sampled_from(sorted({p, 2 * p, 3 * p, max(1, p - 1), 10 if p == 4 else p})))
    n = p * v
    times = st.floats(0.1, 2.0)
    mem = draw(st.lists(st.floats(0.2, 3.0), min_size=n, max_size=n))
    costs = Costs(
        f=draw(st.lists(times, min_size=n, max_size=n)),
        b=draw(st.lists(times, min_size=n, max_size=n)),
        w=draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n)),
        comm=draw(st.floats(0.0, 0.3)),
        mem_f=mem,
        mem_b=0.0,
        mem_w=[-x for x in mem],
    )
    return p, v, m, costs


@settings(max_examples=40, deadline=None)
@given(cases())
@example((2, 2, 2, Costs()))
@example((4, 3, 12, Costs(f=1, b=2, w=0.1, comm=0.3)))
@example((3, 2, 2, Costs(f=[1, 1, 1, 1, 1, 3], b=[1, 1, 1, 1, 1, 3], w=[0.5] * 6)))
def test_complete_correct_within_memory_and_never_slower(case):
    p, v, m, costs = case
    # stages per rank: what per-stage costs describe, else given
    zb = plan(
        "ZBInterleaved", p, m, costs=costs, **({} if costs.num_stages else {"stages_per_rank": v})
    )
    assert zb.num_stages == p * v and zb.layout == "loop"
    assert all(zb.placement[s] == s % p for s in range(p * v))
    # complete and F < B < W per stage (validate), dependencies and deadlock (simulate raises)
    zb.validate()
    assert zb.uses_split_backward()
    mine = simulate(zb, costs)
    plain = simulate(plan_interleaved_1f1b(p, m, costs, v), costs)
    assert mine.makespan <= plain.makespan + 1e-9
    # memory: no rank above the busiest rank of interleaved 1F1B (fused backwards free at once)
    assert max(mine.peak_memory.values()) <= max(plain.peak_memory.values()) + 1e-9
    # and what the schedule promises is that number
    assert promised_peak("ZBInterleaved", p, m, costs, v) == pytest.approx(
        max(plain.peak_memory.values())
    )


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (3, 3, 3), (4, 2, 10), (4, 3, 2)])
def test_equal_memory_peak_is_interleaved_1f1b_count(p, v, m):
    # per rank, interleaved 1F1B holds its warm-up plus one; the plan's busiest rank holds no
    # more than interleaved 1F1B's busiest rank
    plain = simulate(plan_interleaved_1f1b(p, m, stages_per_rank=v))
    want = {r: interleaved_in_flight(p, m, v, r) for r in range(p)}
    assert plain.peak_memory == pytest.approx(want)
    zb = simulate(plan("ZBInterleaved", p, m, stages_per_rank=v))
    assert max(zb.peak_memory.values()) <= max(want.values())


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 3, 4)])
def test_unit_costs_closed_form(p, v, m):
    # Hand-worked, F = B = W = 1 per stage, comm 0. Interleaved 1F1B: every rank is busy m v
    # (F + B + W) and the pipeline fills and drains over p - 1 chunk passes of F + B + W
    # (Narayanan et al.'s bubble (p - 1) / (v m)): (m v + p - 1) 3. ZB-Interleaved: the last
    # rank's first F cannot start before the p - 1 forwards of stage 0..p-2, and it then has
    # m v (F + B + W) of work: (p - 1) + 3 m v is a lower bound, and the plan reaches it
    # (the W passes fill the drain; the ZB-H1 form m v (F + B + W) + (p - 1)(F + B - W)).
    zb = simulate(plan("ZBInterleaved", p, m, stages_per_rank=v))
    plain = simulate(plan_interleaved_1f1b(p, m, stages_per_rank=v))
    assert plain.makespan == pytest.approx(3 * (m * v + p - 1))
    assert zb.makespan == pytest.approx(3 * m * v + (p - 1))
    # the last rank works without a gap from its first F to its last W
    last = zb.timeline[p - 1]
    assert last[-1].end - last[0].start == pytest.approx(3 * m * v)


def test_p2_v2_m2_by_hand():
    # 2 ranks, stages 0 and 2 on rank 0, 1 and 3 on rank 1, two microbatches, unit costs.
    # Rank 1 starts at t = 1 (after 0F0) and then never idles: 3 x 2 x 2 = 12 units of work, so
    # it ends at 13; rank 0's last action, W of stage 0, needs 0B1, which needs 1B1 (rank 1).
    zb = simulate(plan("ZBInterleaved", 2, 2, stages_per_rank=2))
    assert zb.makespan == pytest.approx(13.0)
    assert simulate(plan_interleaved_1f1b(2, 2, stages_per_rank=2)).makespan == pytest.approx(15)


def test_microbatch_counts_and_options_refused_with_what_to_use():
    with pytest.raises(ValueError, match=r"rounds .* = 2, got 9 .* use 8 or 10"):
        plan("ZBInterleaved", 4, 9)
    with pytest.raises(ValueError, match="stages_per_rank must be >= 2"):
        plan("ZBInterleaved", 2, 4, stages_per_rank=1)
    with pytest.raises(ValueError, match="not a multiple of num_ranks"):
        plan("ZBInterleaved", 2, 4, costs=Costs(f=[1, 1, 1]))
    with pytest.raises(ValueError, match="below interleaved 1F1B's peak 5"):
        plan("ZBInterleaved", 2, 4, memory_limit=4.0)


def test_plain_order_of_several_loop_stages_is_interleaved_1f1b():
    sched = SimpleNamespace(pp_group_size=2, _n_microbatches=4, _num_stages=6, layout="loop")
    got = plain_plan(sched, Costs())
    assert got is not None and got.order == plan_interleaved_1f1b(2, 4, stages_per_rank=3).order
    sched._n_microbatches = 3  # 3 on 2 ranks: one round of 3, taken
    assert plain_plan(sched, Costs()) is not None
    sched._n_microbatches = 5  # two rounds do not divide 5: no plain order, nothing to compare
    assert plain_plan(sched, Costs()) is None
