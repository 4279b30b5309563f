"""The deferred engine (zbpipe.engines.deferred): B queues Linear weight GEMMs, W runs them.

Every test builds a module, keeps an unpatched deep copy as the reference, runs the reference
with one plain fused ``backward()`` and the patched original the way the stage seam does: the
store in the stage's slot around F and around B (activation checkpointing recomputes inside
B), ``deferring=True`` and the Linear weights' post-accumulate hooks parked during B only,
then ``store.run()`` as W. Single process, fp32 on CPU.

Exactness: with ``exact=True`` (the stores here, unless a test says otherwise) W's GEMM is the
one autograd's AddmmBackward runs for a Linear's weight (``grad_output^T @ input`` on the same
saved tensors) and it is added as AccumulateGrad adds it, so results are asserted bitwise equal
(``torch.equal``). The default store (``exact=False``) accumulates inside the GEMM
(``grad.addmm_``): the tests of that path assert the same sums to fp32 rounding, in place.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import types
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.engines._custom_function import Scale
from zbpipe.engines import choose_engine
from zbpipe.engines.deferred import WeightGradStore
from zbpipe.engines.linear_patch import (
    DeferredLinear,
    StoreSlot,
    patch_linears,
    patched_linears,
    post_accumulate_hooks_parked,
    unpatch_linears,
    weight_census,
)
from zbpipe.memory import SavedActivationMeter
from zbpipe.planning import Action, Costs, Plan, plan, simulate
from zbpipe.planning.fuse import fuse_adjacent_backward
from zbpipe.schedules.stage_seam import StageSeam

# ---------------------------------------------------------------------------------------------
# harness: the seam's F / B / W on one module, and the plain reference


@contextlib.contextmanager
def _holding(slot: StoreSlot, store: WeightGradStore, deferring: bool = False):
    slot.store, store.deferring = store, deferring
    try:
        yield
    finally:
        slot.store, store.deferring = None, False


class Deferred:
    """A patched module driven as StageSeam drives a stage: ``forward``, ``backward`` (B), ``w``."""

    def __init__(self, module: nn.Module, observer=None, exact: bool = True) -> None:
        self.module, self.slot = module, StoreSlot()
        self.num_patched = patch_linears(module, self.slot)
        self.observer, self.exact = observer, exact
        self.store: WeightGradStore | None = None

    def forward(self, *inputs, autocast: bool = False):
        self.store = WeightGradStore(observer=self.observer, exact=self.exact)
        with _holding(self.slot, self.store), _autocast(autocast):
            return self.module(*inputs)

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None) -> WeightGradStore:
        store = self.store
        linears = patched_linears(self.module)
        with _holding(self.slot, store, deferring=True), post_accumulate_hooks_parked(linears):
            out.backward(grad)
        return store


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(x.is_floating_point())


def _assert_grads_equal(mod: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(mod.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None, f"{name}: no grad"
        assert torch.equal(p.grad, q.grad), f"{name}: max diff {(p.grad - q.grad).abs().max()}"


def _linear_grads(mod: nn.Module) -> list:
    return [lin.weight.grad for lin in mod.modules() if isinstance(lin, nn.Linear)]


# ---------------------------------------------------------------------------------------------
# gradients against plain nn.Linear autograd


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(6, 8), (3, 4, 8)], ids=["2d", "3d"])
def test_linear_grads_bitwise_equal_plain_autograd(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(8, 5, bias=bias)
    ref = copy.deepcopy(lin)
    x, g = torch.randn(shape), torch.randn(*shape[:-1], 5)
    x_ref, x_def = _leaf(x), _leaf(x)
    ref(x_ref).backward(g)

    d = Deferred(lin)
    store = d.backward(d.forward(x_def), g)
    assert lin.weight.grad is None and store.num_gemms == 1
    store.run()
    _assert_grads_equal(lin, ref)
    assert torch.equal(x_def.grad, x_ref.grad)


def test_linear_applied_twice_queues_two_gemms_and_matches_bitwise():
    torch.manual_seed(0)
    mix = nn.Linear(8, 8)
    ref = copy.deepcopy(mix)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    x_ref, x_def = _leaf(x), _leaf(x)
    ref(torch.tanh(ref(x_ref))).backward(g)

    d = Deferred(mix)
    store = d.backward(_twice(d, x_def), g)
    assert store.num_gemms == 2
    store.run()
    _assert_grads_equal(mix, ref)
    assert torch.equal(x_def.grad, x_ref.grad)


def _twice(d: Deferred, x: torch.Tensor) -> torch.Tensor:
    d.store = WeightGradStore(exact=d.exact)
    with _holding(d.slot, d.store):
        return d.module(torch.tanh(d.module(x)))


@pytest.mark.parametrize("order", ["BWBW", "BBWW"])
def test_w_accumulates_onto_existing_grad_across_microbatches_like_autograd(order):
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(mod)  # (deepcopy does not copy .grad)
    for p, q in zip(mod.parameters(), ref.parameters()):  # an earlier step's accumulation
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    mbs = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(2)]
    for x, g in mbs:  # autograd accumulates microbatch after microbatch
        ref(x).backward(g)

    d = Deferred(mod)
    stores = []
    for x, g in mbs:
        stores.append(d.backward(d.forward(x), g))
        if order == "BWBW":
            stores[-1].run()
    if order == "BBWW":
        for s in stores:
            s.run()
    _assert_grads_equal(mod, ref)


@pytest.mark.parametrize("twice", [False, True], ids=["once", "applied-twice"])
def test_default_w_accumulates_inside_the_gemm_in_place(twice):
    """exact=False: a weight that has a .grad gets the GEMM's sum in that same tensor (no new
    tensor, no second pass), equal to autograd's accumulation to fp32 rounding. 512 rows: the
    GEMM's blocked sum differs from autograd's in the last bits, so exact=True (which must stay
    bitwise) is checked on the same data."""
    torch.manual_seed(0)
    mod = nn.Linear(64, 64)
    mod.weight.grad, mod.bias.grad = torch.randn(64, 64), torch.randn(64)
    x, g = torch.randn(512, 64), torch.randn(512, 64)
    ref = copy.deepcopy(mod)
    ref.weight.grad, ref.bias.grad = mod.weight.grad.clone(), mod.bias.grad.clone()
    for exact in (False, True):
        m = copy.deepcopy(ref)
        m.weight.grad, m.bias.grad = ref.weight.grad.clone(), ref.bias.grad.clone()
        grad_before = m.weight.grad
        d = Deferred(m, exact=exact)
        out = _twice(d, _leaf(x)) if twice else d.forward(_leaf(x))
        d.backward(out, g).run()
        if not exact:
            assert m.weight.grad is grad_before, "W replaced .grad instead of adding into it"
            fast = m.weight.grad
        else:
            exact_grad = m.weight.grad
    (ref(torch.tanh(ref(_leaf(x)))) if twice else ref(_leaf(x))).backward(g)
    assert torch.equal(exact_grad, ref.weight.grad)
    torch.testing.assert_close(fast, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_default_w_steals_when_there_is_no_grad_yet_and_fires_hooks_once():
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    ref = copy.deepcopy(mod)
    fired = Counter()
    for name, p in mod.named_parameters():
        if name.endswith("2.weight"):
            p.register_post_accumulate_grad_hook(lambda p, n=name: fired.update([n]))
    d = Deferred(mod, exact=False)
    mbs = [(torch.randn(5, 8), torch.randn(5, 8)) for _ in range(3)]
    for x, g in mbs:
        ref(x).backward(g)
        d.backward(d.forward(x), g).run()
    assert fired == {"2.weight": 3}
    for p, q in zip(mod.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_immediate_store_accumulates_during_b_and_queues_only_parked_weights():
    """A BW through the store: each GEMM is accumulated in B (created when .grad is None, added
    in place after), nothing is held for W, except the weights whose post-accumulate hooks B
    parked, which W computes and whose hooks it fires."""
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    ref = copy.deepcopy(mod)
    fired = Counter()
    mod[2].weight.register_post_accumulate_grad_hook(lambda p: fired.update(["2"]))
    d = Deferred(mod, exact=False)
    for step in range(2):
        x, g = torch.randn(5, 8), torch.randn(5, 4)
        ref(x).backward(g)
        out = d.forward(x)
        d.store.immediate = True
        with (
            _holding(d.slot, d.store, deferring=True),
            post_accumulate_hooks_parked(patched_linears(mod)) as parked,
        ):
            d.store.parked = parked
            out.backward(g)
        assert parked == {id(mod[2].weight)}
        assert d.store.num_gemms == 1, "only the hooked weight's GEMM may wait for W"
        assert mod[0].weight.grad is not None, f"step {step}: not accumulated during B"
        d.store.run()
    assert fired == {"2": 2}
    for p, q in zip(mod.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_weights_with_tensor_hooks_or_complex_values_get_their_gradient_in_b():
    """register_hook hooks see the gradient B hands a weight; a deferred GEMM would leave it None
    (a hook doubling it would be skipped or crash). Complex weights need the conjugate, which W's
    GEMM does not take. Both are computed in B, as a fused backward does."""
    torch.manual_seed(0)
    hooked = nn.Linear(6, 6)
    hooked.weight.register_hook(lambda g: 2 * g)
    cplx = nn.Linear(6, 6, dtype=torch.complex64)
    for mod, x in ((hooked, torch.randn(3, 6)), (cplx, torch.randn(3, 6, dtype=torch.complex64))):
        ref = copy.deepcopy(mod)
        if mod is hooked:
            ref.weight.register_hook(lambda g: 2 * g)
        ref(x).abs().sum().backward()
        d = Deferred(mod)
        store = d.backward(d.forward(x).abs().sum())
        assert store.num_gemms == 0 and mod.weight.grad is not None
        store.run()
        torch.testing.assert_close(mod.weight.grad, ref.weight.grad)


def test_running_w_twice_raises():
    d = Deferred(nn.Linear(4, 4))
    store = d.backward(d.forward(torch.randn(2, 4)).sum())
    store.run()
    with pytest.raises(RuntimeError, match="called twice"):
        store.run()


# ---------------------------------------------------------------------------------------------
# what B computes, what W computes


class _Mixed(nn.Module):
    """Embedding, LayerNorm, BatchNorm (running-stat buffers), a custom Function with a
    parameter, a plain buffer, and Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.ln = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.register_buffer("gain", torch.linspace(1.0, 2.0, 8))
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, ids):
        h = Scale.apply(self.ln(self.emb(ids)), self.scale) * self.gain
        return self.out(self.bn(F.gelu(self.fc(h))))


