"""torch's built-in schedules, as torch itself orders them, in zbpipe's simulator."""

import csv
import io

import pytest
import torch.distributed.pipelining as pipelining

from zbpipe import plan  # torch: names are built above the plan layer
from zbpipe._compat import _Action
from zbpipe.integrations.torch_plans import torch_plan
from zbpipe.planning import Costs, plan_1f1b, plan_from_csv, plan_to_csv, simulate
from zbpipe.planning.registry import TORCH_SCHEDULES


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)])
def test_zbv_zero_bubble_with_equal_costs(p, m):
    # The ZB-V paper's claim: torch's ZBVZeroBubble has no bubble when F = B = W and m >= 2p.
    pl = plan("torch:ZBVZeroBubble", p, m)
    assert pl.layout == "v" and pl.num_stages == 2 * p
    assert simulate(pl, Costs()).bubble_rate == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 9), (8, 24)])
def test_torch_1f1b_is_textbook_1f1b(p, m):
    ours = plan_1f1b(p, m)
    theirs = plan("torch:1F1B", p, m)
    assert theirs.order == ours.order
    assert simulate(theirs).makespan == simulate(ours).makespan == 3 * (m + p - 1)


def test_torch_1f1b_pipeline_order_is_wrong_on_last_rank():
    # Why torch:1F1B is ported from _step_microbatches: _get_pipeline_order() gives the last
    # rank forwards 1..m (never 0) while the other ranks agree with what runs.
    p, m = 4, 6
    sched = pipelining.Schedule1F1B.__new__(pipelining.Schedule1F1B)
    sched._num_stages, sched._n_microbatches = p, m
    reported = sched._get_pipeline_order()
    ran = plan("torch:1F1B", p, m).order
    for r in range(p):
        compute = [a for a in reported[r] if a is not None and a.microbatch_index is not None]
        as_str = [str(a) for a in compute]
        expected = [str(a).replace("BW", "B") for a in ran[r]]
        if r < p - 1:
            assert as_str == expected
        else:
            assert as_str != expected and f"{r}F{m}" in as_str


@pytest.mark.parametrize("name", TORCH_SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 12)])
def test_every_torch_plan_simulates_and_round_trips(name, p, m):
    pl = plan(f"torch:{name}", p, m)
    k = pl.num_stages // p
    res = simulate(pl, Costs().split(k))
    assert sum(len(ivs) for ivs in res.timeline.values()) == sum(len(a) for a in pl.order.values())
    back = plan_from_csv(plan_to_csv(pl), name=pl.name, n_microbatches=m)
    assert back.order == pl.order and back.placement == pl.placement and back.layout == pl.layout


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"])
def test_read_csv_torch_wrote(name, tmp_path):
    # Let torch's own _dump_csv write its order (with None padding and, for DualPipeV,
    # OVERLAP_F_B pairs), then read it back.
    p, m = 2, 4
    cls = getattr(pipelining, f"Schedule{name}")
    sched = cls.__new__(cls)
    sched.pp_group_size, sched._n_microbatches, sched.n_local_stages = p, m, 2
    sched.num_stages = sched._num_stages = 2 * p
    sched.number_of_rounds, sched.microbatches_per_round = max(1, m // p), m // max(1, m // p)
    sched.pipeline_order = {r: sched._calculate_single_rank_operations(r) for r in range(p)}
    path = tmp_path / "sched.csv"
    sched._dump_csv(str(path), format="compute_only")
    text = path.read_text()
    cells = [c for row in csv.reader(io.StringIO(text)) for c in row]
    assert ("" in cells) == (name != "DualPipeV")  # torch's None padding (DualPipeV has none)
    assert any("OVERLAP_F_B" in c for c in cells) == (name == "DualPipeV")
    got = plan_from_csv(text, name=f"torch:{name}")
    assert got.order == torch_plan(name, p, m).order


def test_torch_parses_our_csv():
    pl = plan("ZBH1", 3, 5)
    rows = list(csv.reader(io.StringIO(plan_to_csv(pl))))
    for r, row in enumerate(rows):
        parsed = [_Action.from_str(cell) for cell in row]
        assert [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in parsed] == [
            (a.stage, {"F": "F", "B": "I", "W": "W", "BW": "B"}[a.kind], a.microbatch)
            for a in pl.order[r]
        ]


def test_sizes_torch_refuses_raise_value_error():
    with pytest.raises(ValueError, match="n_microbatches >= num_ranks"):
        plan("torch:1F1B", 4, 3)
    with pytest.raises(ValueError, match="2 \\* num_ranks"):
        plan("torch:DualPipeV", 4, 6)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        plan("torch:Interleaved1F1B", 4, 10 + 1)


def test_stages_per_rank_option():
    pl = plan("torch:Interleaved1F1B", 2, 4, stages_per_rank=3)
    assert pl.num_stages == 6 and pl.placement[5] == 1


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="torch:ZBVZeroBubble"):
        plan("torch:Nope", 2, 4)
    with pytest.raises(ValueError, match="ZBH1"):
        plan("nope", 2, 4)
    assert plan("zbh1", 2, 4).name == plan("ZBH1", 2, 4).name
