"""W's share of the backward on expert modules: the deferred engine against the graph engine.

Issue 46 asks that the op-level capture (``engines/derived_ops.py``) leave W at least 0.9x the
share of the backward the graph engine gives it on the same stage. The four expert shapes of
tests/engines/test_op_capture.py, eager, at a bench size: torchtitan 0.3's ``GroupedExperts``
(``torch._grouped_mm``, bf16), a module shaped as torchtitan main's grouped linear (weight
``(E, out, in)``, the GEMM on its transpose, fp32), a ``GroupedExperts`` subclass with a
forward of its own (GELU, ``swapaxes``, casts after the transpose, bf16) and a Hugging
Face-style loop over the experts that got tokens (``F.linear`` on ``w[e]``, fp32). Tokens are
routed unevenly, one expert getting none.

One process, one thread, thread CPU time (``time.thread_time``) of B and of W of one
microbatch through each engine, as the schedules call them, on a microbatch after the step's
first (``.grad`` already set). Each engine runs its own copy of the module; repetitions
interleave the engines. Reported: the median of W / (B + W) per engine, the deferred share over
the graph share (paired per repetition: median, min, max), and the largest difference of each
engine's gradients from a fused backward's. Beside them: a fused backward's time, the input
gradient's alone (no weight needing a gradient: the least any B costs), the deferred share's
bound that follows (its W over that least B plus its W), and per engine the share of W's
profiled self CPU time that is GEMMs (one profiled microbatch; the rest: casts, zero-padded
copies, adds).

Run:  PYTHONPATH=src python benchmarks/expert_w_share.py [--reps 8] [--tokens 512]
Writes benchmarks/results/expert_w_share.json (``--out``); docs/results/moe.md records it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

E, D, H = 8, 128, 256  # experts, model dim, expert hidden dim
COUNTS_SHARE = (3, 0, 7, 2, 5, 1, 4, 2)  # tokens per expert, relative (expert 1 gets none)


class GroupedLinear(nn.Module):
    """torchtitan main's shape: one weight ``(E, out, in)``, grouped GEMM on its transpose."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, d_out, d_in) * d_in**-0.5)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)


class GroupedLinearExperts(nn.Module):
    """SwiGLU experts of three :class:`GroupedLinear` children (fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = GroupedLinear(D, H), GroupedLinear(D, H), GroupedLinear(H, D)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return self.w2(F.silu(self.w1(x, offs)) * self.w3(x, offs), offs)


def grouped_experts() -> nn.Module:
    """torchtitan 0.3's ``GroupedExperts`` at the bench size."""
    from torchtitan.models.common.moe import GroupedExperts

    m = GroupedExperts.Config(dim=D, hidden_dim=H, num_experts=E).build()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return m


def other_forward_experts() -> nn.Module:
    """A ``GroupedExperts`` subclass whose forward is not torchtitan's."""
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

    m = grouped_experts()
    m.__class__ = GeluExperts
    return m


