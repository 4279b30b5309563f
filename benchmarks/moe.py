"""MoE experts' weight gradients in W: torchtitan 0.3's own MoE blocks, split and pipelined.

The blocks are torchtitan 0.3.0's, built from its configs: Qwen3 ``debugmodel_moe`` (64
experts, top-8, ``GroupedExperts`` through ``torch._grouped_mm``) and DeepSeek-V3
``debugmodel`` (8 experts, top-3, two shared experts, MLA attention), each with torchtitan's
``ScaledDotProductAttention`` in place of FlexAttention (which has no CPU backward), sequence
128, one sequence per microbatch, the loss a mean square on the blocks' output.

``--part split`` (one process, one thread, thread CPU time of each pass): 2 blocks (layers 1-2:
MoE blocks in both models) eager, and each block compiled in place with ``fullgraph=True``
(inductor). Per engine (the one ``split="auto"`` chose, the deferred one, and, eager only, the
graph one, which refuses compiled blocks): B then W of one microbatch through the engine, as
the schedules call it, against the fused backward of an unpatched copy with the same weights
(what torch's 1F1B runs): W / (B + W), (B + W) / fused, and the largest gradient difference
against the fused backward's. On a step's first microbatch (no ``.grad`` yet) and on the others.

``--part pipeline`` (2 gloo ranks, one thread each): the 8 Qwen3 MoE debug blocks, 2 per chunk
(4 chunks: one per rank for the loop placement of torch's Schedule1F1B and zbpipe's ZBH1 with
2 chunks per stage, 2 per rank for ZBV), m = 4, eager and each block compiled (``torch.compile``
wrappers sharing the eager blocks' weights). torch's Schedule1F1B runs an unpatched copy. Each
step time (max over ranks) is paired with torch's of the same mode and repetition, repetitions
interleaved. ``1F1B`` is zbpipe's Schedule1F1BMulti (fused backwards; after a stage's first
of the step they run through the deferred engine as B then W at once). ``ZBH1@graph`` /
``ZBV@graph`` (eager): the graph engine, which ``split="auto"`` chose on these blocks before
experts could be deferred. From zbpipe's tracer: the bubble rate, W's share of B + W, the
per-rank sums of F, B, W and BW; and each rank's minor page faults per step.

Run:  PYTHONPATH=src python benchmarks/moe.py [--part split|pipeline|all] [--reps 6]
Writes benchmarks/results/moe_<part>.json (``--out``); docs/results/moe.md records what we saw.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

MODELS = ("qwen3", "deepseek_v3")


@dataclass(frozen=True, kw_only=True)
class Config:
    reps: int = 6
    seq: int = 128
    microbatches: int = 4
    schedules: tuple[str, ...] = ("torch:1F1B", "1F1B", "ZBH1", "ZBV", "ZBH1@graph", "ZBV@graph")


def build_blocks(model: str, layers: range, seed: int = 0) -> list[torch.nn.Module]:
    """torchtitan 0.3.0's blocks ``layers`` of ``model``, SDPA attention, initialised."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if model == "qwen3":
        from torchtitan.models.qwen3 import model_registry

        cfg = model_registry("debugmodel_moe").model
    else:
        from torchtitan.models.deepseek_v3 import model_registry

        cfg = model_registry("debugmodel").model
    torch.manual_seed(seed)
    out = []
    for i in layers:
        layer = cfg.layers[i]
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        block = layer.build()
        block.init_states()
        out.append(block)
    return out


