"""The deferred engine inside ``torch.compile``d blocks (zbpipe.engines.compiled_linear).

A block is compiled with ``fullgraph=True`` (a graph break raises), driven the way the stage
seam drives a stage (the store in the slot around F and B, ``deferring=True`` during B, then
``store.run()`` as W), and compared with an uncompiled, unpatched copy run with one plain
backward. Compiled code may reorder float sums (inductor fuses the norms), so gradients are
compared to fp32 rounding (rtol 1e-5, atol 1e-6 on values of order 1), not bitwise.

Most tests compile with ``backend="aot_eager"``: it builds the same one-node autograd region
(AOTAutograd's joint graph and partition) inductor does, in a fraction of the time; one test
runs inductor itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.engines._compile_cases import MLPBlock
from zbpipe import _compat as C
from zbpipe.engines.compiled_linear import route_compiled_linears, route_of
from zbpipe.engines.deferred import WeightGradStore
from zbpipe.engines.linear_patch import (
    StoreSlot,
    patch_linears,
    patched_linears,
    post_accumulate_hooks_parked,
)


class Twice(nn.Module):
    """One Linear applied twice inside the compiled region: its two products are summed there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Driven:
    """A stage's module with the seam's F / B / W (one slot, a store per microbatch)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.slot = module, StoreSlot()
        patch_linears(module, self.slot)
        self.nodes = route_compiled_linears(module, patched_linears(module))

    def step(self, x: torch.Tensor, g: torch.Tensor, exact: bool = False) -> WeightGradStore:
        """F then B of one microbatch; returns the store W runs (``exact``: its W adds each
        product as AccumulateGrad does)."""
        store = WeightGradStore(exact=exact)
        self.slot.store = store
        try:
            out = self.module(x)
            store.deferring = True
            out.backward(g)
        finally:
            self.slot.store, store.deferring = None, False
        return store


def _compiled(block: nn.Module, how: str, backend: str = "aot_eager") -> nn.Module:
    if how == "in-place":  # the way torchtitan compiles each block
        block.compile(fullgraph=True, backend=backend)
        return block
    return torch.compile(block, fullgraph=True, backend=backend)


def _pair(cls: type = MLPBlock) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    block = cls()
    return block, copy.deepcopy(block)


def _assert_close(block: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(block.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None, f"{name}: no grad"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("how", ["in-place", "wrapped"])
def test_b_queues_the_compiled_linears_gemms_and_w_completes_the_grads(how):
    block, ref = _pair()
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    ref(x).backward(g)

    driven = Driven(_compiled(block, how))
    store = driven.step(x, g)
    # B: the norm's and the biases' gradients are in; the two weight GEMMs wait in the store.
    assert store.num_gemms == 2
    assert block.up.weight.grad is None and block.down.weight.grad is None
    for name in ("norm.weight", "norm.bias", "up.bias", "down.bias"):
        p, q = block.get_parameter(name), ref.get_parameter(name)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    store.run()
    _assert_close(block, ref)


def test_grads_accumulate_over_microbatches_with_no_recompile_and_no_graph_break():
    torch.compiler.reset()  # earlier tests compiled the same code: count this test's graphs
    counters = C.dynamo_counters()
    counters.clear()
    block, ref = _pair()
    driven = Driven(_compiled(block, "in-place"))
    for step in range(3):
        for mb in range(4):
            torch.manual_seed(10 * step + mb)
            x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
            ref(x).backward(g)
            driven.step(x, g).run()
        if step == 0:  # the first step compiles the forward and the backward once
            graphs = counters["stats"]["unique_graphs"]
    _assert_close(block, ref)
    assert graphs == 1
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled after the first step"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_outside_a_zbpipe_b_the_compiled_linear_is_an_ordinary_one():
    block, ref = _pair()
    driven = Driven(_compiled(block, "in-place"))
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    driven.step(x, g).run()  # a zbpipe microbatch first: the same graph serves both
    block.zero_grad(set_to_none=True)
    block(x).backward(g)  # plain training: the slot is empty
    ref(x).backward(g)
    _assert_close(block, ref)
    (dw,) = torch.autograd.grad(block(x).sum(), [block.up.weight])
    (ref_dw,) = torch.autograd.grad(ref(x).sum(), [ref.up.weight])
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-6)


def test_a_linear_used_twice_in_the_region_is_summed_correctly():
    # The compiled graph sums the two placeholders: zeros, so .grad is right without dropping.
    block, ref = _pair(Twice)
    driven = Driven(_compiled(block, "in-place"))
    for mb in range(3):
        torch.manual_seed(mb)
        x, g = torch.randn(5, 16), torch.randn(5, 16)
        ref(x).backward(g)
        store = driven.step(x, g)
        assert store.num_gemms == 2
        store.run()
    _assert_close(block, ref)
    assert route_of(block.lin.weight).alone is False  # summed in the graph: zeros each time


def test_inductor_compiled_block_defers_and_matches():
    block, ref = _pair()
    driven = Driven(_compiled(block, "in-place", backend="inductor"))
    for mb in range(2):
        torch.manual_seed(mb)
        x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
        ref(x).backward(g)
        store = driven.step(x, g)
        assert store.num_gemms == 2 and (mb or block.up.weight.grad is None)
        store.run()
    _assert_close(block, ref)
    # Each placeholder reached its AccumulateGrad untouched: later ones need no zeros.
    assert route_of(block.up.weight).alone and route_of(block.down.weight).alone


def test_autocast_bf16_grads_match_an_uncompiled_autocast_reference():
    block, ref = _pair()
    driven = Driven(_compiled(block, "in-place"))
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref(x)
    out.backward(g)
    store = WeightGradStore()
    driven.slot.store = store
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    store.deferring = True
    out.backward(g)
    driven.slot.store, store.deferring = None, False
    assert store.num_gemms == 2
    store.run()
    for (name, p), (_, q) in zip(block.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad.dtype == torch.float32, name
        # the same bf16 GEMMs on the same operands (aot_eager runs the traced ops as they are)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-2, msg=name)


def test_post_accumulate_hooks_of_compiled_linear_weights_fire_in_w_not_in_b():
    block, _ = _pair()
    driven = Driven(_compiled(block, "in-place"))
    fired: list[str] = []
    block.up.weight.register_post_accumulate_grad_hook(lambda p: fired.append("up"))
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    store = WeightGradStore()
    driven.slot.store = store
    out = block(x)
    store.deferring = True
    with post_accumulate_hooks_parked(patched_linears(block)) as parked:
        store.parked = parked
        out.backward(g)
    driven.slot.store, store.deferring = None, False
    assert fired == [] and block.up.weight.grad is None
    store.run()
    assert fired == ["up"] and block.up.weight.grad is not None
    block(x).backward(g)  # plain training: autograd fires it
    assert fired == ["up", "up"]


class Checkpointed(nn.Module):
    """torchtitan's order: the block is wrapped in non-reentrant checkpointing, then compiled
    (the recompute then happens inside the compiled backward, in B)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def test_checkpointed_then_compiled_block_defers_and_matches():
    block, ref = _pair()
    driven = Driven(_compiled(Checkpointed(block), "in-place"))
    for mb in range(2):
        torch.manual_seed(mb)
        x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
        ref(x).backward(g)
        store = driven.step(x, g)
        assert store.num_gemms == 2
        store.run()
    _assert_close(block, ref)


