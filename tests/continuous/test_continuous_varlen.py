"""ScheduleContinuous(mode="sync", variable_shapes=True): microbatches of drawn lengths flow through
the stream, each mini-batch's shapes travelling with its first activation
(zbpipe.continuous.shapes). Every mini-batch's gradients and the parameters after the last step
equal a plain synchronous loop's on the unpipelined model, on 2 and 4 ranks; a stage whose output
shape depends on values raises on every rank in the first step, before any activation is sent.

Lengths are drawn by hypothesis outside the processes (derandomized); all draws of a rank count
run in ONE launch (launching is the slow part)."""

import pytest

from tests.schedules.test_varlen import _draws
from zbpipe.continuous import ScheduleContinuous
from zbpipe.testing import run_ranks


def _cases():
    from tests.continuous._continuous_varlen_cases import all_cases

    return all_cases


def _loss(out, target):
    return out.sum()


@pytest.mark.parametrize("mode", ["2bw", "stash"])
def test_variable_shapes_outside_sync_is_refused_with_what_to_do(mode):
    with pytest.raises(ValueError, match="variable_shapes=True is supported in mode='sync' only"):
        ScheduleContinuous([], 4, loss_fn=_loss, optimizer=None, mode=mode, variable_shapes=True)


def test_variable_shapes_must_be_a_bool():
    with pytest.raises(ValueError, match="variable_shapes must be True or False, got 'yes'"):
        ScheduleContinuous([], 4, loss_fn=_loss, optimizer=None, variable_shapes="yes")


@pytest.mark.dist
def test_varlen_stream_on_2_ranks_equals_the_plain_loop():
    """The issue's lengths then two drawn mini-batches (3 optimizer steps), both engines; and
    the data-dependent stage's error on both ranks, in the same launch (its return shows that
    no rank hung, and the streams after it that the process group still works)."""
    out = run_ranks(_cases(), 2, ["deferred", "graph"], _draws(2), timeout=240)
    assert "depends on the values of its input" in out[0]["error"], out[0]["error"]
    assert "stage 0 (on another rank)" in out[1]["error"], out[1]["error"]
    assert all(len(o["worst"]) == 2 for o in out)


@pytest.mark.dist
def test_varlen_stream_on_4_ranks_equals_the_plain_loop():
    """Four stages, one block each: shape headers across three rank boundaries."""
    out = run_ranks(_cases(), 4, ["auto"], _draws(2), timeout=240)
    assert all(len(o["worst"]) == 1 for o in out)
