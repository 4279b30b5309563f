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


#: the compiled stream's mini-batches: every length new, none of 1 (dynamo specializes sizes 0
#: and 1), as in tests/schedules/test_varlen_compiled.py; three, so a flush starts a new stream
COMPILED_DRAWS = [[7, 29, 13, 50], [9, 31, 12, 44], [20, 5, 33, 17]]


@pytest.mark.dist
def test_varlen_stream_on_2_ranks_equals_the_plain_loop():
    """The issue's lengths then two drawn mini-batches (3 optimizer steps), both engines; the
    data-dependent stage's error on both ranks, in the same launch (its return shows that no rank
    hung, and the streams after it that the process group still works); and the stream over
    blocks compiled in place (aot_eager, deferred engine), its gradients and parameters against
    the eager loop in the rank, with a bounded number of graphs, none after the first call."""
    out = run_ranks(_cases(), 2, ["deferred", "graph"], _draws(2), COMPILED_DRAWS, timeout=240)
    assert "depends on the values of its input" in out[0]["error"], out[0]["error"]
    assert "stage 0 (on another rank)" in out[1]["error"], out[1]["error"]
    assert all(len(o["worst"]) == 2 for o in out)
    for rank, o in enumerate(out):
        got = o["compiled"]
        assert got["worst"] < 1e-5, (rank, got)  # fp32 rounding (the rank's assert_close held)
        # docs/use/varlen.md's bound: at most 2 graphs per compiled block on a rank (a received
        # input: one for the first length, one symbolic; a marked input: one symbolic), all in
        # the first call (mini-batch 0 already varies the lengths), none in later calls
        first, *later = got["graphs"]
        assert 0 < first <= 2 * got["blocks"], (rank, got)
        assert all(n == first for n in later), (rank, got)


@pytest.mark.dist
def test_varlen_stream_on_4_ranks_equals_the_plain_loop():
    """Four stages, one block each: shape headers across three rank boundaries."""
    out = run_ranks(_cases(), 4, ["auto"], _draws(2), timeout=240)
    assert all(len(o["worst"]) == 1 for o in out)
