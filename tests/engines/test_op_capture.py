"""Expert weight gradients captured at the operation, whichever module calls it (issue 46).

Four ways a model reaches its experts' GEMMs, none of which zbpipe reads the source of:
torchtitan 0.3's ``GroupedExperts``; a module shaped as torchtitan main's grouped linear
(weight ``(E, out, in)``, ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)``, fp32); a
``GroupedExperts`` subclass with a forward of its own; a Hugging Face-style loop over the
experts that were hit, ``F.linear`` on ``w[e]``. Each runs microbatches whose routings leave
some experts without a token, eager and compiled (``aot_eager``, ``fullgraph=True``): B must
leave every expert weight's ``.grad`` as it was, W must set it, and the gradients, outputs and
input gradients must be bitwise those of the same module's fused backward (the reference: an
unpatched twin through ``loss.backward()``; compiled, compiled the same way).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.engines import _moe_cases as cases
from zbpipe.engines.expert_patch import patched_experts

pytest.importorskip("torchtitan.models.common.moe")

E, D, H = cases.EXPERTS, cases.DIM, cases.HIDDEN


class GroupedLinear(nn.Module):
    """torchtitan main's shape: one weight ``(E, out, in)``, grouped GEMM on its transpose."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(E, d_out, d_in) * 0.3).to(dtype))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)


class GroupedLinearExperts(nn.Module):
    """SwiGLU experts built of three :class:`GroupedLinear` children whose weights are ``dtype``
    (compiled: bf16, the only dtype the grouped GEMM's meta function takes on CPU)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w1, self.w3 = GroupedLinear(D, H, dtype), GroupedLinear(D, H, dtype)
        self.w2 = GroupedLinear(H, D, dtype)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        x = x.to(self.w1.weight.dtype)
        return self.w2(F.silu(self.w1(x, offs)) * self.w3(x, offs), offs).float()


def other_forward_experts() -> nn.Module:
    """A ``GroupedExperts`` subclass whose forward differs from torchtitan's (GELU, ``swapaxes``,
    the casts after the transpose)."""
    from torchtitan.models.common.moe import GroupedExperts

    class GeluExperts(GroupedExperts):
        def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            xb = x.bfloat16()
            w1 = self.w1_EFD.swapaxes(1, 2).bfloat16()
            h = F.gelu(torch._grouped_mm(xb, w1, offs=offs))
            h = h * torch._grouped_mm(xb, self.w3_EFD.bfloat16().transpose(-2, -1), offs=offs)
            w2 = self.w2_EDF.transpose(-1, -2).to(torch.bfloat16)
            return torch._grouped_mm(h, w2, offs=offs).float()

    m = cases.grouped_experts()
    m.__class__ = GeluExperts
    return m


class LoopExperts(nn.Module):
    """Hugging Face-style experts: 3-D ``gate_up_proj`` / ``down_proj``, a loop over the experts
    that got tokens (``masked``: over every expert, masking rows, which compiles whole)."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.masked = masked
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * H, D) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, D, H) * 0.3)

    def _expert(self, x: torch.Tensor, e: int | torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ids = torch.repeat_interleave(torch.arange(E), counts)
        if self.masked:
            out = torch.zeros_like(x)
            for e in range(E):
                out = out + (ids == e).unsqueeze(-1).to(x.dtype) * self._expert(x, e)
            return out
        out = torch.zeros_like(x)
        for e in torch.unique(ids):  # 0-d index tensors, as HF's loop over the hit experts
            (rows,) = torch.where(ids == e)
            out = out.index_add(0, rows, self._expert(x[rows], e))
        return out


SHAPES = {
    "torchtitan_0.3": cases.grouped_experts,
    "grouped_linear": GroupedLinearExperts,
    "other_forward": other_forward_experts,
    "hf_loop": lambda: LoopExperts(masked=False),
}


def _check(name: str, build, compiled: bool, exact: bool = False) -> None:
    torch.manual_seed(0)
    fused, split = cases.twins(build())
    if compiled:
        fused.compile(fullgraph=True, backend="aot_eager")
        split.compile(fullgraph=True, backend="aot_eager")
    engine = cases.engine_on(split)
    engine.exact = exact
    assert patched_experts(split), name
    for mb, counts in enumerate(cases.COUNTS):  # experts without a token in every routing
        args = cases.routed_rows(counts, mb)
        gx_ref, out_ref = cases.fused_step(fused, *args)
        before = cases.grads(split)
        gx, out = cases.split_step(engine, split, (0, mb), *args)
        assert torch.equal(out, out_ref) and torch.equal(gx, gx_ref), (name, mb)
        for n, g in cases.grads(split).items():  # B left every expert weight alone
            assert (g is None and before[n] is None) or torch.equal(g, before[n]), (name, mb, n)
        engine.backward_weight((0, mb))
        for (n, p), q in zip(fused.named_parameters(), split.parameters(), strict=True):
            assert q.grad is not None and torch.equal(q.grad, p.grad), (name, mb, n)


@pytest.mark.parametrize("name", list(SHAPES))
def test_weight_grads_wait_for_w_and_equal_the_fused_ones_eager(name):
    _check(name, SHAPES[name], compiled=False)


def test_weight_grads_wait_for_w_and_equal_the_fused_ones_compiled():
    torch._dynamo.reset()
    # the Hugging Face loop compiled: over every expert, rows masked (a loop over the experts
    # torch.unique found has data-dependent shapes, which fullgraph=True refuses, zbpipe or not)
    compiled = dict(
        SHAPES,
        grouped_linear=lambda: GroupedLinearExperts(torch.bfloat16),
        hf_loop=lambda: LoopExperts(masked=True),
    )
    for name, build in compiled.items():  # one test: the compiles are the slow part
        _check(name, build, compiled=True)


def test_an_expert_used_twice_in_a_microbatch_sums_as_autograd_does():
    # the same expert's slice twice in one forward: with exact=True its two products are summed
    # before the add into .grad, as autograd's input buffer sums them (the default engine adds
    # them one at a time: the same sum up to rounding, WeightGradStore's docstring)
    class Twice(LoopExperts):
        def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return self._expert(x, 1) + self._expert(x * 2, 1) + self._expert(x, 3)

    _check("twice", lambda: Twice(masked=False), compiled=False, exact=True)
