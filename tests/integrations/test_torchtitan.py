"""zbpipe.torchtitan: torchtitan 0.3.x's own pipeline code places, counts, builds zbpipe schedules.

Needs torchtitan 0.3.0 and the few packages its pipeline and llama3 code import
(recipes/torchtitan/requirements-ci.txt, which CI installs). Not skipped when they are missing:
a broken integration must fail. torchtitan's Trainer runs are in test_torchtitan_trainer.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torchtitan.distributed.pipeline_parallel as tt_pp

import zbpipe.torchtitan as zt
from tests.integrations import _torchtitan_cases as cases
from zbpipe.schedules import ScheduleZBH1
from zbpipe.testing import run_ranks

V_NAME = "ZBV"


@pytest.fixture(autouse=True)
def installed():
    # Other test files call zbpipe.integrations.names.unregister(); install() is idempotent and
    # re-registers.
    zt.install()


@pytest.mark.parametrize("p", [2, 4])
def test_v_schedule_gets_v_placement_from_torchtitan(p):
    got = [tt_pp._get_pp_rank_to_stage_indices_mapping(r, p, V_NAME, 2 * p) for r in range(p)]
    # Hand-worked V: rank r holds stage r on the way down and stage 2p-1-r on the way back.
    assert got == [(r, 2 * p - 1 - r) for r in range(p)]
    assert got[0] == (0, 2 * p - 1)


def test_zbh1_gets_one_stage_per_rank_from_torchtitan():
    assert [tt_pp._get_pp_rank_to_stage_indices_mapping(r, 4, "ZBH1", 4) for r in range(4)] == [
        (0,),
        (1,),
        (2,),
        (3,),
    ]
    dims, parallelism = _dims(pp=4, schedule="ZBH1")
    num_stages, num_layers, *_ = tt_pp._get_pipeline_metadata(
        dims, parallelism, cases.tiny_llama3_config()
    )
    assert (num_stages, num_layers) == (4, cases.N_LAYERS)
    # The same call for a torch Multi schedule keeps torchtitan's default of two per rank.
    dims, parallelism = _dims(pp=4, schedule="Interleaved1F1B")
    assert tt_pp._get_pipeline_metadata(dims, parallelism, cases.tiny_llama3_config())[0] == 8


def test_wrong_stage_count_for_zbpipe_schedule_names_the_fix():
    with pytest.raises(ValueError, match="module_fqns_per_model_part"):
        tt_pp._get_pp_rank_to_stage_indices_mapping(0, 4, "ZBH1", 8)


def test_torch_schedules_keep_torchtitan_placement():
    assert tt_pp._get_pp_rank_to_stage_indices_mapping(1, 2, "Interleaved1F1B", 4) == (1, 3)
    assert tt_pp._get_pp_rank_to_stage_indices_mapping(1, 2, "ZBVZeroBubble", 4) == (1, 2)


def test_schedule_builder_returns_zbpipe_class():
    assert tt_pp.get_schedule_class("ZBH1") is ScheduleZBH1  # the name torchtitan's builder calls


def test_loss_is_logged_from_the_rank_holding_the_last_stage():
    from torchtitan.components import metrics

    dims, _ = _dims(pp=4, schedule="ZBH1")
    assert metrics._get_metrics_rank(parallel_dims=dims, pp_schedule="ZBH1") == 3
    assert (
        metrics._get_metrics_rank(parallel_dims=dims, pp_schedule=V_NAME) == 0
    )  # V: last stage on rank 0
    assert (
        metrics._get_metrics_rank(parallel_dims=dims, pp_schedule="1F1B") == 3
    )  # torch's: unchanged


def test_uninstall_gives_torchtitan_its_functions_back():
    from torchtitan.components import metrics

    wrapped = {
        f: getattr(tt_pp, f)
        for f in ("_get_pipeline_metadata", "_get_pp_rank_to_stage_indices_mapping")
    }
    wrapped["_get_metrics_rank"] = metrics._get_metrics_rank
    try:
        zt.uninstall()
        for name, wrapper in wrapped.items():
            module = metrics if name == "_get_metrics_rank" else tt_pp
            assert getattr(module, name) is wrapper.__wrapped__, name
        with pytest.raises(ValueError):
            tt_pp.get_schedule_class("ZBH1")  # torch's own lookup again
        assert tt_pp._get_pp_rank_to_stage_indices_mapping(0, 2, "Interleaved1F1B", 4) == (0, 2)
    finally:
        zt.install()
    assert tt_pp._get_pp_rank_to_stage_indices_mapping(0, 2, V_NAME, 4) == (0, 3)


PLAN_NAMES_TORCH_OWNS = {"1F1B"}  # torch's name wins: zbpipe never shadows torch's schedules
PLAN_NAMES_NOT_TORCH_SHAPED = {"Continuous"}  # owns the optimizer step (recipes/torchtitan/README)


@pytest.mark.parametrize(
    "name", sorted(__import__("zbpipe.planning.registry", fromlist=["x"]).GENERATORS)
)
def test_every_plan_name_is_a_torchtitan_schedule_that_runs_that_plan(name, monkeypatch):
    from zbpipe import Costs
    from zbpipe.schedules.runtime import PlannedSchedule

    if name in PLAN_NAMES_TORCH_OWNS:
        assert not issubclass(tt_pp.get_schedule_class(name), PlannedSchedule)
        return
    if name in PLAN_NAMES_NOT_TORCH_SHAPED:
        with pytest.raises(ValueError):
            tt_pp.get_schedule_class(name)
        return
    cls = tt_pp.get_schedule_class(name)  # what torchtitan's builder calls
    assert issubclass(cls, PlannedSchedule)

    # torchtitan constructs cls(stages, n_microbatches=..., loss_fn=..., scale_grads=...) with no
    # options: construct it that way, minus torch's stage setup (no stages, and so no
    # communication points for an overlapping schedule to install), and ask for its plan.
    def no_stage_setup(self, *args, **kwargs):
        self._stages = []
        self.rank, self.plan = 1, None  # no rank-0 report (DualPipeV's reads the plan and costs)
        self._pairs = SimpleNamespace(enable=lambda points, **options: None)

    monkeypatch.setattr(PlannedSchedule, "__init__", no_stage_setup)
    sched = cls([], n_microbatches=8, loss_fn=None, scale_grads=False)
    assert sched.build_plan(4, 8, Costs()).name == name


def _dims(pp, schedule):
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=schedule,
        data_parallel_shard_degree=1,
    )
    return ParallelDims.from_config(parallelism, pp), parallelism


@pytest.mark.dist
def test_torchtitan_pipeline_grads_match_1f1b_and_unpipelined():
    """2 ranks, torchtitan's pipeline_llm on a tiny llama3, one step of each schedule, same seed.

    fp32, the same ops per microbatch; only the order in which microbatch gradients are summed
    (and B/W split) differs, so grads agree to a few ulps of the largest gradient: measured max
    abs difference 5e-7 on gradients of order 1-10 (losses are summed, scale_grads=False).
    """
    schedules = ["1F1B", "ZBH1", V_NAME]
    per_rank = run_ranks(cases.compare_schedules, 2, schedules, 4, 0, timeout=120)
    ref_grads, ref_loss = per_rank[0]["reference"]
    placement = {name: [per_rank[r][name][1] for r in range(2)] for name in schedules}
    assert placement == {"1F1B": [[0], [1]], "ZBH1": [[0], [1]], V_NAME: [[0, 3], [1, 2]]}
    assert per_rank[0]["ZBH1"][0] == "ScheduleZBH1"
    grads = {name: {**per_rank[0][name][2], **per_rank[1][name][2]} for name in schedules}
    assert set(grads["ZBH1"]) == set(ref_grads)
    for name in ("ZBH1", V_NAME):
        for fqn, ref in ref_grads.items():
            np.testing.assert_allclose(
                grads[name][fqn], grads["1F1B"][fqn], rtol=1e-5, atol=1e-5, err_msg=f"{name} {fqn}"
            )
            np.testing.assert_allclose(
                grads[name][fqn], ref, rtol=1e-5, atol=1e-5, err_msg=f"{name} {fqn}"
            )
    # The loss comes back on the rank holding the last stage: rank 1 in a loop, rank 0 in a V.
    assert per_rank[1]["ZBH1"][3] == pytest.approx(ref_loss, rel=1e-6)
    assert (
        per_rank[0][V_NAME][3] == pytest.approx(ref_loss, rel=1e-6)
        and per_rank[1][V_NAME][3] is None
    )
