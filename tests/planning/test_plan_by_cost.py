"""Microbatches of different costs (zbpipe.planning.by_cost): the simulator's per-microbatch
factors, and the order of a step's microbatches over a plan's slots, judged by the simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.planning._strategies import costs_st
from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.by_cost import order_by_cost, relabel, token_scales


def test_token_scales_linear_and_quadratic_against_the_formula():
    # n + n^2 / q over the mean: lengths 100 and 300, q = 200 -> 150 and 750, mean 450
    assert token_scales([100, 300], quadratic_at=200) == pytest.approx((150 / 450, 750 / 450))
    assert token_scales([1, 3]) == pytest.approx((0.5, 1.5))
    with pytest.raises(ValueError, match="integers >= 1"):
        token_scales([0, 3])
    with pytest.raises(ValueError, match="quadratic_at"):
        token_scales([1, 3], quadratic_at=0)


def test_zbh1_two_ranks_long_then_short_hand_worked():
    """p = 2, m = 2, ZB-H1 (rank 0: F0 F1 B0 W0 B1 W1; rank 1: F0 B0 F1 B1 W0 W1), F = B = W = 1
    for the mean microbatch, no comm; a short microbatch (factor s) and a long one (g >= 2s).

    Short first: rank 1's B1 ends at s + 3g (its F1 waits for rank 0's F1, done at s + g);
    rank 0's B1 starts then and its W1 ends at s + 5g; rank 1's W1 at 2s + 4g. Makespan s + 5g.
    Long first: rank 1's F0 ends at 2g, B0 at 3g; rank 0's B0 runs 3g..4g, W0 to 5g; rank 1's
    B1 ends at 3g + 2s, so rank 0's B1 starts at 5g; W1 ends at 5g + 2s. Makespan 5g + 2s.
    """
    pl = plan("ZBH1", num_ranks=2, n_microbatches=2, costs=Costs())
    assert [str(a) for a in pl.order[0]] == ["0F0", "0F1", "0B0", "0W0", "0B1", "0W1"]
    assert [str(a) for a in pl.order[1]] == ["1F0", "1B0", "1F1", "1B1", "1W0", "1W1"]
    scales = token_scales([3, 1])  # data order: the long one first
    g, s = scales
    assert simulate(pl, Costs(), microbatch_scale=[g, s]).makespan == pytest.approx(5 * g + 2 * s)
    assert simulate(pl, Costs(), microbatch_scale=[s, g]).makespan == pytest.approx(s + 5 * g)
    got = order_by_cost(pl, Costs(), scales)
    assert got.slots == (1, 0)  # the short one goes first
    assert got.makespan == pytest.approx(s + 5 * g)
    assert got.data_order_makespan == pytest.approx(5 * g + 2 * s)
    run = relabel(pl, got.slots)
    assert [str(a) for a in run.order[0]][:2] == ["0F1", "0F0"]
    assert simulate(run, Costs(), microbatch_scale=scales).makespan == pytest.approx(s + 5 * g)


def test_equal_costs_keep_data_order():
    pl = plan("ZBV", num_ranks=2, n_microbatches=6, costs=Costs())
    got = order_by_cost(pl, Costs(), token_scales([64] * 6))
    assert got.is_data_order and got.makespan == got.data_order_makespan


def test_bad_scales_are_refused():
    pl = plan("ZBH1", num_ranks=2, n_microbatches=2, costs=Costs())
    with pytest.raises(ValueError, match="2 microbatches"):
        simulate(pl, Costs(), microbatch_scale=[1.0])
    with pytest.raises(ValueError, match="> 0"):
        simulate(pl, Costs(), microbatch_scale=[1.0, 0.0])
    with pytest.raises(ValueError, match="one per microbatch"):
        order_by_cost(pl, Costs(), [1.0, 2.0, 3.0])


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["1F1B", "ZBH1", "ZB1P", "ZBV", "ZBVHalf"]),
    p=st.integers(2, 4),
    lengths=st.lists(st.integers(1, 4096), min_size=2, max_size=8),
    quadratic=st.sampled_from([None, 1536.0]),
    costs=costs_st,
)
def test_cost_order_is_a_valid_plan_never_slower_than_data_order(
    name, p, lengths, quadratic, costs
):
    m = len(lengths)
    pl = plan(name, num_ranks=p, n_microbatches=m, costs=costs)
    scales = token_scales(lengths, quadratic_at=quadratic)
    got = order_by_cost(pl, costs, scales)
    data = simulate(pl, costs, microbatch_scale=scales).makespan  # slot k runs microbatch k
    assert got.data_order_makespan == pytest.approx(data)
    assert got.makespan <= data + 1e-9 * data
    assert sorted(got.slots) == list(range(m))
    # the relabelled plan is complete and dependency-correct (simulate validates and raises)
    # and, simulated in the step's own numbering, takes what order_by_cost said
    run = relabel(pl, got.slots)
    assert simulate(run, costs, microbatch_scale=scales).makespan == pytest.approx(got.makespan)
