"""1F1B: the baseline's closed forms (unit costs, comm 0)."""

import pytest

from zbpipe.planning import Action, Costs, plan_1f1b, simulate

GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (p, p + 1, 2 * p, 3 * p + 1)]


@pytest.mark.parametrize("p,m", GRID)
def test_bubble_rate_is_paper_closed_form(p, m):
    # The paper (Section 2): 1F1B's bubble rate is (p - 1) / (m + p - 1) when F = B = W.
    res = simulate(plan_1f1b(p, m), Costs())
    assert res.bubble_rate == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", GRID)
def test_makespan_is_m_plus_p_minus_1_rounds(p, m):
    # Every rank does m rounds of F + BW (3 units); the fill and drain add p - 1 rounds.
    assert simulate(plan_1f1b(p, m)).makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("p,m", GRID + [(4, 1), (4, 2), (8, 3)])
def test_peak_memory_is_microbatches_in_flight(p, m):
    # Rank r holds its p - 1 - r warm-up forwards plus one more before its first backward.
    res = simulate(plan_1f1b(p, m))
    assert res.peak_memory == {r: float(min(p - r, m)) for r in range(p)}


def test_rank_order_hand_written():
    pl = plan_1f1b(3, 4)
    F, BW = (lambda m, s: Action(s, "F", m)), (lambda m, s: Action(s, "BW", m))
    assert pl.order[0] == (
        F(0, 0),
        F(1, 0),
        F(2, 0),
        BW(0, 0),
        F(3, 0),
        BW(1, 0),
        BW(2, 0),
        BW(3, 0),
    )
    assert pl.order[2] == (
        F(0, 2),
        BW(0, 2),
        F(1, 2),
        BW(1, 2),
        F(2, 2),
        BW(2, 2),
        F(3, 2),
        BW(3, 2),
    )


@pytest.mark.parametrize("p,m", [(4, 1), (4, 3), (8, 2)])
def test_fewer_microbatches_than_ranks_is_valid(p, m):
    # m < p: all forwards then all backwards (GPipe), still one pass per stage and microbatch.
    res = simulate(plan_1f1b(p, m))
    assert sum(len(v) for v in res.timeline.values()) == 2 * p * m


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="n_microbatches"):
        plan_1f1b(4, 0)
    with pytest.raises(ValueError, match="num_ranks"):
        plan_1f1b(0, 4)
