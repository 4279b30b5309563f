"""The deferred Linear's two captures (zbpipe.engines.weight_capture): the output hook and the
autograd.Function give bitwise the same gradients, the hook is taken only where it may be, and
what it holds it lets go of.

Each test drives a patched module as the stage seam does (the store in the slot around F and
around B, ``deferring=True`` during B, then ``store.run()`` as W) with a store whose ``fast``
flag lets the Linears take the hook, and compares with plain autograd on an unpatched copy
(``exact=True`` stores: W adds each product as AccumulateGrad does, so the results are bitwise
a fused backward's) and with the same store driven through the Function. Single process, fp32.
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

from zbpipe.engines.deferred import WeightGradStore
from zbpipe.engines.weight_capture import CaptureState

from ._capture_cases import Twice, holding, patched


def _store(fast: bool, *, exact: bool = True, immediate: bool = False, state=None):
    store = WeightGradStore(exact=exact)
    store.immediate, store.capture = immediate, state or CaptureState(fast=fast)
    return store


def _hooked(out: torch.Tensor) -> bool:
    """Whether ``out`` came from the output hook (a C++ node), not the Function."""
    return "_LinearFunction" not in type(out.grad_fn).__name__


def _run(module: nn.Module, x: torch.Tensor, g: torch.Tensor, store: WeightGradStore):
    """F, B, W as the seam runs them; returns the input's gradient and F's output."""
    slot = patched(module)
    x = x.detach().clone().requires_grad_()
    with holding(slot, store):
        out = module(x)
    with holding(slot, store, deferring=True):
        out.backward(g)
    store.run()
    return x.grad, out


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters()]


@pytest.mark.parametrize("immediate", [False, True], ids=["deferred", "immediate"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "in-gemm"])
@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 8)], ids=["2d", "3d"])
def test_hook_and_function_give_bitwise_the_same_gradients(shape, exact, immediate):
    torch.manual_seed(0)
    base = Twice()
    x, g = torch.randn(shape), torch.randn(*shape[:-1], 4)
    results = {}
    for fast in (True, False):
        mod = copy.deepcopy(base)
        for p in mod.parameters():  # a later microbatch: .grad exists, W adds to it
            p.grad = torch.ones_like(p)
        gx, out = _run(mod, x, g, _store(fast, exact=exact, immediate=immediate))
        assert _hooked(out) == fast
        results[fast] = (gx, _grads(mod))
    for a, b in zip([results[True][0], *results[True][1]], [results[False][0], *results[False][1]]):
        assert torch.equal(a, b)
    if exact:  # and both are a fused backward's
        ref = copy.deepcopy(base)
        for p in ref.parameters():
            p.grad = torch.ones_like(p)
        xr = x.detach().clone().requires_grad_()
        ref(xr).backward(g)
        assert torch.equal(results[True][0], xr.grad)
        for a, b in zip(results[True][1], _grads(ref)):
            assert torch.equal(a, b)


def _fallback_cases():
    """(name, setup) where the Linear must take the Function: setup(module, x) -> (x, context)."""

    def hooks(mod, x):
        return x, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def autocast(mod, x):
        return x, torch.autocast("cpu", dtype=torch.bfloat16)

    def no_grad_input(mod, x):
        return x.detach(), contextlib.nullcontext()

    def hooked_weight(mod, x):
        mod.weight.register_hook(lambda grad: grad)
        return x, contextlib.nullcontext()

    return {
        "saved-tensor-hooks": hooks,
        "autocast": autocast,
        "input-without-grad": no_grad_input,
        "weight-with-register_hook": hooked_weight,
    }


@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_the_function_where_the_hook_cannot_do_what_it_does(case):
    torch.manual_seed(0)
    lin, ref = nn.Linear(8, 4), nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    slot = patched(lin)
    x = torch.randn(5, 8, requires_grad=True)
    x, ctx = _fallback_cases()[case](lin, x)
    store = _store(True)
    with holding(slot, store), ctx:
        out = lin(x)
    assert not _hooked(out)
    ref_x = x.detach().clone().requires_grad_(x.requires_grad)
    with _fallback_cases()[case](ref, ref_x)[1]:
        ref_out = ref(ref_x)
    with holding(slot, store, deferring=True):
        out.float().sum().backward()
    store.run()
    ref_out.float().sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad)


def test_the_hook_is_taken_only_from_a_schedules_second_step():
    state = CaptureState()
    assert not state.fast
    state.step_begins()
    assert not state.fast  # the first step: the memory probe's, and the create_graph check's
    state.step_begins()
    assert state.fast
    state.saw_create_graph()
    state.step_begins()
    assert not state.fast


def test_a_frozen_weight_queues_nothing_and_gets_no_gradient():
    lin = nn.Linear(8, 4)
    lin.weight.requires_grad_(False)
    store = _store(True)
    gx, _ = _run(lin, torch.randn(5, 8), torch.randn(5, 4), store)
    assert lin.weight.grad is None and lin.bias.grad is not None and gx is not None


def test_an_in_place_change_of_the_input_after_the_linear_raises():
    lin = nn.Linear(8, 8)
    slot = patched(lin)
    x = torch.randn(5, 8, requires_grad=True)
    store = _store(True)
    with holding(slot, store):
        h = x * 1.0
        out = lin(h)
        h.add_(1.0)  # autograd would refuse to unpack h, had it saved it
    with holding(slot, store, deferring=True), pytest.raises(RuntimeError, match="in-place"):
        out.sum().backward()


def test_a_create_graph_backward_over_a_hooked_linear_raises_and_switches_back():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    slot = patched(lin)
    state = CaptureState(fast=True)
    store = _store(True, state=state)
    x = torch.randn(5, 8, requires_grad=True)
    with holding(slot, store):
        out = lin(torch.tanh(x))
        assert _hooked(out)
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(out.square().sum(), x, create_graph=True)
    assert not state.fast and state.create_graph_seen
    with holding(slot, _store(True, state=state)):
        assert not _hooked(lin(x))  # the Function from then on


def test_the_hook_lets_go_of_the_input_once_b_ran():
    """An output kept after B (a stage output held for the user) keeps its ``grad_fn`` and the
    hook on it: the input must not stay alive through them (the Function's saved input is freed
    by B as well). ``immediate``: nothing is queued, so nothing else holds it."""
    lin = nn.Linear(8, 8)
    slot = patched(lin)
    store = _store(True, exact=False, immediate=True)
    lin.weight.grad = torch.zeros_like(lin.weight)
    with holding(slot, store):
        h = torch.randn(5, 8, requires_grad=True) * 2.0
        seen = weakref.ref(h)
        out = lin(h)
    del h
    gc.collect()
    assert seen() is not None  # held from F to B
    with holding(slot, store, deferring=True):
        out.backward(torch.ones_like(out), retain_graph=True)
    gc.collect()
    assert seen() is None and out.grad_fn is not None


def test_a_backward_outside_b_adds_the_weight_gradient_at_once():
    """A graph a zbpipe F built, backwarded elsewhere (the store not deferring): the hook adds
    the gradient itself, as an ordinary Linear's backward would."""
    torch.manual_seed(0)
    lin, ref = nn.Linear(8, 4), nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    slot = patched(lin)
    store = _store(True)
    x = torch.randn(5, 8, requires_grad=True)
    with holding(slot, store):
        out = lin(x)
    assert _hooked(out)
    out.sum().backward()
    ref(x.detach().requires_grad_()).sum().backward()
    assert store.num_gemms == 0
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)


def test_checkpointed_blocks_take_the_function_and_match_plain_autograd():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ref = copy.deepcopy(block)
    slot = patched(block)
    store = _store(True)
    x = torch.randn(5, 8)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with holding(slot, store):
        out = checkpoint(block, xa, use_reentrant=False)
    with holding(slot, store, deferring=True):
        out.sum().backward()
    assert store.num_gemms == 2  # deferred through the Function, under checkpointing's hooks
    store.run()
    checkpoint(ref, xb, use_reentrant=False).sum().backward()
    for p, q in zip(block.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(xa.grad, xb.grad)
