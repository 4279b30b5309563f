"""zbpipe.torchtitan applies a split made for a zbpipe schedule (issue 47): torchtitan's own
``pipeline_llm`` builds the stages from it, a user's explicit split is kept,
``ZBPIPE_SPLIT=default`` keeps torchtitan's, and the gradients equal the unpipelined model's.

torchtitan's Trainer needs torch 2.14 (not this venv's): the tests drive its pipeline functions,
as test_torchtitan.py does.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torchtitan.distributed.pipeline_parallel as tt_pp

import zbpipe.torchtitan as zt
from tests.integrations import _torchtitan_cases as tiny
from tests.integrations import _torchtitan_split_cases as cases
from zbpipe.integrations import torchtitan_split as ts
from zbpipe.integrations.names import lookup_zbpipe
from zbpipe.planning.split import even_sizes
from zbpipe.testing import run_ranks


@pytest.fixture(autouse=True)
def installed():
    zt.install()


def _dims(pp, schedule, **options):
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=1,
        data_parallel_shard_degree=1,
        **options,
    )
    training = TrainingConfig(local_batch_size=4, seq_len=tiny.SEQ)
    return ParallelDims.from_config(parallelism, pp), parallelism, training


def _split(schedule, **options):
    dims, parallelism, training = _dims(2, schedule, **options)
    return zt._split_for(
        lookup_zbpipe(schedule),
        tiny.build_model(0),
        parallel_dims=dims,
        parallelism=parallelism,
        training=training,
        model_config=tiny.tiny_llama3_config(),
    )


@pytest.mark.parametrize("stages,layers", [(2, 4), (4, 4), (4, 7), (8, 30)])
def test_the_planners_default_is_torchtitans_own_rule(stages, layers):
    parts = tt_pp._generate_llm_fqn_per_model_part(stages, layers, 1, 1)
    pieces = [len([n for n in part if n != "norm"]) for part in parts]
    assert pieces == list(even_sizes(layers + 2, stages))


def test_zbv_gets_its_split_logged_once_with_the_predicted_gain(caplog, monkeypatch):
    monkeypatch.delenv(ts.ENV, raising=False)
    default = tt_pp._generate_llm_fqn_per_model_part(4, tiny.N_LAYERS, 1, 1)
    with caplog.at_level(logging.INFO, logger="zbpipe"):
        parts = _split("ZBV")
    assert parts is not None and parts != default
    assert [n for part in parts for n in part] == [n for part in default for n in part]
    lines = [r for r in caplog.records if "splits the model" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "torchtitan's default [2, 2, 1, 1]" in lines[0].getMessage()
    assert "ZBPIPE_SPLIT=default" in lines[0].getMessage()


def test_a_users_split_or_the_switch_keeps_torchtitans(monkeypatch):
    monkeypatch.delenv(ts.ENV, raising=False)
    assert _split("ZBV", module_fqns_per_model_part=cases.EXPLICIT) is None
    assert _split("ZBV", pipeline_parallel_layers_per_stage=2) is None
    assert _split("ZBV", pipeline_parallel_first_stage_less_layers=0) is None
    assert _split("AutoV") is None  # chooses its plan at run time: nothing to split for
    monkeypatch.setenv(ts.ENV, "default")
    assert _split("ZBV") is None
    monkeypatch.setenv(ts.ENV, "balanced")
    with pytest.raises(ValueError, match="ZBPIPE_SPLIT='balanced'"):
        _split("ZBV")


def test_each_class_judges_the_plan_it_runs():
    names = {n: ts.plan_name_of(lookup_zbpipe(n)) for n in ("ZBV", "ZBVHalf", "ZB1P", "ZBH1")}
    assert names == {"ZBV": "ZBV", "ZBVHalf": "ZBVHalf", "ZB1P": "ZB1P", "ZBH1": "ZBH1"}
    assert ts.plan_name_of(lookup_zbpipe("ZBV:profile")) == "ZBV"
    assert ts.plan_name_of(lookup_zbpipe("Auto:40GiB")) is None


@pytest.mark.dist
def test_resplit_grads_equal_the_unpipelined_model_and_a_users_split_is_kept():
    """2 ranks, ZB-V through torchtitan's pipeline_llm: the chosen split and an explicit one.

    Same fp32 ops per microbatch; only the summation order of microbatch gradients differs:
    the tolerances of test_torchtitan.py (measured 5e-7 on gradients of order 1-10)."""
    per_rank = run_ranks(cases.resplit_runs, 2, "ZBV", 4, 0, timeout=180)
    ref_grads, ref_loss = per_rank[0]["reference"]
    chosen = _split("ZBV")
    default = tt_pp._generate_llm_fqn_per_model_part(4, tiny.N_LAYERS, 1, 1)
    expected = {"chosen": chosen, "explicit": cases.EXPLICIT}
    assert len({str(v) for v in (chosen, cases.EXPLICIT, default)}) == 3  # all different
    for run, parts in expected.items():
        for rank in (0, 1):
            got = per_rank[rank][run]
            assert got["stages"] == [rank, 3 - rank]  # V placement
            want = [[n for n in parts[s]] for s in got["stages"]]
            assert got["pieces"] == want, (run, rank)
        grads = {**per_rank[0][run]["grads"], **per_rank[1][run]["grads"]}
        assert set(grads) == set(ref_grads)
        for fqn, ref in ref_grads.items():
            np.testing.assert_allclose(grads[fqn], ref, rtol=1e-5, atol=1e-5, err_msg=run + fqn)
        assert per_rank[0][run]["loss"] == pytest.approx(ref_loss, rel=1e-6)


def test_explicit_split_reaches_torchtitan_unchanged(monkeypatch):
    # The wrapper hands torchtitan's pipeline_llm the user's parallelism object itself.
    seen = {}

    def fake(model, **kwargs):
        seen.update(kwargs)
        return "built"

    dims, parallelism, training = _dims(2, "ZBV", module_fqns_per_model_part=cases.EXPLICIT)
    wrapped = zt._wrap_pipeline_llm(fake)
    assert wrapped(None, parallelism=parallelism, parallel_dims=dims, training=training) == "built"
    assert seen["parallelism"] is parallelism
    plain = dataclasses.replace(parallelism, pipeline_parallel_schedule="Interleaved1F1B")
    wrapped(None, parallelism=plain, parallel_dims=dims, training=training)
    assert seen["parallelism"] is plain  # torch's schedules: untouched