def test_a_placeholder_left_by_a_failed_b_is_not_taken_for_a_later_gradient():
    block, ref = _pair()
    driven = Driven(_compiled(block, "in-place"))
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    for _ in range(2):  # the placeholders are seen to arrive alone: later ones are uninitialized
        driven.step(x, g).run()
        ref(x).backward(g)
    route = route_of(block.up.weight)
    assert route.alone
    failed = WeightGradStore()  # a B that raised after the op made its placeholder
    route.make_placeholder(block.up.weight, failed)
    block(x).backward(g)  # plain training afterwards: an ordinary gradient, added
    ref(x).backward(g)
    _assert_close(block, ref)


class LlamaLike(nn.Module):
    """A Llama-style block (RMSNorm, causal attention, SwiGLU, two residuals): the attention
    projection's output gradient is the residual stream's, which inductor's backward then adds
    the attention branch's gradient into, in place."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, h // self.heads)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        z = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(z)) * self.up(z))


@pytest.mark.parametrize(
    "backend, checkpointed, copies",
    [("inductor", False, False), ("inductor", True, False), ("aot_eager", False, True)],
)
def test_w_long_after_b_reads_what_b_queued(monkeypatch, backend, checkpointed, copies):
    # B of three microbatches, then their W: the queued operands must outlive the compiled
    # backward that made them (inductor reuses its buffers once their last reader has run).
    # Inductor-compiled code calls the op's twin, whose operands inductor never reuses, and W
    # reads them uncopied; another backend's graph gets copies. Caches off and dynamo reset: a
    # graph compiled before the lowering existed (on disk, or by an earlier test for the same
    # forward) calls the copying op. Checkpointed then compiled (torchtitan's order), the
    # operands W reads are the recompute's, made inside inductor's backward: the same holds.
    from zbpipe.engines import compiled_linear

    torch._dynamo.reset()
    made = []
    monkeypatch.setattr(
        compiled_linear, "operand_copy", lambda t: made.append(t.shape) or t.clone()
    )
    block, ref = _pair(LlamaLike)
    with torch._inductor.config.patch(force_disable_caches=True):
        driven = Driven(
            _compiled(Checkpointed(block) if checkpointed else block, "in-place", backend=backend)
        )
        stores = []
        for mb in range(3):
            torch.manual_seed(mb)
            x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
            ref(x).backward(g)
            stores.append(driven.step(x, g))
    assert [store.num_gemms for store in stores] == [5, 5, 5]  # every Linear's GEMM waits for W
    for store in stores:
        store.run()
    _assert_close(block, ref)
    assert bool(made) == copies, made


def _dtensor_weights_case(rank: int, world: int, plan: str) -> dict[str, object]:
    """One compiled block with DTensor weights, driven as the seam drives a stage; its gradients
    against an unpatched, uncompiled copy's (plain tensors, one plain backward per microbatch).

    ``plan``: "replicate" (every parameter Replicate), "replicate-exact" (the same, W adding
    each product as AccumulateGrad does: ``ScheduleZBH1(exact=True)``'s store),
    "replicate-inductor" (compiled by inductor, not aot_eager: its lowering of the op), "tp"
    (``up`` column-wise and ``down`` row-wise split over the ranks with torch's tensor-parallel
    styles: the local products are the local shards of the weight gradients) or "rows"
    (replicated parameters, each rank a different half of the microbatch: the local products
    are partial sums, which W could not reduce, so the weight gradients come in B) or
    "fsdp-tp" ("tp", compiled, then under FSDP2 on a one-rank data-parallel mesh: FSDP2's
    unsharded parameters, DTensors over the tensor-parallel mesh, are the ones B and W see).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    fsdp = plan == "fsdp-tp"
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp")) if fsdp else None
    mesh = mesh_2d["tp"] if mesh_2d is not None else init_device_mesh("cpu", (world,))
    block, ref = _pair()
    if plan in ("tp", "fsdp-tp"):
        # DTensor outputs: the block's residual adds them to its DTensor input
        styles = {
            "up": ColwiseParallel(use_local_output=False),
            "down": RowwiseParallel(use_local_output=False),
        }
        parallelize_module(block, mesh, styles)
    for sub in block.modules():  # the rest (all of it under "replicate"): replicated
        for name, p in list(sub._parameters.items()):
            if not C.is_dtensor(p):
                dt = distribute_tensor(p.detach(), mesh, [Replicate()])
                sub._parameters[name] = nn.Parameter(dt)
    torch.compiler.reset()
    counters = C.dynamo_counters()
    counters.clear()
    backend = "inductor" if plan == "replicate-inductor" else "aot_eager"
    block = _compiled(block, "in-place", backend=backend)
    if mesh_2d is not None:  # compiled, then FSDP2 over it, torchtitan's order
        from torch.distributed.fsdp import fully_shard

        fully_shard(block, mesh=mesh_2d["dp"], reshard_after_forward=False)
        # gradients stay on the unsharded parameters (what a stage does between its B and W)
        block.set_requires_gradient_sync(False)
        block.set_reshard_after_backward(False)
    driven = Driven(block)
    queued, none_after_b = [], []
    for mb in range(3):
        torch.manual_seed(mb)
        x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
        # every rank gets the same microbatch (as tensor parallelism's ranks do), or its rows
        split = [Shard(0)] if plan == "rows" else [Replicate()]
        operands = (distribute_tensor(t, mesh, split) for t in (x, g))
        store = driven.step(*operands, exact=plan == "replicate-exact")
        queued.append(store.num_gemms)
        # FSDP2's unsharded parameters, on the module since its forward
        weights = (block.up.weight, block.down.weight)
        none_after_b.append([w.grad is None for w in weights])
        store.run()
        ref(x).backward(g)
    diffs = {
        name: (p.grad.full_tensor() - ref.get_parameter(name).grad).abs().max().item()
        for name, p in block.named_parameters()
    }
    return {
        "queued": queued,
        "none_after_b": none_after_b,
        "placements": [str(w.placements) for w in weights],
        "grad_placements": [str(w.grad.placements) for w in weights],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "diffs": diffs,
    }


def _dtensor_weights_cases(rank: int, world: int, plans: list[str]) -> list[dict[str, object]]:
    """Several :func:`_dtensor_weights_case` in one process group (starting ranks and warming
    dynamo up in each is most of a case's cost)."""
    return [_dtensor_weights_case(rank, world, plan) for plan in plans]


#: the plans run on one rank (a one-rank mesh) and on two
PLANS = {1: ["replicate", "replicate-exact", "replicate-inductor"],
         2: ["replicate", "tp", "fsdp-tp", "rows"]}  # fmt: skip


@pytest.fixture(scope="module")
def dtensor_runs() -> dict[tuple[str, int], list[dict[str, object]]]:
    """{(plan, world): per rank, what the case found}: one launch per world size."""
    from zbpipe.testing import run_ranks

    out = {}
    for world, plans in PLANS.items():
        per_rank = run_ranks(_dtensor_weights_cases, world, plans, timeout=600)
        for i, plan in enumerate(plans):
            out[plan, world] = [rank[i] for rank in per_rank]
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "plan, world",
    [
        ("replicate", 1),
        ("replicate", 2),
        ("replicate-exact", 1),
        ("replicate-inductor", 1),
        ("tp", 2),
        ("fsdp-tp", 2),
    ],
)
def test_compiled_linears_with_dtensor_weights_defer_their_gemms_to_w(dtensor_runs, plan, world):
    # A DTensor weight (torchtitan 0.3's, tensor parallelism's) reaches the op as its local
    # shard (AOTAutograd flattens DTensors); the op's sharding rule places the result as the
    # weight, W adds the local product into the local shard of a DTensor .grad.
    for found in dtensor_runs[plan, world]:
        assert found["queued"] == [2, 2, 2], found  # B queued both weight GEMMs, every microbatch
        # the first B left both weights without a gradient (W adds it); later ones accumulate
        assert found["none_after_b"][0] == [True, True], found
        assert found["graphs"] == 1 and found["breaks"] == 0, found  # no recompile, no break
        assert found["grad_placements"] == found["placements"], found
        worst = max(found["diffs"].values())
        assert worst < 1e-5, found


@pytest.mark.timeout(900)
def test_compiled_linears_with_rows_split_over_ranks_compute_their_weight_gradients_in_b(
    dtensor_runs,
):
    # Replicated weights, each rank half of each microbatch's rows: a rank's product is a
    # partial sum (the weight gradient is their reduction), which W cannot add on its own.
    for found in dtensor_runs["rows", 2]:
        assert found["queued"] == [0, 0, 0], found
        assert found["none_after_b"][0] == [False, False], found
        assert found["graphs"] == 1 and found["breaks"] == 0, found
        assert max(found["diffs"].values()) < 1e-5, found
