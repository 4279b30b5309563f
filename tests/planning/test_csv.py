"""torch's schedule CSV format, read and written without torch."""

import pytest

from zbpipe.planning import (
    Action,
    PlanError,
    plan,
    plan_1f1b,
    plan_from_csv,
    plan_to_csv,
    plan_zbh1,
)


def test_write_uses_torch_letters():
    text = plan_to_csv(plan_zbh1(2, 1, exact=True))
    # B (input grad) is torch's I; BW (full backward) is torch's B.
    assert text.splitlines() == ["0F0,0I0,0W0", "1F0,1I0,1W0"]


def test_fused_backward_written_as_torch_b():
    assert plan_to_csv(plan_1f1b(1, 2)).strip() == "0F0,0B0,0F1,0B1"


def test_read_torch_padding_and_comms():
    # Empty cells are torch's None padding; REDUCE_GRAD and UNSHARD are not compute.
    text = "0F0,,0UNSHARD,1F0,1B0,0F1,1F1,1B1,0I0,0W0,0I1,0W1,0REDUCE_GRAD\n"
    pl = plan_from_csv(text, name="hand")
    assert pl.placement == {0: 0, 1: 0}
    assert pl.n_microbatches == 2
    assert [str(a) for a in pl.order[0]] == [
        "0F0",
        "1F0",
        "1BW0",
        "0F1",
        "1F1",
        "1BW1",
        "0B0",
        "0W0",
        "0B1",
        "0W1",
    ]


def test_read_overlap_pairs():
    text = "0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n"
    pl = plan_from_csv(text)
    assert [str(a) for a in pl.order[0]] == ["0F0", "0F1", "0F2", "0BW0", "0BW1", "0BW2"]


def test_infers_v_placement():
    text = "0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n"
    pl = plan_from_csv(text)
    assert pl.layout == "v" and pl.placement == {0: 0, 1: 1, 2: 1, 3: 0}


@pytest.mark.parametrize("name", ["1F1B", "ZBH1"])
@pytest.mark.parametrize("p,m", [(1, 1), (3, 2), (4, 9)])
def test_round_trip(name, p, m):
    pl = plan(name, p, m)
    back = plan_from_csv(plan_to_csv(pl), name=pl.name, n_microbatches=m)
    assert back.order == pl.order and back.placement == pl.placement


def test_explicit_n_microbatches_checks_completeness():
    with pytest.raises(PlanError, match="microbatch 1"):
        plan_from_csv("0F0,0B0\n", n_microbatches=2)


@pytest.mark.parametrize("bad", ["0X0", "F0", "0F", "(0F0;0B0)FOO"])
def test_bad_cells_raise(bad):
    with pytest.raises(PlanError, match="row 0"):
        plan_from_csv(bad + "\n")


def test_stage_on_two_ranks_raises():
    with pytest.raises(PlanError, match="stage 0 appears on rank 0 and on rank 1"):
        plan_from_csv("0F0\n0B0\n")


def test_action_strings_match():
    assert str(Action(2, "BW", 3)) == "2BW3"  # ours; torch's is 2B3 in the CSV
    assert plan_to_csv(plan_1f1b(1, 1)).strip() == "0F0,0B0"


def test_an_overlap_cell_of_two_stages_is_read_as_a_pair():
    # one rank holding the V's two stages (p = 1); torch's letters: I is B, B is BW
    text = "0F0,1F0,(0F1;1I0)OVERLAP_F_B,1W0,1F1,0I0,1I1,0W0,1W1,0I1,0W1\n"
    pl = plan_from_csv(text)
    assert pl.pairs == {(Action(0, "F", 1), Action(1, "B", 0))}
    assert plan_from_csv("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n").pairs == frozenset()
