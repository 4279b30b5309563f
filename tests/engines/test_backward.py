"""The split backward (B then W) gives the gradients of a fused torch.autograd.backward.

Every test builds a module, deep-copies it, runs the fused reference on the copy with
torch.autograd.backward, and the split path (backward_input, later WeightGrad.run) on the
original, same inputs, fp32 on CPU.

Tolerance: B and W call the same ATen backward formulas on the same saved tensors as the fused
engine, so without weight reuse the results are bitwise equal (one test asserts exactly that).
Where a weight or node is shared, the split sums the same contributions in a different order,
which changes rounding only: rtol=1e-6/atol=1e-7 is a few ulps of fp32 (eps 1.2e-7) at the
magnitudes used here (values O(1), sums of a handful of terms).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from tests.engines._custom_function import Scale
from zbpipe.engines.fused import backward_full
from zbpipe.engines.graph_backward import WeightGrad, backward_input

RTOL, ATOL = 1e-6, 1e-7


def _seed(n: int = 0) -> None:
    torch.manual_seed(n)


def _stack(hidden: int = 16, layers: int = 3) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*mods)


def _fused(module: nn.Module, inputs: list, out_grads: list | None, call=None):
    """Reference: plain torch.autograd.backward; returns input grads (read from .grad)."""
    ins = [
        x.detach().clone().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x
        for x in inputs
    ]
    outs = call(module, *ins) if call else module(*ins)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    pairs = [(o, g) for o, g in zip(outs, out_grads or [None] * len(outs)) if o.requires_grad]
    if out_grads is None:
        torch.autograd.backward([o for o, _ in pairs], [torch.ones_like(o) for o, _ in pairs])
    else:
        pairs = [(o, g) for o, g in pairs if g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [x.grad if torch.is_tensor(x) and x.requires_grad else None for x in ins]


def _split(module: nn.Module, inputs: list, out_grads: list | None, call=None):
    ins = [
        x.detach().clone().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x
        for x in inputs
    ]
    outs = call(module, *ins) if call else module(*ins)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    params = list(module.parameters())
    dins, w = backward_input(outs, out_grads, ins, params)
    for p in params:
        assert p.grad is None, "B must not compute parameter gradients"
    for x in ins:
        if torch.is_tensor(x):
            assert x.grad is None, "B must not accumulate into input .grad"
    w.run()
    return list(dins)


def _assert_same(ref_mod, mod, ref_dins, dins, exact: bool = False) -> None:
    check = (
        (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0))
        if exact
        else (lambda a, b: torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL))
    )
    for (name, rp), p in zip(ref_mod.named_parameters(), mod.parameters(), strict=True):
        if rp.grad is None:
            assert p.grad is None, f"{name}: autograd leaves grad None, split set it"
        else:
            assert p.grad is not None, f"{name}: split left grad None"
            check(p.grad, rp.grad)
    assert len(ref_dins) == len(dins)
    for a, b in zip(ref_dins, dins, strict=True):
        if a is None:
            assert b is None
        else:
            check(b, a)


def _compare(module, inputs, out_grads=None, call=None, exact=False):
    ref = copy.deepcopy(module)
    ref_dins = _fused(ref, inputs, out_grads, call)
    dins = _split(module, inputs, out_grads, call)
    _assert_same(ref, module, ref_dins, dins, exact)
    return ref, module


def test_middle_stage_linear_gelu_stack_is_bitwise_equal():
    _seed()
    m = _stack()
    x = torch.randn(8, 16, requires_grad=True)
    _compare(m, [x], [torch.randn(8, 16)], exact=True)


def test_last_stage_scalar_loss_with_default_ones():
    _seed(1)
    m = nn.Sequential(_stack(), nn.Flatten(0))
    x = torch.randn(4, 16, requires_grad=True)
    _compare(m, [x], None, call=lambda mod, x: mod(x).square().mean(), exact=True)


def test_first_stage_float_input_without_grad():
    _seed(2)
    m = _stack()
    _compare(m, [torch.randn(8, 16)], [torch.randn(8, 16)], exact=True)


def test_first_stage_embedding_token_ids():
    _seed(3)
    m = nn.Sequential(nn.Embedding(50, 16), _stack())
    ids = torch.randint(0, 50, (4, 6))
    _compare(m, [ids], [torch.randn(4, 6, 16)], exact=True)


def test_first_stage_b_does_the_activation_matmuls():
    # A 3-layer Linear stack on stage 0 has 2 activation matmuls (grad @ W for layers 3 and 2;
    # layer 1's input needs none) and 3 weight matmuls. torch's own split runs all 5 in W.
    _seed(4)
    m = _stack(layers=3)
    out = m(torch.randn(8, 16))
    with torch.profiler.profile() as prof_b:
        _, w = backward_input([out], [torch.randn(8, 16)], [None], list(m.parameters()))
    with torch.profiler.profile() as prof_w:
        w.run()
    mm = ("aten::mm", "aten::addmm")
    assert sum(e.name in mm for e in prof_b.events()) == 2
    assert sum(e.name in mm for e in prof_w.events()) == 3


def test_middle_stage_b_skips_weight_matmuls():
    _seed(5)
    m = _stack(layers=3)
    x = torch.randn(8, 16, requires_grad=True)
    out = m(x)
    with torch.profiler.profile() as prof_b:
        _, w = backward_input([out], [torch.randn(8, 16)], [x], list(m.parameters()))
    with torch.profiler.profile() as prof_w:
        w.run()
    mm = ("aten::mm", "aten::addmm")
    assert sum(e.name in mm for e in prof_b.events()) == 3
    assert sum(e.name in mm for e in prof_w.events()) == 3


class _TwiceLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, x):
        h = self.ln(torch.tanh(self.lin(x)))
        return self.ln(self.lin(h) + x)


def test_weight_used_twice_in_one_stage():
    _seed(6)
    x = torch.randn(8, 16, requires_grad=True)
    _compare(_TwiceLinear(), [x], [torch.randn(8, 16)])


def test_weight_used_twice_on_first_stage():
    _seed(7)
    _compare(_TwiceLinear(), [torch.randn(8, 16)], [torch.randn(8, 16)])


class _WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16))
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(Scale.apply(torch.relu(self.a(x)), self.w))


def test_custom_autograd_function_middle_stage():
    _seed(8)
    _compare(_WithCustom(), [torch.randn(8, 16, requires_grad=True)], [torch.randn(8, 16)])


def test_custom_autograd_function_first_stage():
    _seed(9)
    _compare(_WithCustom(), [torch.randn(8, 16)], [torch.randn(8, 16)])


class _MultiOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8)
        self.c = nn.Linear(16, 4)

    def forward(self, x, mask):
        h = torch.relu(self.a(x))
        # outputs: used, unused (grad None), not requiring grad, used
        return self.b(h), self.c(h), mask.float() * 2, h * 3


def test_several_outputs_some_without_grad_some_unused():
    _seed(10)
    x = torch.randn(8, 16, requires_grad=True)
    mask = torch.rand(8, 16) > 0.5
    grads = [torch.randn(8, 8), None, None, torch.randn(8, 16)]
    ref, m = _compare(_MultiOut(), [x, mask], grads)
    assert m.c.weight.grad is None  # its only output received no gradient, as in autograd


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return self.bn(self.lin(x)) * self.scale


def test_modules_with_buffers_batchnorm_train_mode():
    _seed(11)
    m = _WithBuffers().train()
    ref, m = _compare(m, [torch.randn(8, 16, requires_grad=True)], [torch.randn(8, 16)])
    torch.testing.assert_close(m.bn.running_mean, ref.bn.running_mean, rtol=0, atol=0)


class _FrozenAndUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.live = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)

    def forward(self, x):
        return self.live(torch.relu(self.frozen(x)))


@pytest.mark.parametrize("input_grad", [True, False])
def test_frozen_and_unused_parameters_keep_grad_none(input_grad):
    _seed(12)
    ref, m = _compare(
        _FrozenAndUnused(), [torch.randn(8, 16, requires_grad=input_grad)], [torch.randn(8, 16)]
    )
    assert m.frozen.weight.grad is None and m.unused.weight.grad is None
    assert m.live.weight.grad is not None


def _microbatches(n: int, first_stage: bool):
    _seed(13)
    xs = [torch.randn(8, 16, requires_grad=not first_stage) for _ in range(n)]
    gs = [torch.randn(8, 16) for _ in range(n)]
    return xs, gs


@pytest.mark.parametrize("first_stage", [False, True])
def test_accumulation_interleaved_b_w_is_bitwise_equal_to_fused_1f1b(first_stage):
    # Pipeline order B0 B1 W0 B2 W1 W2; the reference runs fused backward for 0, 1, 2: the same
    # order of accumulation into .grad, so equality is exact on a model without weight reuse.
    _seed(14)
    m = _stack()
    ref = copy.deepcopy(m)
    xs, gs = _microbatches(3, first_stage)
    for x, g in zip(xs, gs):
        backward_full([ref(x)], [g], [x])
    params = list(m.parameters())
    outs = [m(x) for x in xs]
    pending: dict[int, WeightGrad] = {}
    for op, i in [("B", 0), ("B", 1), ("W", 0), ("B", 2), ("W", 1), ("W", 2)]:
        if op == "B":
            _, pending[i] = backward_input([outs[i]], [gs[i]], [xs[i]], params)
        else:
            pending.pop(i).run()
    for rp, p in zip(ref.parameters(), params, strict=True):
        assert torch.equal(p.grad, rp.grad)
        assert p.grad.is_contiguous()


def test_accumulation_with_weight_reuse_matches_fused():
    _seed(15)
    m = _TwiceLinear()
    ref = copy.deepcopy(m)
    xs, gs = _microbatches(3, False)
    for x, g in zip(xs, gs):
        torch.autograd.backward(ref(x), g)
    params = list(m.parameters())
    outs = [m(x) for x in xs]
    b = [backward_input([o], [g], [x], params)[1] for o, g, x in zip(outs, gs, xs)]
    for w in reversed(b):  # any order of W gives the same sum up to rounding
        w.run()
    for rp, p in zip(ref.parameters(), params, strict=True):
        # Reversed order: a sum of 6 fp32 products per element, reassociated, with cancellation;
        # how far that moves depends on the BLAS (torch 2.11's CUDA build on the CPU: 2.4e-7
        # on an element near 0.07). The fp32 tolerance of the pipeline tests, not bitwise's.
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-6)


class _Keep(torch.autograd.Function):
    """Identity whose backward needs a saved tensor; exposes it for a weakref."""

    saved: list = []

    @staticmethod
    def forward(ctx, x, w):
        s = x * 1.0
        ctx.save_for_backward(s, w)
        _Keep.saved.append(weakref.ref(s))
        return x * w

    @staticmethod
    def backward(ctx, gy):
        s, w = ctx.saved_tensors
        return gy * w, (gy * s).sum(0)


@pytest.mark.parametrize("input_grad", [True, False])
def test_graph_is_freed_after_w_and_second_run_raises(input_grad):
    _seed(16)
    _Keep.saved.clear()
    lin = nn.Linear(16, 16)
    w = nn.Parameter(torch.randn(16))
    x = torch.randn(8, 16, requires_grad=input_grad)
    out = lin(_Keep.apply(torch.tanh(x), w))
    dins, wg = backward_input([out], [torch.randn(8, 16)], [x], [*lin.parameters(), w])
    gc.collect()
    assert _Keep.saved[0]() is not None, "W still needs the saved tensor"
    wg.run()
    del out, dins
    gc.collect()
    assert _Keep.saved[0]() is None, "the graph (and its saved tensors) outlived W"
    with pytest.raises(RuntimeError, match="called twice"):
        wg.run()


def test_backward_full_returns_input_grads_and_leaves_input_grad_alone():
    _seed(17)
    m = _stack()
    x = torch.randn(8, 16, requires_grad=True)
    x.grad = torch.full((8, 16), 7.0)
    g = torch.randn(8, 16)
    (dx,) = backward_full([m(x)], [g], [x])
    x2 = x.detach().clone().requires_grad_()
    (ref,) = torch.autograd.grad(copy.deepcopy(m)(x2), [x2], g)
    torch.testing.assert_close(dx, ref, rtol=0, atol=0)
    assert torch.equal(x.grad, torch.full((8, 16), 7.0))


def test_mismatched_output_grads_is_a_clear_error():
    m = _stack()
    out = m(torch.randn(2, 16, requires_grad=True))
    with pytest.raises(ValueError, match="output_grads has 2 entries for 1 outputs"):
        backward_input([out], [None, None], [], list(m.parameters()))


class _AddParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return x + self.p  # AddBackward hands the very same gradient tensor to x and p


def test_parameter_grad_does_not_alias_gradients_handed_in_or_out():
    _seed(18)
    m = _AddParam()
    x = torch.randn(8, 16, requires_grad=True)
    g = torch.randn(8, 16)
    (dx,), w = backward_input([m(x)], [g], [x], list(m.parameters()))
    w.run()
    expected = g.clone()
    torch.testing.assert_close(m.p.grad, expected, rtol=0, atol=0)
    dx.add_(100.0)
    g.add_(100.0)
    torch.testing.assert_close(m.p.grad, expected, rtol=0, atol=0)


class _SummedWeights(nn.Module):
    """x @ (w1 + w2): one weight-only node hands the same gradient tensor to two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 8))
        self.w2 = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ (self.w1 + self.w2))