def test_non_linear_grads_arrive_in_b_linear_weight_grads_only_in_w():
    torch.manual_seed(0)
    mod = _Mixed()
    ref = copy.deepcopy(mod)
    ids, g = torch.randint(0, 20, (6,)), torch.randn(6, 3)
    ref(ids).backward(g)

    d = Deferred(mod)
    store = d.backward(d.forward(ids), g)
    in_b = ("emb.weight", "ln.weight", "ln.bias", "scale", "fc.bias", "bn.weight", "bn.bias")
    params = dict(mod.named_parameters())
    ref_params = dict(ref.named_parameters())
    for name in in_b:
        assert torch.equal(params[name].grad, ref_params[name].grad), f"{name} after B"
    assert params["fc.weight"].grad is None and params["out.weight"].grad is None
    for name, buf in mod.named_buffers():  # buffers: updated in F, as in the reference
        assert torch.equal(buf, dict(ref.named_buffers())[name]), name
    store.run()
    _assert_grads_equal(mod, ref)


# ---------------------------------------------------------------------------------------------
# outside a zbpipe B the patched module is an ordinary Linear


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_empty_slot_is_plain_linear():
    mod = _stack()
    ref = copy.deepcopy(mod)
    x, g = torch.randn(5, 8), torch.randn(5, 4)
    x_ref, x_def = _leaf(x), _leaf(x)
    ref(x_ref).backward(g)

    patch_linears(mod, StoreSlot())  # nothing ever fills the slot
    out = mod(x_def)
    assert "LinearFunction" not in type(out.grad_fn).__name__  # not even the custom Function
    out.backward(g)
    _assert_grads_equal(mod, ref)
    assert torch.equal(x_def.grad, x_ref.grad)


