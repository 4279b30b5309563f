"""The backward split at communication points (zbpipe.engines.segmented), on one process: a
forward cut at its points, run backward one segment at a time, gives the gradients a plain
``backward()`` gives; checkpointing recomputes once; what cannot be cut is refused.

The "collective" reverses the rows (its own inverse and its own backward, like an all-to-all with
even splits), so no process group is needed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from zbpipe.engines.segmented import Exchange, SegmentRecord, segmented_backward


class Done:
    def __init__(self, t):
        self.t = t

    def wait(self):
        return self.t


class Reverse:
    """Rows reversed: a permutation, so its backward is itself."""

    def __init__(self, log=None):
        self.log = log if log is not None else []

    def start(self, x):
        self.log.append("start")
        return Done(x.flip(0))

    def start_backward(self, grad):
        self.log.append("start backward")
        return Done(grad.flip(0))


class Block(nn.Module):
    """Residual and gate scores used on both sides of two points, as in an MoE layer."""

    def __init__(self, record_of, d=8):
        super().__init__()
        self.record_of = record_of  # () -> the SegmentRecord cutting now, or None
        self.n1, self.a, self.n2 = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)
        self.gate, self.up, self.down = nn.Linear(d, 1), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.coll = Reverse()

    def point(self, x):
        rec = self.record_of()
        return (
            rec.cut(x, self.coll, None) if rec is not None else Exchange.apply(x, self.coll, None)
        )

    def forward(self, x):
        h = x + self.a(self.n1(x))
        s = torch.sigmoid(self.gate(self.n2(h)))
        t = self.point(self.n2(h) * s)
        t = self.point(self.down(torch.relu(self.up(t))))
        return h + t * s


def _save_mm(ctx, op, *args, **kwargs):
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _grads(cut: bool, how: str | None):
    state = {"rec": None}
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(lambda: state["rec"]) for _ in range(2))
    if how == "compiled":
        for b in blocks:
            b.a.compile()
            b.up.compile()
    x = torch.randn(6, 8, requires_grad=True)
    grad = torch.randn(6, 8)
    rec = SegmentRecord(where="test") if cut else None
    if rec is not None:
        rec.open()
        state["rec"] = rec
    h = x
    for b in blocks:
        if how == "full":
            h = checkpoint(b, h, use_reentrant=False)
        elif how == "selective":
            ctx = functools.partial(create_selective_checkpoint_contexts, _save_mm)
            h = checkpoint(b, h, use_reentrant=False, context_fn=ctx)
        else:
            h = b(h)
    state["rec"] = None
    if rec is None:
        h.backward(grad)
        return x.grad, [p.grad for p in blocks.parameters()], 0
    rec.finish()
    steps = segmented_backward(rec, [h], [grad], [x])
    yields = 0
    try:
        while True:
            next(steps)
            yields += 1
    except StopIteration as done:
        (gx,) = done.value
    return gx, [p.grad for p in blocks.parameters()], yields


@pytest.mark.parametrize("how", [None, "full", "selective", "compiled"])
def test_segments_give_the_gradients_of_one_backward(how):
    ref_x, ref_p, _ = _grads(False, how)
    got_x, got_p, yields = _grads(True, how)
    assert yields == 4  # one per point, its backward collective in flight
    # same ops, one fp32 accumulation order: a compiled region's kernels may round differently
    tol = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got_x, ref_x, **tol)
    for a, b in zip(got_p, ref_p):
        torch.testing.assert_close(a, b, **tol)


def test_checkpointed_block_is_recomputed_once_across_its_segments():
    calls = []
    state = {"rec": None}
    torch.manual_seed(0)
    block = Block(lambda: state["rec"])
    block.up.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(6, 8, requires_grad=True)
    rec = SegmentRecord(where="test")
    rec.open()
    state["rec"] = rec
    h = checkpoint(block, x, use_reentrant=False)
    state["rec"] = None
    rec.finish()
    for _ in segmented_backward(rec, [h], [torch.ones_like(h)], [x]):
        pass
    assert len(calls) == 2  # the forward, and one recompute for three backward calls


def test_an_in_place_write_to_a_tensor_from_before_a_point_is_refused():
    rec = SegmentRecord(where="stage 3 microbatch 1")
    rec.open()
    try:
        x = torch.randn(4, 2, requires_grad=True)
        h = x * 2
        rec.cut(h, Reverse(), None)
        with pytest.raises(RuntimeError, match=r"stage 3 microbatch 1: add_ modifies in place"):
            h.add_(1)
    finally:
        rec.finish()


def test_a_point_lets_the_other_pass_run_while_its_collective_is_in_flight():
    log = []
    coll = Reverse(log)
    rec = SegmentRecord(where="test")
    rec.open()
    try:
        rec.cut(torch.randn(4, 2, requires_grad=True) * 1, coll, lambda: log.append("meanwhile"))
    finally:
        rec.finish()
    assert log == ["start", "meanwhile"]
