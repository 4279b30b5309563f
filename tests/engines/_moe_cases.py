"""Small MoE pieces for the experts tests: torchtitan 0.3's own modules at tiny sizes, a model
of one's own that writes its experts as ``torch.bmm`` / ``torch.einsum``, uneven routings.

torchtitan is imported inside the functions (the tests skip without it)."""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from zbpipe.engines.deferred import DeferredEngine

#: tokens per expert of the microbatches the tests run: uneven, with experts that get none
COUNTS = ([3, 0, 7, 2], [0, 0, 12, 0], [5, 4, 0, 3], [1, 9, 2, 0])
DIM, HIDDEN, EXPERTS = 8, 16, 4


def _init(m: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def grouped_experts(seed: int = 0) -> nn.Module:
    """torchtitan's ``GroupedExperts`` (4 experts, 8 -> 16 -> 8), random weights."""
    from torchtitan.models.common.moe import GroupedExperts

    cfg = GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS)
    return _init(cfg.build(), seed)


def moe_layer(seed: int = 0, top_k: int = 2) -> nn.Module:
    """torchtitan's ``MoE`` (router, token dispatch, ``GroupedExperts``, load-balancing counts)."""
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    init = {"weight": lambda p: None}
    cfg = make_moe_config(
        num_experts=EXPERTS,
        router=make_router_config(
            dim=DIM, num_experts=EXPERTS, gate_param_init=init, top_k=top_k, score_func="softmax"
        ),
        routed_experts=make_routed_experts_config(
            dim=DIM,
            hidden_dim=HIDDEN,
            num_experts=EXPERTS,
            top_k=top_k,
            param_init={n: (lambda p: None) for n in ("w1_EFD", "w2_EDF", "w3_EFD")},
            comm_backend="standard",
        ),
    )
    return _init(cfg.build(), seed)


class BatchedExperts(nn.Module):
    """Experts of one's own over tokens padded to a capacity: ``(E, C, D)`` rows, SwiGLU through
    a ``torch.bmm`` with one 3-D weight, an einsum with another, a matmul with a third, and one
    3-D weight used transposed (which zbpipe does not intercept: its gradient comes in B)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(EXPERTS, DIM, 2 * HIDDEN))
        self.down = nn.Parameter(torch.empty(EXPERTS, HIDDEN, DIM))
        self.mix = nn.Parameter(torch.empty(EXPERTS, DIM, DIM))
        self.back = nn.Parameter(torch.empty(EXPERTS, DIM, DIM))
        _init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        h = torch.einsum("ech,ehd->ecd", F.silu(gate) * up, self.down)
        h = h @ self.mix
        return torch.bmm(h, self.back.transpose(1, 2))


def routed_rows(counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert (``sum(counts)`` of them) and the tokens per expert."""
    torch.manual_seed(100 + seed)
    return torch.randn(sum(counts), DIM), torch.tensor(counts)


def engine_on(module: nn.Module) -> DeferredEngine:
    """A deferred engine attached to ``module`` as stage 0."""
    engine = DeferredEngine()
    engine.attach([types.SimpleNamespace(stage_index=0, submod=module)])
    engine.claim_linears()
    return engine


def split_step(engine: DeferredEngine, module: nn.Module, key: tuple[int, int], *args: Any) -> Any:
    """F then B of one microbatch through ``engine`` (the loss a fixed function of the output);
    returns (the inputs' gradient, the output). W is left to the caller."""
    x = args[0].clone().requires_grad_()
    with engine.forward_scope(key, None, fused=False):
        out = module(x, *args[1:])
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    (grad,) = engine.backward_input(key, [loss], None, [x], list, None)
    return grad, out


def fused_step(module: nn.Module, *args: Any) -> Any:
    x = args[0].clone().requires_grad_()
    out = module(x, *args[1:])
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    loss.backward()
    return x.grad, out


def twins(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    return module, copy.deepcopy(module)


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


class MoEBlock(nn.Module):
    """``x + moe(norm(x))`` with torchtitan's ``MoE`` (the shape of its blocks' MoE half)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.moe = moe_layer(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.moe(self.norm(x))
        return out


def moe_v_pipeline(rank: int, world: int, compiled: bool, m: int = 4) -> dict[str, Any]:
    """One rank holding a 2-stage V pipeline (ZBV, default arguments) of torchtitan MoE blocks
    (2 per stage; ``compiled``: each block compiled with ``fullgraph=True``, aot_eager) against
    an unpipelined eager copy run microbatch by microbatch: the largest gradient difference, the
    engine, how many expert weight gradients the W passes added, and whether the load-balancing
    counts (``tokens_per_expert_E``) a step adds equal the unpipelined model's (one forward per
    microbatch, as 1F1B). The second step's are compared: torch's metadata inference runs each
    stage's forward once more in the first step, on ``torch.empty`` inputs past stage 0 (so
    under any schedule, torch's 1F1B included, the first step's counts hold that forward's)."""
    from torch.distributed.pipelining import PipelineStage

    import zbpipe
    from zbpipe.engines import derived_ops

    in_w, added = [False], [0]
    add, run_w = derived_ops.DerivedProduct.add, DeferredEngine.backward_weight

    def counted_add(self: Any, *args: Any) -> Any:
        added[0] += in_w[0]
        return add(self, *args)

    def flagged_w(self: Any, key: Any) -> None:
        in_w[0] = True
        try:
            run_w(self, key)
        finally:
            in_w[0] = False

    derived_ops.DerivedProduct.add = counted_add  # type: ignore[method-assign]
    DeferredEngine.backward_weight = flagged_w  # type: ignore[method-assign]

    mods = [nn.Sequential(MoEBlock(2 * s), MoEBlock(2 * s + 1)) for s in range(2)]
    ref = copy.deepcopy(nn.Sequential(*mods))
    torch.manual_seed(7)
    x, tgt = torch.randn(2 * m, 4, DIM), torch.randn(2 * m, 4, DIM)
    losses = [F.mse_loss(ref(a), b) for a, b in zip(x.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    for mod in mods if compiled else ():
        for block in mod:
            block.compile(fullgraph=True, backend="aot_eager")
    stages = [PipelineStage(mods[s], s, 2, torch.device("cpu")) for s in range(2)]
    sched = zbpipe.ScheduleZBV(stages, m, loss_fn=F.mse_loss)

    def counts() -> list[torch.Tensor]:
        return [b.moe.tokens_per_expert_E.clone() for mod in mods for b in mod]

    for _ in range(2):
        before = counts()
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        sched.step(x, target=tgt)
    made = [a - b for a, b in zip(counts(), before, strict=True)]
    reference = [b.moe.tokens_per_expert_E for mod in ref for b in mod]
    counts_equal = all(torch.equal(a, b) for a, b in zip(made, reference, strict=True))
    worst = max(
        (p.grad - q.grad).abs().max().item()
        for s in range(2)
        for p, q in zip(mods[s].parameters(), ref[s].parameters(), strict=True)
    )
    return {"worst": worst, "counts_equal": counts_equal, "split": sched.split, "w_adds": added[0]}