def test_store_not_deferring_is_a_fused_backward():
    mod = _stack()
    ref = copy.deepcopy(mod)
    x, g = torch.randn(5, 8), torch.randn(5, 4)
    ref(x).backward(g)

    d = Deferred(mod)
    out = d.forward(x)
    with _holding(d.slot, d.store, deferring=False):
        out.backward(g)
    assert d.store.num_gemms == 0
    _assert_grads_equal(mod, ref)


@pytest.mark.parametrize("deferring", [False, True], ids=["empty-slot", "inside-B"])
def test_create_graph_double_backward_matches_plain_autograd(deferring):
    """A gradient penalty: d/dparams of |dy/dx|^2. With create_graph=True grad mode is on, so
    even a store that is deferring computes the weight gradient on the spot."""
    mod = _stack()
    ref = copy.deepcopy(mod)
    x = torch.randn(5, 8)

    def penalty(m, x):
        x = _leaf(x)
        (gx,) = torch.autograd.grad(m(x).square().sum(), x, create_graph=True)
        return gx.square().sum()

    penalty(ref, x).backward()
    d = Deferred(mod)
    d.store = WeightGradStore()
    with _holding(d.slot, d.store, deferring=deferring):
        loss = penalty(mod, x)
    with _holding(d.slot, d.store, deferring=deferring):
        loss.backward()  # no create_graph here: a deferring store queues this pass's GEMMs
    d.store.run()
    # The same formulas; the second-order graph differs (custom Function backward vs
    # AddmmBackward), so sums are grouped differently: fp32 rounding of O(1) values, a few ulps.
    for (name, p), (_, q) in zip(mod.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# activation checkpointing, hooks, autocast, parametrizations


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_b_queues_the_recomputed_gemms(reentrant):
    torch.manual_seed(0)
    mod = _Checkpointed(reentrant)
    ref = copy.deepcopy(mod)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    x_ref, x_def = _leaf(x), _leaf(x)
    ref(x_ref).backward(g)

    d = Deferred(mod)
    store = d.backward(d.forward(x_def), g)
    assert store.num_gemms == 4  # two Linears per block, two blocks
    assert all(grad is None for grad in _linear_grads(mod))
    store.run()
    _assert_grads_equal(mod, ref)
    assert torch.equal(x_def.grad, x_ref.grad)


def test_post_accumulate_grad_hook_fires_in_w_once_per_w():
    torch.manual_seed(0)
    mix = nn.Linear(8, 8)  # applied twice: two GEMMs, one accumulation per W
    fired: list[int] = []
    mix.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    d = Deferred(mix)
    for mb in range(2):
        store = d.backward(_twice(d, torch.randn(3, 8)).sum())
        assert len(fired) == mb, "the hook fired in B"
        store.run()
        assert len(fired) == mb + 1


def test_post_accumulate_grad_hook_of_a_non_linear_param_fires_in_b():
    torch.manual_seed(0)
    mod = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    fired: list[str] = []
    mod[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append("ln"))
    mod[1].weight.register_post_accumulate_grad_hook(lambda p: fired.append("fc"))
    d = Deferred(mod)
    store = d.backward(d.forward(torch.randn(3, 8)).sum())
    assert fired == ["ln"]
    store.run()
    assert fired == ["ln", "fc"]


def test_autocast_bf16_grads_match_plain_autograd_under_autocast():
    mod = _stack()
    ref = copy.deepcopy(mod)
    x, g = torch.randn(6, 8), torch.randn(6, 4)
    x_ref, x_def = _leaf(x), _leaf(x)
    with _autocast(True):
        out_ref = ref(x_ref)
    out_ref.float().backward(g)

    d = Deferred(mod)
    out = d.forward(x_def, autocast=True)
    assert out.dtype == torch.bfloat16
    d.backward(out.float(), g).run()
    for (name, p), (_, q) in zip(mod.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.float32, name
        # Both compute the same bf16 GEMMs and cast to fp32; tolerance: one bf16 ulp of the
        # result (2^-8 relative), should the two GEMM calls round differently.
        torch.testing.assert_close(p.grad, q.grad, rtol=2**-8, atol=1e-5, msg=name)
    assert x_def.grad.dtype == torch.float32
    torch.testing.assert_close(x_def.grad, x_ref.grad, rtol=2**-8, atol=1e-5)


def test_autocast_saves_the_input_at_autocast_precision():
    # What B keeps for W is the input autocast's own Linear would save (bf16), not the fp32 input.
    d = Deferred(nn.Sequential(nn.Linear(8, 4)))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.dtype) or t, lambda t: t
    ):
        d.forward(torch.randn(6, 8, requires_grad=True), autocast=True)
    assert saved and torch.float32 not in saved[:1]  # the input, saved first, is bf16
    assert saved[0] == torch.bfloat16


