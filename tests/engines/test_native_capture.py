"""The native weight capture (zbpipe.engines.native): bitwise the Python captures' gradients,
what it takes on that the hook could not, where it leaves a Linear to the Function, what its
C++ queue does in W, and how an engine takes it up.

Each test drives a patched module as the stage seam does (the store in the slot around F and
B, ``deferring=True`` during B, ``store.run()`` as W), once with the store's native queue and
once through the Python ``autograd.Function`` (the reference the native capture ports op for
op), and, where the store is ``exact`` (W adds as AccumulateGrad does), against plain autograd
on an unpatched copy. Single process, fp32 unless autocast says otherwise.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zbpipe.engines.deferred import DeferredEngine, WeightGradStore
from zbpipe.engines.linear_patch import StoreSlot, patch_linears, post_accumulate_hooks_parked
from zbpipe.engines.weight_capture import CaptureState

from ._capture_cases import Twice, holding, patched


def _store(native, *, exact: bool = True, immediate: bool = False) -> WeightGradStore:
    """A store whose Linears capture natively (``native``: the module) or by the Function."""
    store = WeightGradStore(exact=exact)
    store.immediate, store.capture = immediate, CaptureState(fast=False)
    if native is not None:
        store.native = native.Queue(immediate, exact)
    return store


def _native(out: torch.Tensor) -> bool:
    return "ZbpipeDeferredLinear" in out.grad_fn.name()


def _run(module, x, g, store, ctx=contextlib.nullcontext):
    """F, B, W as the seam runs them (F under ``ctx()``); the input's gradient and F's output."""
    slot = patched(module)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    with holding(slot, store), ctx():
        out = module(x)
    with holding(slot, store, deferring=True):
        out.float().backward(g)
    store.run()
    return x.grad, out


def _both(base, x, g, *, exact, immediate, native, has_grad=True, ctx=contextlib.nullcontext):
    """{'native': [input grad, parameter grads], 'function': [...]} from copies of ``base``."""
    results = {}
    for name, module in (("native", native), ("function", None)):
        mod = copy.deepcopy(base)
        if has_grad:  # a later microbatch: .grad exists, W adds to it
            for p in mod.parameters():
                p.grad = torch.ones_like(p)
        store = _store(module, exact=exact, immediate=immediate)
        gx, out = _run(mod, x, g, store, ctx)
        assert _native(out) == (module is not None)
        results[name] = [gx, *[p.grad for p in mod.parameters()]]
    return results


def _assert_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert (u is None and v is None) or torch.equal(u, v)


@pytest.mark.parametrize("has_grad", [True, False], ids=["grad", "no-grad-yet"])
@pytest.mark.parametrize("immediate", [False, True], ids=["deferred", "immediate"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "in-gemm"])
@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 8)], ids=["2d", "3d"])
def test_native_and_function_give_bitwise_the_same_gradients(
    native_capture, shape, exact, immediate, has_grad
):
    torch.manual_seed(0)
    base = Twice()
    x, g = torch.randn(shape, requires_grad=True), torch.randn(*shape[:-1], 4)
    got = _both(base, x, g, exact=exact, immediate=immediate, native=native_capture,
                has_grad=has_grad)  # fmt: skip
    _assert_equal(got["native"], got["function"])
    if exact:  # and both are a fused backward's
        ref = copy.deepcopy(base)
        for p in ref.parameters():
            p.grad = torch.ones_like(p) if has_grad else None
        xr = x.detach().clone().requires_grad_()
        ref(xr).backward(g)
        _assert_equal(got["native"], [xr.grad, *[p.grad for p in ref.parameters()]])


@pytest.mark.parametrize("immediate", [False, True], ids=["deferred", "immediate"])
def test_native_under_autocast_matches_the_function(native_capture, immediate):
    """bf16 autocast on the CPU: the queued operands in autocast's dtype, the product cast back
    to the weight's; W computes it apart (not inside the GEMM), as the Function's store does."""
    torch.manual_seed(0)
    got = _both(Twice(), torch.randn(6, 8, requires_grad=True), torch.randn(6, 4), exact=False,
                immediate=immediate, native=native_capture,
                ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16))  # fmt: skip
    _assert_equal(got["native"], got["function"])


def test_a_linear_applied_twice_once_under_autocast_keeps_its_products_order(native_capture):
    """The autocast product is handed back to Python's W; the plain one after it must follow
    it there (queue order per weight), not be added first in C++."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):  # B reaches the autocast call first
            h = torch.tanh(self.a(x))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.a(h)

    torch.manual_seed(0)
    for immediate in (False, True):
        got = _both(Mixed(), torch.randn(6, 8, requires_grad=True), torch.randn(6, 8), exact=False,
                    immediate=immediate, native=native_capture)  # fmt: skip
        _assert_equal(got["native"], got["function"])