def test_two_parameters_fed_by_one_weight_node_accumulate_separately():
    # Reference: fused backward over two microbatches. A stolen, shared gradient tensor would make
    # the second microbatch's in-place add land in both parameters' .grad.
    torch.manual_seed(0)
    mod = _SummedWeights()
    ref = copy.deepcopy(mod)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    for x in xs:
        out = mod(x)
        _, wg = backward_input([out], [torch.ones_like(out)], [x], list(mod.parameters()))
        wg.run()
        ref(x.detach().requires_grad_(True)).backward(torch.ones(4, 8))
    assert mod.w1.grad.untyped_storage().data_ptr() != mod.w2.grad.untyped_storage().data_ptr()
    torch.testing.assert_close(mod.w1.grad, ref.w1.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mod.w2.grad, ref.w2.grad, rtol=1e-6, atol=1e-7)


# --- W batches boundaries that cannot reach each other's weight edges into one engine call -----


class _Siblings(nn.Module):
    """Two Linears reading one activation (like q/k/v or gate/up projections), summed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        return self.b(h) + torch.tanh(self.c(h))


def _count_w_calls(monkeypatch, w: WeightGrad) -> int:
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    w.run()
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize("input_grad", [True, False])
def test_sibling_boundaries_share_one_w_call_and_stay_bitwise(monkeypatch, input_grad):
    # Hand count: b's and c's AddmmBackward read the same GELU output, neither reaches the
    # other's weights: one call for both; a's AddmmBackward lies below them: a second call. Their
    # weight regions (TBackward -> weight) are private, so no separate weight-region call.
    # On stage 0, a's AddmmBackward is a target (the lowest activation node): same two calls.
    _seed(19)
    m = _Siblings()
    x = torch.randn(8, 16, requires_grad=input_grad)
    g = torch.randn(8, 16)
    ref = copy.deepcopy(m)
    ref_dins = _fused(ref, [x], [g])
    ins = [x.detach().clone().requires_grad_(input_grad)]
    dins, w = backward_input([m(*ins)], [g], ins, list(m.parameters()))
    assert w.num_calls == 2
    assert _count_w_calls(monkeypatch, w) == 2
    _assert_same(ref, m, ref_dins, list(dins), exact=True)


def test_sibling_boundaries_run_each_weight_matmul_once():
    _seed(20)
    m = _Siblings()
    x = torch.randn(8, 16, requires_grad=True)
    out = m(x)
    _, w = backward_input([out], [torch.randn(8, 16)], [x], list(m.parameters()))
    with torch.profiler.profile() as prof_w:
        w.run()
    mm = ("aten::mm", "aten::addmm")
    assert sum(e.name in mm for e in prof_w.events()) == 3  # x.T @ grad of a, b and c, once each


class _NestedWeightEdges(nn.Module):
    """addcmul(x, w, exp(w)): one boundary with a weight edge (exp) leading to another (w)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16))
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(torch.addcmul(x, self.w, self.w.exp()))