def test_weight_norm_parametrized_linear_original_params_get_correct_grads():
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    mod = nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(mod)
    x, g = torch.randn(3, 5, 8), torch.randn(3, 5, 4)
    ref(x).backward(g)

    d = Deferred(mod)
    assert d.num_patched == 2
    d.backward(d.forward(x), g).run()
    _assert_grads_equal(mod, ref)  # parametrizations.weight.original0 / original1 included


# ---------------------------------------------------------------------------------------------
# memory


def test_meter_sees_queued_bytes_after_b_and_zero_after_w():
    torch.manual_seed(0)
    rows = 5
    mod = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    meter = SavedActivationMeter()
    d = Deferred(mod, observer=meter)
    x, g = torch.randn(rows, 8), torch.randn(rows, 4)
    g_ref = weakref.ref(g)
    store = d.backward(d.forward(x), g)
    del g
    # Queued: each Linear's input and output gradient, fp32, distinct storages:
    # fc (x, its grad) and out (GELU's output, the given grad).
    assert meter.live_bytes == 4 * rows * (8 + 16 + 16 + 4)
    assert g_ref() is not None  # the store keeps the output gradient for W
    store.run()
    assert meter.live_bytes == 0
    gc.collect()
    assert g_ref() is None, "the store still holds a tensor after run()"
    assert store.done and store.num_gemms == 0


