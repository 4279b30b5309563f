"""ScheduleContinuous without ``variable_shapes=True`` (docs/use/varlen.md): a mini-batch whose
microbatches differ in shape from the first one's raises on stage 0's rank before anything of it
is sent (before, gloo aborted the receiving rank), and the stream goes on after a retry.
``variable_shapes=True`` itself: tests/continuous/test_continuous_varlen.py."""

import pytest

from tests.continuous import _continuous_cases as cc
from tests.continuous.test_continuous import TOL, _assert_params
from zbpipe.testing import run_ranks


@pytest.mark.dist
def test_a_microbatch_of_another_shape_raises_before_anything_is_sent():
    world, m, n = 2, 3, 3
    out = run_ranks(cc_shapes(), world, m, n, timeout=120)
    errors = out[0]["errors"]
    assert len(errors) == 2 and out[1]["errors"] == []
    for e in errors:
        assert (
            "ScheduleContinuous.step(): microbatch 1's argument 0 has shape (2, 5), "
            "but the stages were set up for (2, 8)" in e
        ), e
        assert "Build ScheduleContinuous with variable_shapes=True (mode='sync')" in e
    # the retries continued the stream: nothing of the refused mini-batches was kept or sent
    _assert_params(world, out, cc.plain_loop(world, m, n, "sgd"), "sgd", TOL["sgd"], "retried")


def cc_shapes():
    from tests.continuous._continuous_shapes_cases import bad_minibatch_then_retry

    return bad_minibatch_then_retry