def test_native_under_checkpointing_defers_and_matches_plain_autograd(native_capture):
    """Activation checkpointing's saved-tensor hooks see the native Function's saved input (the
    hook could not take this case): the recompute in B queues through the same store."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ref = copy.deepcopy(block)
    slot = patched(block)
    store = _store(native_capture)
    x = torch.randn(5, 8)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with holding(slot, store):
        out = checkpoint(block, xa, use_reentrant=False)
    with holding(slot, store, deferring=True):
        out.sum().backward()
    assert store.num_gemms == 2  # both GEMMs deferred, in the C++ queue
    store.run()
    checkpoint(ref, xb, use_reentrant=False).sum().backward()
    _assert_equal([xa.grad, *[p.grad for p in block.parameters()]],
                  [xb.grad, *[p.grad for p in ref.parameters()]])  # fmt: skip


def test_second_order_gradients_flow_through_the_native_capture(native_capture):
    """A gradient penalty (create_graph=True inside the forward): the native Function computes
    the weight gradient with recorded ops, as the Python Function does (same bits), and both
    match plain autograd to fp32 rounding (plain autograd's Linear backward is other kernels)."""
    torch.manual_seed(0)

    def penalty(lin, slot, store):
        x = torch.randn(5, 8, requires_grad=True)
        with holding(slot, store) if slot is not None else contextlib.nullcontext():
            out = lin(torch.tanh(x))
            (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
            gx.square().sum().backward()
        return [p.grad for p in lin.parameters()]

    base = nn.Linear(8, 4)
    grads = {}
    for name, module in (("native", native_capture), ("function", None), ("plain", None)):
        torch.manual_seed(1)
        lin = copy.deepcopy(base)
        slot = None if name == "plain" else StoreSlot()
        if slot is not None:
            patch_linears(lin, slot)
        grads[name] = penalty(lin, slot, _store(module))
    _assert_equal(grads["native"], grads["function"])
    for a, b in zip(grads["native"], grads["plain"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_input_without_grad_still_defers_its_weight(native_capture):
    """A first stage's data input needs no gradient: the output hook could not take it (no
    grad_fn to hook), the native Function does, and W computes the weight's gradient."""
    torch.manual_seed(0)
    got = _both(Twice(), torch.randn(6, 8), torch.randn(6, 4), exact=True,
                immediate=False, native=native_capture)  # fmt: skip
    _assert_equal(got["native"], got["function"])


def test_a_weight_with_register_hook_is_left_to_the_function(native_capture):
    """Its hooks must see the gradient B computes: the Function computes it in B."""
    torch.manual_seed(0)
    lin, ref = nn.Linear(8, 4), nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    seen = []
    lin.weight.register_hook(lambda grad: seen.append(grad.clone()))
    slot = patched(lin)
    store = _store(native_capture)
    x = torch.randn(5, 8, requires_grad=True)
    with holding(slot, store):
        out = lin(x)
    assert not _native(out)
    with holding(slot, store, deferring=True):
        out.sum().backward()
    store.run()
    ref(x.detach()).sum().backward()
    assert len(seen) == 1 and torch.equal(lin.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("immediate", [False, True], ids=["deferred", "immediate"])
def test_post_accumulate_hooks_fire_once_in_w_after_the_sum(native_capture, immediate):
    """B parks the hooks (as the engine does); the native queue keeps a hooked weight's GEMM
    for W even in a fused BW, so the hook fires once, on the whole sum."""
    torch.manual_seed(0)
    base = Twice()
    x, g = torch.randn(6, 8), torch.randn(6, 4)
    ref = copy.deepcopy(base)
    ref(x.clone().requires_grad_()).backward(g)
    mod = copy.deepcopy(base)
    fired = []
    mod.a.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    slot = patched(mod)
    store = _store(native_capture, exact=True, immediate=immediate)
    with holding(slot, store):
        out = mod(x.clone().requires_grad_())
    with holding(slot, store, deferring=True), post_accumulate_hooks_parked([mod.a, mod.b]):
        out.backward(g)
    assert fired == []
    store.run()
    assert len(fired) == 1 and torch.equal(fired[0], ref.a.weight.grad)


def test_the_queue_refuses_a_second_w_and_a_late_gemm(native_capture):
    lin = nn.Linear(8, 4)
    slot = patched(lin)
    store = _store(native_capture)
    with holding(slot, store):
        out = lin(torch.randn(5, 8, requires_grad=True))
        late = lin(torch.randn(5, 8, requires_grad=True))
    with holding(slot, store, deferring=True):
        out.sum().backward()
    store.run()
    with pytest.raises(RuntimeError, match="twice"):
        store.native.run()
    with holding(slot, store, deferring=True), pytest.raises(RuntimeError, match="after its W"):
        late.sum().backward()


def test_a_failed_step_drops_the_queue_without_computing_it(native_capture):
    lin = nn.Linear(8, 4)
    slot = patched(lin)
    store = _store(native_capture)
    with holding(slot, store):
        out = lin(torch.randn(5, 8, requires_grad=True))
    with holding(slot, store, deferring=True):
        out.sum().backward()
    assert store.num_gemms == 1
    store.release()
    assert store.num_gemms == 0 and lin.weight.grad is None and lin.bias.grad is not None


def test_an_in_place_change_of_the_input_after_the_linear_raises(native_capture):
    lin = nn.Linear(8, 8)
    slot = patched(lin)
    store = _store(native_capture)
    with holding(slot, store):
        h = torch.randn(5, 8, requires_grad=True) * 1.0
        out = lin(h)
        h.add_(1.0)
    with holding(slot, store, deferring=True), pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()


def test_the_input_is_let_go_of_once_b_ran(native_capture):
    """A fused BW through the store adds each GEMM in B: nothing keeps the input after it (B
    frees the node's saved tensors), though the output, held for the user, keeps its node."""
    lin = nn.Linear(8, 8)
    slot = patched(lin)
    store = _store(native_capture, exact=False, immediate=True)
    lin.weight.grad = torch.zeros_like(lin.weight)
    with holding(slot, store):
        h = torch.randn(5, 8, requires_grad=True) * 2.0
        seen = weakref.ref(h)
        out = lin(h)
    del h
    gc.collect()
    assert seen() is not None
    with holding(slot, store, deferring=True):
        out.backward(torch.ones_like(out))
    gc.collect()
    assert seen() is None and out.grad_fn is not None and store.num_gemms == 0


def test_a_backward_outside_b_computes_the_weight_gradient_in_it(native_capture):
    """A graph a zbpipe F built, backwarded elsewhere (the store not deferring): an ordinary
    Linear's gradient, accumulated by autograd."""
    torch.manual_seed(0)
    lin, ref = nn.Linear(8, 4), nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    slot = patched(lin)
    store = _store(native_capture)
    x = torch.randn(5, 8, requires_grad=True)
    with holding(slot, store):
        out = lin(x)
    assert _native(out)
    out.sum().backward()
    ref(x.detach().requires_grad_()).sum().backward()
    assert store.num_gemms == 0
    _assert_equal([lin.weight.grad, lin.bias.grad], [ref.weight.grad, ref.bias.grad])


class _Source:
    """A NativeSource whose build finishes at the ``ready``-th poll."""

    def __init__(self, module, ready: int) -> None:
        self.module, self.ready, self.polls = module, ready, 0

    def poll(self):
        self.polls += 1
        return self.module if self.polls >= self.ready else None

    def step_begins(self):  # (the real source logs the build under way here, once)
        pass


def test_an_engine_takes_the_native_capture_up_at_a_steps_start(native_capture):
    state = CaptureState(source=_Source(native_capture, ready=3))  # polled once here
    assert state.native is None
    state.step_begins()
    assert state.native is None and not state.fast  # the first step: the Function
    state.step_begins()
    assert state.native is native_capture  # from this step on


def test_the_engine_gives_a_store_a_native_queue_only_without_a_meter(native_capture):
    engine = DeferredEngine()
    engine.capture = CaptureState(source=_Source(native_capture, ready=1))
    engine._slots[0] = StoreSlot()
    with engine.forward_scope((0, 0), None, fused=True):
        pass
    with engine.forward_scope((0, 1), _Meter(), fused=False):
        pass
    plain, metered = engine._stores[(0, 0)], engine._stores[(0, 1)]
    assert plain.native is not None and plain.native.immediate
    assert metered.native is None  # the meter counts the Python queue's held operands
    engine.clear()


class _Meter:
    def on_pack(self, storage: int, nbytes: int) -> None:
        pass

    def on_free(self, storage: int, nbytes: int) -> None:
        pass