# ---------------------------------------------------------------------------------------------
# patching


def test_unpatch_restores_the_class():
    mod = _stack()
    d = Deferred(mod)
    assert d.num_patched == 2 and all(type(m[0]) is DeferredLinear for m in [mod])
    assert unpatch_linears(mod) == 2
    assert type(mod[0]) is nn.Linear and type(mod[2]) is nn.Linear
    assert "_zbpipe_slot" not in mod[0].__dict__


def test_deepcopy_and_state_dict_of_a_patched_module():
    mod = _stack()
    plain_keys = list(mod.state_dict())
    Deferred(mod)
    assert list(mod.state_dict()) == plain_keys
    twin = copy.deepcopy(mod)
    assert type(twin[0]) is DeferredLinear and twin[0]._zbpipe_slot is not mod[0]._zbpipe_slot
    fresh = _stack()
    fresh.load_state_dict(mod.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(twin(x), fresh(x))


def test_patching_reaches_into_compiled_subtrees():
    # Inside compiled code a patched Linear runs zbpipe.engines.compiled_linear's Function,
    # whose weight GEMM the deferred engine routes to W (tests/engines/test_compiled_linear.py).
    torch.manual_seed(0)
    in_place = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    in_place[0].compile(backend="eager")  # the way torchtitan compiles
    wrapped = nn.Sequential(torch.compile(nn.Linear(4, 4), backend="eager"), nn.Linear(4, 4))
    assert patch_linears(in_place, StoreSlot()) == 2
    assert type(in_place[0]) is DeferredLinear and type(in_place[2]) is DeferredLinear
    assert patch_linears(wrapped, StoreSlot()) == 2
    assert type(wrapped[0]._orig_mod) is DeferredLinear


def test_patching_skips_a_linear_subclass_with_its_own_forward():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Tagged(nn.Linear):  # keeps Linear's forward: patched, as FSDP2's FSDPLinear is
        pass

    mod = nn.Sequential(Scaled(4, 4), Tagged(4, 4))
    assert patch_linears(mod, StoreSlot()) == 1
    assert type(mod[0]) is Scaled
    assert isinstance(mod[1], Tagged) and type(mod[1]).forward is DeferredLinear.forward


# ---------------------------------------------------------------------------------------------
# choosing the engine


def _stages(*modules):
    return [types.SimpleNamespace(submod=m) for m in modules]


def test_linear_heavy_stage_picks_deferred():
    stage = nn.Sequential(nn.Linear(64, 64), nn.Conv2d(3, 8, 3))
    assert weight_census(stage) == (64 * 64, 8 * 3 * 3 * 3)
    assert choose_engine("auto", _stages(stage), "Test").name == "deferred"


def test_conv_heavy_stage_picks_graph_and_says_so(caplog):
    stage = nn.Sequential(nn.Conv2d(64, 64, 3), nn.Linear(8, 8))
    with caplog.at_level(logging.INFO, logger="zbpipe.engines"):
        assert choose_engine("auto", _stages(stage), "Test").name == "graph"
    assert "graph engine" in caplog.text and "split='deferred'" in caplog.text


def test_embedding_does_not_count_as_other_weight_work():
    stage = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64))
    assert weight_census(stage) == (64 * 64, 0)
    assert choose_engine("auto", _stages(stage), "Test").name == "deferred"


