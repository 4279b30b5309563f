"""MoE experts under the deferred engine, eager: their weight gradients wait for W and equal a
fused backward's.

The reference is the same module, unpatched, run through an ordinary ``loss.backward()``: for
torchtitan's ``GroupedExperts`` zbpipe mirrors its forward and computes the weight gradients
with the same products in the same dtypes, so the gradients must be *bitwise* equal; routings
are uneven, with experts that get no token (tests/engines/_moe_cases.py). Compiled blocks:
tests/engines/test_compiled_experts.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from tests.engines import _moe_cases as cases
from zbpipe.engines import derived_ops, expert_grads
from zbpipe.engines.expert_patch import (
    expert_modules,
    patch_experts,
    patched_experts,
    unpatch_experts,
)
from zbpipe.engines.linear_patch import StoreSlot

pytest.importorskip("torchtitan.models.common.moe")


def _assert_same_grads(ref: nn.Module, got: nn.Module) -> None:
    for (name, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(p.grad, q.grad), name


def test_grouped_experts_weight_grads_wait_for_w_and_equal_fused_ones():
    fused, split = cases.twins(cases.grouped_experts())
    engine = cases.engine_on(split)
    assert [type(m).__name__ for m in patched_experts(split)] == ["DeferredGroupedExperts"]
    for mb, counts in enumerate(cases.COUNTS):  # accumulating: 4 microbatches
        args = cases.routed_rows(counts, mb)
        gx_ref, out_ref = cases.fused_step(fused, *args)
        before = cases.grads(split)
        gx, out = cases.split_step(engine, split, (0, mb), *args)
        assert torch.equal(out, out_ref) and torch.equal(gx, gx_ref)
        assert cases.grads(split).keys() == before.keys()
        for name, g in cases.grads(split).items():  # B left every expert weight alone
            assert (g is None and before[name] is None) or torch.equal(g, before[name]), name
        engine.backward_weight((0, mb))
        _assert_same_grads(fused, split)


def test_accumulating_w_converts_a_slice_of_experts_at_a_time(monkeypatch):
    # bf16 products added into fp32 .grad through one small buffer: slices of one expert here
    monkeypatch.setattr(expert_grads, "_SLICE_ELEMENTS", cases.HIDDEN * cases.DIM)
    fused, split = cases.twins(cases.grouped_experts())
    engine = cases.engine_on(split)
    for mb, counts in enumerate(cases.COUNTS[:2]):
        args = cases.routed_rows(counts, mb)
        cases.fused_step(fused, *args)
        cases.split_step(engine, split, (0, mb), *args)
        engine.backward_weight((0, mb))
    _assert_same_grads(fused, split)


def test_patched_experts_are_torchtitans_outside_zbpipe():
    ref, patched = cases.twins(cases.grouped_experts())
    patch_experts(patched, StoreSlot())
    args = cases.routed_rows(cases.COUNTS[0], 0)
    cases.fused_step(ref, *args)
    cases.fused_step(patched, *args)  # no store: torchtitan's forward, its backward
    _assert_same_grads(ref, patched)
    assert unpatch_experts(patched) == 1 and type(patched) is type(ref)


def test_checkpointed_experts_recompute_into_the_same_store():
    fused, split = cases.twins(cases.grouped_experts())

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch.utils.checkpoint.checkpoint(
                self.inner, x, n, use_reentrant=False
            )
            return out

    fused, split = Checkpointed(fused), Checkpointed(split)
    engine = cases.engine_on(split)
    args = cases.routed_rows(cases.COUNTS[2], 2)
    cases.fused_step(fused, *args)
    cases.split_step(engine, split, (0, 0), *args)
    assert all(p.grad is None for p in split.parameters())
    engine.backward_weight((0, 0))
    _assert_same_grads(fused, split)


def test_post_accumulate_hooks_fire_once_in_w():
    fused, split = cases.twins(cases.grouped_experts())
    fired: list[str] = []
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    engine = cases.engine_on(split)
    args = cases.routed_rows(cases.COUNTS[0], 0)
    cases.fused_step(fused, *args)
    cases.split_step(engine, split, (0, 0), *args)
    assert fired == []
    engine.backward_weight((0, 0))
    assert sorted(fired) == sorted(n for n, _ in split.named_parameters())
    _assert_same_grads(fused, split)


def test_converted_experts_stay_in_b_and_say_so(caplog):
    # (a GroupedExperts subclass with another forward is deferred: test_op_capture.py)
    from torchtitan.models.common.moe import GroupedExperts

    class QuantizedExperts(GroupedExperts):  # what torchtitan's Float8 / MXFP8 converters make
        def _grouped_mm(self, *, A, B_t, offs):  # noqa: N803 (torchtitan's names)
            return super()._grouped_mm(A=A, B_t=B_t, offs=offs)

    stage = nn.ModuleList([cases.grouped_experts()])
    stage[0].__class__ = QuantizedExperts
    with caplog.at_level(logging.WARNING, logger="zbpipe.engines"):
        assert patch_experts(stage, StoreSlot()) == 0
    assert "QuantizedExperts" in caplog.text
    assert [len(found) for found in expert_modules(stage)] == [0, 1]
    # their gradients come in B, correct
    fused = cases.grouped_experts()
    engine = cases.engine_on(stage[0])
    args = cases.routed_rows(cases.COUNTS[3], 3)
    cases.fused_step(fused, *args)
    cases.split_step(engine, stage[0], (0, 0), *args)
    _assert_same_grads(fused, stage[0])


def test_bmm_and_einsum_experts_defer_their_weights_and_leave_the_rest():
    fused, split = cases.twins(cases.BatchedExperts())
    engine = cases.engine_on(split)
    assert [type(m).__name__ for m in patched_experts(split)] == ["DeferredBatchedExperts"]
    torch.manual_seed(3)
    x = torch.randn(cases.EXPERTS, 5, cases.DIM)
    gx_ref, out_ref = cases.fused_step(fused, x)
    gx, out = cases.split_step(engine, split, (0, 0), x)
    assert torch.equal(out, out_ref) and torch.equal(gx, gx_ref)
    # bmm, einsum and matmul on the weight, and on its transpose, wait for W
    assert all(p.grad is None for p in split.parameters())
    engine.backward_weight((0, 0))
    for (name, p), q in zip(fused.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name


def test_weight_grad_products_match_autograds():
    # the W products against autograd's own gradient of the op they invert
    torch.manual_seed(0)
    x = torch.randn(10, 8).bfloat16()  # (bf16 grouped GEMMs want 16-byte strides)
    w = torch.randn(4, 16, 8, requires_grad=True)
    offs = torch.tensor([2, 2, 9, 10], dtype=torch.int32)
    out = torch._grouped_mm(x, w.bfloat16().transpose(-2, -1), offs=offs)
    g = torch.randn_like(out)
    out.backward(g)
    steps = (("cast", "bfloat16"), ("t", 1, 2))
    dw = derived_ops.DerivedProduct("grouped", steps, offs).grad(w, x, g)
    assert torch.equal(dw, w.grad) and not dw[1].any()  # expert 1 got no row
    a = torch.randn(4, 3, 8)
    v = torch.randn(4, 8, 5, requires_grad=True)
    out = torch.bmm(a, v)
    g = torch.randn_like(out)
    out.backward(g)
    bmm = derived_ops.DerivedProduct("einsum", (), eq="bij,bjk->bik")
    assert torch.equal(bmm.grad(v, a, g), v.grad)


def test_post_accumulate_hooks_fire_once_in_w_after_a_segmented_b():
    """The backward half of an overlapped DualPipeV pair runs B in segments
    (``backward_input_steps``): the experts' hooks are parked there too, so they fire once, in
    W, on the whole gradient (an optimizer-in-backward hook must not step on a stale .grad)."""
    from zbpipe.engines.segmented import SegmentRecord

    fused, split = cases.twins(cases.grouped_experts())
    fired: list[tuple[str, torch.Tensor | None]] = []
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: fired.append((name, None if p.grad is None else p.grad.clone()))
        )
    engine = cases.engine_on(split)
    args = cases.routed_rows(cases.COUNTS[0], 0)
    cases.fused_step(fused, *args)
    x = args[0].clone().requires_grad_()
    with engine.forward_scope((0, 0), None, fused=False):
        out = split(x, *args[1:])
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    steps = engine.backward_input_steps((0, 0), SegmentRecord("test"), [loss], None, [x], None)
    for _ in steps:  # no points: one segment
        pass
    assert fired == []
    engine.backward_weight((0, 0))
    assert sorted(n for n, _ in fired) == sorted(n for n, _ in split.named_parameters())
    _assert_same_grads(fused, split)
    for name, grad in fired:
        assert torch.equal(grad, dict(fused.named_parameters())[name].grad), name
