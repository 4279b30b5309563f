"""ZBInterleaved by name (issue 47): torch's and torchtitan's lookups find it, torchtitan builds
loop-placed stages for it (2 per rank by default, more from its layer option), its split is
chosen for its plan, and its plain order is torch's Interleaved1F1B action for action."""

from __future__ import annotations

import pytest
import torchtitan.distributed.pipeline_parallel as tt_pp

import zbpipe.torchtitan as zt
from tests.integrations import _torchtitan_cases as tiny
from zbpipe import ScheduleZBInterleaved
from zbpipe.integrations.names import SCHEDULE_CLASSES, original_get_schedule_class
from zbpipe.integrations.torch_plans import torch_plan
from zbpipe.planning.loop.interleaved import plan_interleaved_1f1b
from zbpipe.planning.registry import TORCH_SCHEDULES


@pytest.fixture(autouse=True)
def installed():
    zt.install()


def test_the_name_is_zbpipes_and_shadows_no_torch_name():
    assert SCHEDULE_CLASSES["ZBInterleaved"] is ScheduleZBInterleaved
    assert tt_pp.get_schedule_class("ZBInterleaved") is ScheduleZBInterleaved
    assert "ZBInterleaved" not in TORCH_SCHEDULES
    with pytest.raises(ValueError):
        original_get_schedule_class()("ZBInterleaved")
    # torch's own interleaved name still gives torch's class
    assert tt_pp.get_schedule_class("Interleaved1F1B") is not ScheduleZBInterleaved


def test_torchtitan_builds_loop_placed_stages():
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    got = [tt_pp._get_pp_rank_to_stage_indices_mapping(r, 2, "ZBInterleaved", 4) for r in (0, 1)]
    assert got == [(0, 2), (1, 3)]
    got = [tt_pp._get_pp_rank_to_stage_indices_mapping(r, 2, "ZBInterleaved", 6) for r in (0, 1)]
    assert got == [(0, 2, 4), (1, 3, 5)]
    with pytest.raises(ValueError, match="stage"):
        tt_pp._get_pp_rank_to_stage_indices_mapping(0, 2, "ZBInterleaved", 2)
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="ZBInterleaved",
        data_parallel_shard_degree=1,
    )
    dims = ParallelDims.from_config(parallelism, 2)
    assert tt_pp._get_pipeline_metadata(dims, parallelism, tiny.tiny_llama3_config())[0] == 4


def test_the_split_is_chosen_for_its_plan(monkeypatch):
    from torchtitan.config import ParallelismConfig, TrainingConfig

    from zbpipe.integrations import torchtitan_split as ts

    monkeypatch.delenv(ts.ENV, raising=False)
    assert ts.plan_name_of(ScheduleZBInterleaved) == "ZBInterleaved"
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="ZBInterleaved",
        pipeline_parallel_microbatch_size=1,
        data_parallel_shard_degree=1,
    )
    training = TrainingConfig(local_batch_size=4, seq_len=tiny.SEQ)
    default = tt_pp._generate_llm_fqn_per_model_part(4, tiny.N_LAYERS, 1, 1)
    split = ts.schedule_split(
        ScheduleZBInterleaved,
        model=tiny.build_model(0),
        model_config=tiny.tiny_llama3_config(),
        parallelism=parallelism,
        training=training,
        num_ranks=2,
        num_stages=4,
        default_parts=default,
    )
    assert split is not None and len(split.parts) == 4
    assert [n for part in split.parts for n in part] == [n for part in default for n in part]
    assert split.makespan <= split.baseline_makespan + 1e-9  # never worse than the default


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 3)])
def test_interleaved_1f1b_is_torchs_order(p, v):
    for m in sorted({1, p - 1, p, p + 1, 2 * p, 10}):
        try:
            theirs = torch_plan("Interleaved1F1B", p, m, stages_per_rank=v)
        except ValueError:
            with pytest.raises(ValueError):
                plan_interleaved_1f1b(p, m, stages_per_rank=v)
            continue
        mine = plan_interleaved_1f1b(p, m, stages_per_rank=v)
        assert mine.order == theirs.order and mine.placement == theirs.placement