def test_compiled_blocks_linears_count_as_linear_work_so_auto_stays_deferred():
    # torchtitan compiles each block in place; the graph engine refuses compiled regions, while
    # the deferred one defers their Linears: auto must not pick the refusing one.
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)]
    for b in blocks[:2]:
        b.compile(backend="eager")
    stage = nn.Sequential(*blocks, nn.Sequential(nn.Conv2d(64, 64, 3)))
    stage[-1].compile(backend="eager")  # a compiled conv counts as neither kind
    assert weight_census(stage) == (3 * 64 * 64, 0)
    assert choose_engine("auto", _stages(stage), "Test").name == "deferred"


def test_explicit_split_is_taken_and_a_bad_one_raises():
    stage = nn.Conv2d(64, 64, 3)
    assert choose_engine("deferred", _stages(stage), "Test").name == "deferred"
    assert choose_engine("graph", _stages(nn.Linear(4, 4)), "Test").name == "graph"
    with pytest.raises(ValueError, match=r"'auto', 'deferred', 'graph'.*'fused'"):
        choose_engine("fused", _stages(stage), "Test")


# ---------------------------------------------------------------------------------------------
# fusing B + W into BW


def _acts(text: str) -> tuple[Action, ...]:
    """ "0F0 0B0" -> (Action(0, "F", 0), Action(0, "B", 0)): stage, kind, microbatch."""
    out = []
    for tok in text.split():
        kind = "BW" if "BW" in tok else tok[1]
        s, m = tok.split(kind)
        out.append(Action(int(s), kind, int(m)))
    return tuple(out)


def test_fuse_hand_worked_plan():
    """Two ranks, two microbatches. Rank 0 (stage 0: its input gradient goes nowhere) fuses
    both adjacent pairs; rank 1 must not: its B sends a gradient rank 0 waits for, and a BW
    would send it W's time later. The pair split by another action stays split."""
    p = Plan(
        name="hand",
        num_ranks=2,
        n_microbatches=2,
        placement={0: 0, 1: 1},
        order={
            0: _acts("0F0 0F1 0B0 0W0 0B1 0W1"),
            1: _acts("1F0 1B0 1F1 1W0 1B1 1W1"),
        },
    )
    fused = fuse_adjacent_backward(p)
    assert fused.order[0] == _acts("0F0 0F1 0BW0 0BW1")
    assert fused.order[1] == p.order[1]
    costs = Costs()
    assert simulate(fused, costs).makespan == simulate(p, costs).makespan


@pytest.mark.parametrize(
    "engine, exact, store_bw",
    [("deferred", False, {(0, 1), (1, 2)}), ("deferred", True, set()), ("graph", False, set())],
)
def test_seam_runs_every_bw_but_a_stages_first_through_the_store(engine, exact, store_bw):
    """Hand-worked order of one rank with two stages. Stage 0's first backward is BW0 (torch's
    fused backward: no .grad yet); its BW1 and stage 1's BW2 (stage 1's first backward is the
    split B0) go through the deferred store, where W accumulates inside the GEMMs. exact=True
    and the graph engine keep torch's fused backward for every BW."""
    seam = StageSeam([], choose_engine(engine, [], "Test", exact=exact))
    seam.assign(_acts("0F0 1F0 1B0 0BW0 1W0 0F1 0BW1 1F2 1BW2 0F2 0B2 0W2"))
    assert seam.split_keys == {(1, 0), (0, 2)}
    assert seam.store_bw_keys == store_bw