@pytest.mark.parametrize("input_grad", [True, False])
def test_weight_edge_below_another_weight_edge_of_the_same_node(input_grad):
    _seed(21)
    _compare(
        _NestedWeightEdges(), [torch.randn(8, 16, requires_grad=input_grad)], [torch.randn(8, 16)]
    )


class _RandomDag(nn.Module):
    """A random graph of Linears (some reused), GELU/tanh, residual adds, products and branches.

    Node i reads one or two earlier nodes; a weight-only node (w1 + w2, exp(w)) feeds some
    matmuls, so weight-region nodes are shared between boundaries too.
    """

    def __init__(self, seed: int, nodes: int = 8) -> None:
        super().__init__()
        rng = torch.Generator().manual_seed(seed)
        pick = lambda n: int(torch.randint(0, n, (1,), generator=rng))  # noqa: E731
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.v = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.s = nn.Parameter(torch.randn(8) * 0.3)
        self.ops: list[tuple[str, int, int, int]] = []
        for i in range(1, nodes + 1):
            self.ops.append(
                (
                    ["lin", "lin", "act", "add", "mul", "shared", "scale"][pick(7)],
                    pick(i),
                    pick(i),
                    pick(4),
                )
            )
        self.outs = sorted({nodes, pick(nodes) + 1})

    def forward(self, x):
        vals = [x]
        vw = self.v + self.lins[0].weight  # a weight-only node used by every "shared" op
        for op, a, b, k in self.ops:
            xa, xb = vals[a], vals[b]
            if op == "lin":
                y = self.lins[k](xa)
            elif op == "act":
                y = torch.nn.functional.gelu(xa) if k % 2 else torch.tanh(xa)
            elif op == "add":
                y = xa + xb
            elif op == "mul":
                y = xa * torch.tanh(xb)
            elif op == "shared":
                y = xa @ vw
            else:
                y = xa * self.s.exp()
            vals.append(y)
        return tuple(vals[i] for i in self.outs)