class LoopExperts(nn.Module):
    """Hugging Face-style experts: a loop over the experts that got tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * H, D) * D**-0.5)
        self.down_proj = nn.Parameter(torch.randn(E, D, H) * H**-0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ids = torch.repeat_interleave(torch.arange(E), counts)
        out = torch.zeros_like(x)
        for e in torch.unique(ids):
            (rows,) = torch.where(ids == e)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out.index_add(0, rows, F.linear(F.silu(gate) * up, self.down_proj[e]))
        return out


SHAPES: dict[str, Callable[[], nn.Module]] = {
    "torchtitan_0.3": grouped_experts,
    "grouped_linear": GroupedLinearExperts,
    "other_forward": other_forward_experts,
    "hf_loop": LoopExperts,
}
ENGINES = ("deferred", "graph")


def measure(build: Callable[[], nn.Module], tokens: int, reps: int) -> dict[str, Any]:
    """B and W per engine on one module (see the module docstring)."""
    from zbpipe.engines import choose_engine

    torch.manual_seed(0)
    ref = build()
    mods = {n: copy.deepcopy(ref) for n in ENGINES}
    stages = {n: types.SimpleNamespace(stage_index=0, submod=m) for n, m in mods.items()}
    engines = {n: choose_engine(n, [stages[n]], "expert_w_share.py") for n in ENGINES}
    for n, engine in engines.items():
        engine.attach([stages[n]])
        engine.claim_linears()
    total = sum(COUNTS_SHARE)
    counts = torch.tensor([tokens * c // total for c in COUNTS_SHARE])
    torch.manual_seed(1)
    x0 = torch.randn(int(counts.sum()), D)
    g = torch.randn(int(counts.sum()), D)
    mb = [0]

    def split(name: str, around_w: Any = None) -> tuple[float, float]:
        mod, engine = mods[name], engines[name]
        key = (0, mb[0])
        mb[0] += 1
        x = x0.clone().requires_grad_()
        with engine.forward_scope(key, None, fused=False):
            out = mod(x, counts)
        params = [p for p in mod.parameters() if p.requires_grad]
        t = time.thread_time()
        engine.backward_input(key, [out], [g], [x], lambda: params, None)
        t_b = time.thread_time() - t
        t = time.thread_time()
        with around_w or contextlib.nullcontext():
            engine.backward_weight(key)
        return t_b, time.thread_time() - t

    # one microbatch each against a fused backward (gradients), then one more to warm up: the
    # timed microbatches all accumulate into .grad
    ref(x0.clone().requires_grad_(), counts).backward(g)
    worst = {}
    for n in ENGINES:
        split(n)
        worst[n] = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(mods[n].parameters(), ref.parameters(), strict=True)
        )
        split(n)
    bare = copy.deepcopy(ref).requires_grad_(False)

    def whole(fused: bool) -> float:
        """A fused backward (``fused``), or the input gradient alone with no weight needing
        one: the least any B can cost on this module."""
        x = x0.clone().requires_grad_()
        out = (ref if fused else bare)(x, counts)
        t = time.thread_time()
        if fused:
            out.backward(g)
        else:
            torch.autograd.grad(out, x, g)
        return time.thread_time() - t

    whole(True), whole(False)
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in ENGINES}
    fused_s: list[float] = []
    input_s: list[float] = []
    for rep in range(reps):
        for n in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            samples[n].append(split(n))
        fused_s.append(whole(True))
        input_s.append(whole(False))
    out: dict[str, Any] = {"tokens_per_expert": counts.tolist(), "max_grad_diff": worst}
    out["fused_ms"] = 1e3 * statistics.median(fused_s)
    out["input_grad_only_ms"] = 1e3 * statistics.median(input_s)
    for n in ENGINES:
        out[n] = {
            "b_ms": 1e3 * statistics.median(b for b, _ in samples[n]),
            "w_ms": 1e3 * statistics.median(w for _, w in samples[n]),
            "w_share": statistics.median(w / (b + w) for b, w in samples[n]),
            "w_gemm_fraction": _gemm_fraction(functools.partial(split, n)),
        }
    # the most W / (B + W) the deferred engine could reach with its W as it is: B at the
    # input gradient's own cost
    w_d = out["deferred"]["w_ms"]
    out["deferred_share_bound"] = w_d / (out["input_grad_only_ms"] + w_d)
    ratios = [
        (wd / (bd + wd)) / (wg / (bg + wg))
        for (bd, wd), (bg, wg) in zip(samples["deferred"], samples["graph"], strict=True)
    ]
    out["deferred_share_over_graph"] = {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }
    return out


def _gemm_fraction(run: Callable[..., tuple[float, float]]) -> float:
    """The share of W's profiled self CPU time spent in GEMMs (``mm``, ``bmm``, grouped): the
    rest is what W does besides the weight-gradient products (casts, zero-padded copies, adds)."""
    from torch.profiler import ProfilerActivity, profile

    gemms = ("aten::mm", "aten::bmm", "aten::_grouped_mm", "aten::addmm")
    prof = profile(activities=[ProfilerActivity.CPU])
    run(around_w=prof)  # one microbatch, W alone profiled
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return sum(e.self_cpu_time_total for e in events if e.key in gemms) / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="routed rows per microbatch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from results_io import write_result

    res = {name: measure(build, args.tokens, args.reps) for name, build in SHAPES.items()}
    print(
        "| shape | deferred W/(B+W) | graph W/(B+W) | deferred / graph (min-max) | B ms d/g |"
        " W ms d/g | W GEMM share d/g | fused ms | input grad ms | deferred share bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        q = r["deferred_share_over_graph"]
        print(
            f"| {name} | {r['deferred']['w_share']:.3f} | {r['graph']['w_share']:.3f} | "
            f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}) | "
            f"{r['deferred']['b_ms']:.2f} / {r['graph']['b_ms']:.2f} | "
            f"{r['deferred']['w_ms']:.2f} / {r['graph']['w_ms']:.2f} | "
            f"{r['deferred']['w_gemm_fraction']:.2f} / {r['graph']['w_gemm_fraction']:.2f} | "
            f"{r['fused_ms']:.2f} | {r['input_grad_only_ms']:.2f} | "
            f"{r['deferred_share_bound']:.3f} |"
        )
    cfg = {"reps": args.reps, "tokens": args.tokens, "experts": E, "dim": D, "hidden": H}
    path = write_result("expert_w_share", {"config": cfg, "shapes": res}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