class Chunk(torch.nn.Module):
    """Blocks called as torchtitan's decoder calls them (no mask: SDPA is causal; no positions)."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, None, None)
        return h


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


# ----------------------------------------------------------------------------- split cost
def split_cost(model: str, compiled: bool, reps: int, seq: int) -> dict[str, Any]:
    """B, W and the fused backward of 2 blocks, per engine (see the module docstring)."""
    from zbpipe.engines import choose_engine

    torch.set_num_threads(1)
    fused_mod = Chunk(build_blocks(model, range(1, 3)))
    engines = ["auto", "deferred"] + ([] if compiled else ["graph"])
    mods = {name: copy.deepcopy(fused_mod) for name in engines}
    for mod in (fused_mod, *mods.values()) if compiled else ():
        for block in mod.blocks:
            block.compile(fullgraph=True)
    stage = {n: types.SimpleNamespace(stage_index=0, submod=m) for n, m in mods.items()}
    runs = {n: choose_engine(n, [stage[n]], "moe.py") for n in engines}
    for n, engine in runs.items():
        engine.attach([stage[n]])
    torch.manual_seed(1)
    x0, g = torch.randn(1, seq, 256), torch.randn(1, seq, 256)
    mb = [0]

    faults: dict[str, int] = {}

    def clock(fn: Any, what: str = "") -> float:
        f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.thread_time()
        fn()
        t = time.thread_time() - t
        faults[what] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
        return t

    def fused(accumulate: bool) -> dict[str, float]:
        fused_mod.zero_grad(set_to_none=not accumulate)
        out = fused_mod(x0.clone().requires_grad_())
        t = clock(lambda: out.backward(g), "fused")
        return {"fused": t, "fused_faults": faults["fused"]}

    def split(name: str, accumulate: bool) -> dict[str, float]:
        mod, engine = mods[name], runs[name]
        engine.claim_linears()
        mod.zero_grad(set_to_none=not accumulate)
        key = (0, mb[0])
        mb[0] += 1
        x = x0.clone().requires_grad_()
        with engine.forward_scope(key, None, fused=False):
            out = mod(x)
        t_b = clock(lambda: engine.backward_input(key, [out], [g], [x], mod_params(mod), None), "B")
        t_w = clock(lambda: engine.backward_weight(key), "W")
        return {"B": t_b, "W": t_w, "B_faults": faults["B"], "W_faults": faults["W"]}

    for _ in range(2):  # compile, warm up
        for acc in (False, True):
            fused(acc)
            for n in engines:
                split(n, acc)
    worst = _grad_differences(fused, split, fused_mod, mods)
    samples: dict[bool, list[dict[str, dict[str, float]]]] = {False: [], True: []}
    for rep in range(reps):
        for acc in (rep % 2 == 1, rep % 2 == 0):
            order = ["fused", *engines]
            order = order[rep % len(order) :] + order[: rep % len(order)]
            samples[acc].append({n: fused(acc) if n == "fused" else split(n, acc) for n in order})
    from results_io import paired_ratios

    out: dict[str, Any] = {"auto_chose": runs["auto"].name, "max_grad_diff": worst}
    for key, acc in (("first_microbatch", False), ("accumulating", True)):
        got = samples[acc]
        res: dict[str, Any] = {
            "fused_ms": 1e3 * statistics.median(s["fused"]["fused"] for s in got),
            "fused_page_faults": statistics.median(s["fused"]["fused_faults"] for s in got),
        }
        for n in engines:
            bw = [s[n]["B"] + s[n]["W"] for s in got]
            res[n] = {
                "b_ms": 1e3 * statistics.median(s[n]["B"] for s in got),
                "w_ms": 1e3 * statistics.median(s[n]["W"] for s in got),
                "w_share": statistics.median(s[n]["W"] / (s[n]["B"] + s[n]["W"]) for s in got),
                "b_plus_w_over_fused": paired_ratios(bw, [s["fused"]["fused"] for s in got]),
                "b_page_faults": statistics.median(s[n]["B_faults"] for s in got),
                "w_page_faults": statistics.median(s[n]["W_faults"] for s in got),
            }
        out[key] = res
    return out


def mod_params(mod: torch.nn.Module) -> Any:
    return lambda: [p for p in mod.parameters() if p.requires_grad]


def _grad_differences(fused: Any, split: Any, fused_mod: Any, mods: dict[str, Any]) -> dict:
    """Largest |gradient difference| against the fused backward, per engine (both runs from
    ``.grad`` None), and whether every gradient is bitwise equal."""
    fused(False)
    out = {}
    for n, mod in mods.items():
        split(n, False)
        diffs = [
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(fused_mod.parameters(), mod.parameters(), strict=True)
            if p.grad is not None
        ]
        same = all(
            torch.equal(p.grad, q.grad)
            for p, q in zip(fused_mod.parameters(), mod.parameters(), strict=True)
            if p.grad is not None
        )
        out[n] = {"max_abs": max(diffs), "bitwise_equal": same}
    return out


def print_split(what: str, res: dict) -> None:
    print(f"{what}: auto chose {res['auto_chose']}; grads vs fused {res['max_grad_diff']}")
    for key in ("first_microbatch", "accumulating"):
        r = res[key]
        for n, v in r.items():
            if not isinstance(v, dict):
                continue
            q = v["b_plus_w_over_fused"]
            print(
                f"  {key:16s} {n:8s} W/(B+W) {v['w_share']:.3f}  (B+W)/fused {q['median']:.3f} "
                f"({q['min']:.3f}-{q['max']:.3f})  B {v['b_ms']:.1f} ms  W {v['w_ms']:.1f} ms  "
                f"fused {r['fused_ms']:.1f} ms; page faults B {v['b_page_faults']:.0f} "
                f"W {v['w_page_faults']:.0f} fused {r['fused_page_faults']:.0f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=Config().reps)
    ap.add_argument("--part", choices=("split", "pipeline", "all"), default="all")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--schedules", default=",".join(Config().schedules))
    ap.add_argument("--out", help="default: benchmarks/results/moe_<part>.json")
    args = ap.parse_args()
    cfg = Config(reps=args.reps, schedules=tuple(args.schedules.split(",")))
    data: dict[str, Any] = {"config": asdict(cfg), "part": args.part}
    if args.part in ("split", "all"):
        for model in args.models.split(","):
            for mode in ("eager", "compiled"):
                r = data[f"split_{model}_{mode}"] = split_cost(
                    model, mode == "compiled", cfg.reps, cfg.seq
                )
                print_split(f"{model} {mode}", r)
    if args.part in ("pipeline", "all"):
        from moe_pipeline import pipeline

        data["pipeline"] = pipeline(cfg)
    from results_io import write_result

    write_result("", data, path=args.out or f"benchmarks/results/moe_{args.part}.json")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