@pytest.mark.parametrize("seed", range(24))
def test_random_dags_match_fused_backward(seed):
    _seed(100 + seed)
    m = _RandomDag(seed)
    x = torch.randn(4, 8, requires_grad=seed % 3 != 0)  # every third: a first stage
    grads = [torch.randn(4, 8) for _ in m.outs]
    ref = copy.deepcopy(m)
    ref_dins = _fused(ref, [x], grads)
    dins = _split(m, [x], grads)
    for (name, rp), p in zip(ref.named_parameters(), m.parameters(), strict=True):
        if rp.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, rp.grad, rtol=1e-6, atol=1e-6, msg=name)
    for a, b in zip(ref_dins, dins, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


class _SharedWeightNodeAcrossGroups(nn.Module):
    """vw = tanh(v) (a weight-only node with a saved tensor) read by three matmuls.

    a1 = gelu(x) @ vw and a2 = tanh(x) @ vw are siblings: one W call, both feeding the edge
    into vw (captured once, holding their sum). lin2(tanh(sin(x) @ vw)) is a parallel branch on
    the same level as a1/a2 whose activation path reaches vw: it must not share their call. The
    matmul below lin2 feeds vw from another call, so vw runs in the final weight-region call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(8, 8) * 0.5)
        self.lin2 = nn.Linear(8, 8)

    def forward(self, x):
        vw = torch.tanh(self.v)
        a = torch.nn.functional.gelu(x) @ vw + torch.tanh(x) @ vw
        return a + self.lin2(torch.tanh(torch.sin(x) @ vw))


def test_weight_node_shared_between_groups_runs_once(monkeypatch):
    # Hand count: {a1, a2}, {lin2}, {sin(x) @ vw}, then the weight-region call for vw: 4 calls
    # for 4 boundaries (one per boundary plus the weight-region call would be 5).
    _seed(22)
    m = _SharedWeightNodeAcrossGroups()
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    ref = copy.deepcopy(m)
    ref_dins = _fused(ref, [x], [g])
    ins = [x.detach().clone().requires_grad_()]
    dins, w = backward_input([m(*ins)], [g], ins, list(m.parameters()))
    assert w.num_calls == 4
    assert _count_w_calls(monkeypatch, w) == 4
    _assert_same(ref, m, ref_dins, list(dins))


class _WeightNodeAlsoAnOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(8, 8) * 0.5)

    def forward(self, x):
        vw = torch.tanh(self.v)
        return torch.nn.functional.gelu(x @ vw), vw  # vw's node also receives an output gradient


@pytest.mark.parametrize("input_grad", [True, False])
def test_weight_node_that_is_also_an_output(input_grad):
    _seed(23)
    _compare(
        _WeightNodeAlsoAnOutput(),
        [torch.randn(4, 8, requires_grad=input_grad)],
        [torch.randn(4, 8), torch.randn(8, 8)],
    )
