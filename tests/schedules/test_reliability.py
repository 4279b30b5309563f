"""Misconfigurations fail at construction on every rank; failures mid-step end the job; runs are
deterministic."""

import pytest

from tests.schedules import _dist_cases as cases
from zbpipe.testing import RankFailure, run_ranks

pytestmark = pytest.mark.dist


def test_ranks_that_disagree_on_n_microbatches_all_raise():
    messages = run_ranks(cases.peers_disagree, 2, timeout=90)
    for msg in messages:
        assert "pipeline ranks disagree on the schedule configuration" in msg
        assert "n_microbatches=4" in msg and "n_microbatches=6" in msg


def test_step_arguments_on_the_wrong_rank_raise():
    first, last = run_ranks(cases.step_argument_errors, 2, timeout=90)
    assert "holds stage 0 and needs the batch" in first
    assert "holds the last stage and the schedule has a loss_fn" in last


def test_compiled_submodule_is_refused_by_the_graph_engine_and_trained_by_the_deferred_one():
    for msg, worst in run_ranks(cases.compiled_submodule_error, 2, timeout=90):
        assert "torch.compile'd" in msg and "split='deferred'" in msg, msg
        assert worst <= 1e-5  # the deferred run's gradients against the unpipelined model


def test_exception_on_one_rank_mid_step_ends_every_rank_quickly():
    with pytest.raises(RankFailure) as info:
        # The launcher's 60 s deadline is the hang detector: a surviving rank fails the test
        # ("did not finish" below). No stopwatch: how fast it ends depends on the machine.
        run_ranks(cases.raise_in_forward_of_microbatch_3, 2, timeout=60, pg_timeout=50)
    text = str(info.value)
    assert "injected failure in microbatch 3's forward" in text
    assert "did not finish" not in text, text
    # rank 0 failed by itself (its receive saw the peer go away), it was not killed by the launcher
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text


@pytest.mark.parametrize("world", [2])
def test_same_seed_gives_bitwise_identical_runs_for_every_schedule(world):
    case_list = [
        ("ScheduleZBH1", {}, 4),
        ("ScheduleZBH1", {"exact": True}, 3),
        ("ScheduleZBH2", {}, 4),
        ("ScheduleZBAuto", {}, 4),
        ("ScheduleZBV", {"memory": "zb"}, 4),
        ("ScheduleZBV", {"memory": "half"}, 4),
        ("ScheduleZBV", {"memory": "min"}, 4),
        ("Schedule1F1BMulti", {}, 4),
    ]
    counts = run_ranks(cases.determinism_cases, world, case_list, timeout=240)
    assert all(c > 0 for per_rank in counts for c in per_rank)


def test_eval_and_a_schedule_without_loss_fn_run_forward_only():
    shapes = run_ranks(cases.eval_runs_no_backward, 2, timeout=90)
    assert shapes[0] is None and shapes[1] is not None  # the last stage returns the merged output


def test_ddp_wrapped_stage_is_refused():
    for msg in run_ranks(cases.ddp_stage_refused, 2, timeout=90):
        assert "DistributedDataParallel" in msg and "fully_shard" in msg


def test_nan_loss_is_reported_per_microbatch_on_the_last_stage():
    first, last = run_ranks(cases.nonfinite_loss_reported, 2, timeout=90)
    assert first == [] and last == [2]