class _Meter:
    """Counts the bytes the seam's saved-tensor holders report (an Observer)."""

    def __init__(self) -> None:
        self.packed = 0

    def on_pack(self, storage: int, nbytes: int) -> None:
        self.packed += nbytes

    def on_free(self, storage: int, nbytes: int) -> None:
        pass


def _captured(y: torch.Tensor) -> bool:
    """Whether ``y`` came from a deferring capture: the Python Function or the native one."""
    node = y.grad_fn
    return type(node).__name__ == "_LinearFunctionBackward" or "ZbpipeDeferred" in node.name()


@pytest.mark.parametrize(
    "key, meter, deferred, holders",
    [
        ((0, 0), False, False, False),  # the stage's first BW: torch's, nothing around F
        ((0, 1), False, True, False),  # a BW through the store: the engine's scope only
        ((0, 0), True, False, True),  # a meter: holders, no engine
        ((0, 1), True, True, True),  # both
    ],
    ids=["none", "engine", "meter", "engine+meter"],
)
def test_seam_forward_installs_only_what_the_key_needs(key, meter, deferred, holders):
    """What F runs under: the patched Linear's own autograd Function only for a key whose
    backward goes through the store, saved-tensor holders only with a meter; afterwards the
    slot is empty and the Linear an ordinary one again. The gradient is the plain Linear's
    whichever way F ran (fused BW: torch's backward)."""
    torch.manual_seed(0)
    lin, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    stage = types.SimpleNamespace(stage_index=0, submod=lin, has_backward=True)
    seam = StageSeam([stage], choose_engine("deferred", [stage], "Test"))
    seam.assign(_acts("0F0 0F1 0BW0 0BW1"))
    counted = _Meter() if meter else None
    seam.meter = counted
    x = torch.randn(2, 4)
    with seam.forward(stage, key[1], given=(x,)):
        y = lin(x)
    assert _captured(y) == deferred  # natively where built, by the Function with a meter
    assert (counted is not None and counted.packed > 0) == holders
    assert not _captured(lin(x))  # slot empty again
    y.sum().backward()
    ref(x).sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)
    seam.clear()


def test_fuse_v_turn_on_one_rank():
    """V placement: stage 1's input gradient goes to stage 0 on the same rank, so fusing its
    adjacent B and W delays no one."""
    p = Plan(
        name="v-one-rank",
        num_ranks=1,
        n_microbatches=1,
        placement={0: 0, 1: 0},
        order={0: _acts("0F0 1F0 1B0 1W0 0B0 0W0")},
        layout="v",
    )
    assert fuse_adjacent_backward(p).order[0] == _acts("0F0 1F0 1BW0 0BW0")


def _coverage(pl: Plan) -> tuple[Counter, set, set]:
    kinds = Counter((a.stage, a.microbatch, a.kind) for acts in pl.order.values() for a in acts)
    fwd = {(s, m) for s, m, k in kinds if k == "F"}
    bwd = {(s, m) for s, m, k in kinds if k in ("B", "BW")}
    return kinds, fwd, bwd


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["1F1B", "ZBH1", "ZBH2", "ZB1P", "ZB2P", "ZBV", "ZBVHalf", "ZBVMin"]),
    p=st.integers(1, 6),
    m_factor=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_fused_plan_is_never_slower_and_covers_the_same_work(name, p, m_factor, extra):
    m = m_factor * p + extra
    costs = Costs()
    original = plan(name, p, m, costs=costs)
    fused = fuse_adjacent_backward(original)
    assert simulate(fused, costs).makespan <= simulate(original, costs).makespan + 1e-9
    kinds, fwd, bwd = _coverage(fused)
    _, fwd0, bwd0 = _coverage(original)
    assert fwd == fwd0 and bwd == bwd0
    for s, mb in bwd:  # each backward once: either B and W, or one BW
        split = (kinds[s, mb, "B"], kinds[s, mb, "W"], kinds[s, mb, "BW"])
        assert split in ((1, 1, 0), (0, 0, 1)), (s, mb, split)
