"""An overlapped pair whose forward half fails while its backward half is suspended between
segments: the backward half is closed at once, so what it holds for its B (the Linears'
post-accumulate hooks parked, the store deferring, the stage's slot, the graph) is let go of
before the exception reaches the caller, not whenever the traceback is freed (a caller that
catches a failed step and goes on, or keeps the exception, kept them all: the next step's B
ran with the hooks still parked)."""

from __future__ import annotations

import types

import pytest

from zbpipe import _compat as C
from zbpipe.schedules import pairs, planned_actions


def test_a_failed_forward_half_closes_the_suspended_backward_half(monkeypatch):
    held = []

    def backward_half():  # stands in for the engine's segmented B (its ``with`` blocks)
        held.append("parked")
        try:
            yield  # the first point's collective in flight: the forward half runs
            yield
        finally:
            held.remove("parked")

    seam = types.SimpleNamespace(
        engine=types.SimpleNamespace(segments_backward=True),
        stages={1: types.SimpleNamespace(has_backward=True)},
        backward_input_steps=lambda stage, mb, loss: backward_half(),
        cut_keys={(1, 0)},
    )
    sched = types.SimpleNamespace(seam=seam, rank=0, _maybe_get_loss=lambda stage, mb: None)
    monkeypatch.setattr(planned_actions, "prepare_backward", lambda sched, stage, mb: None)
    runner = pairs.PairRunner(sched)
    first = types.SimpleNamespace(stage_index=0, microbatch_index=1)
    second = types.SimpleNamespace(
        stage_index=1, microbatch_index=0, computation_type=C.BACKWARD_INPUT
    )

    def forward(ctx):
        assert held == ["parked"]  # the backward half is suspended meanwhile
        raise RuntimeError("the forward half failed")

    with pytest.raises(RuntimeError, match="forward half failed") as failure:
        runner._run_halves(first, second, forward, lambda ctx: None, None)
    assert failure.value is not None  # the exception (and its traceback) is still held
    assert held == []  # yet the backward half has let go
