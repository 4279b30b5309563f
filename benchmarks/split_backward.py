"""Cost of the split backward (B + W) against the fused backward, zbpipe's and torch's split.

A stage is a stack of Linear+GELU layers. For each hidden size and for a middle stage (input
requires grad) and stage 0 (it does not), one repetition times, on fresh forwards:
  fused    torch.autograd.backward                      (B_full)
  zbpipe   backward_input, then WeightGrad.run           (B, W)
  torch    stage_backward_input, stage_backward_weight   (I, W) on a middle stage; on stage 0
           what torch's PipelineStage does there: I is skipped and W is a full stage_backward
           (stage_backward_input/weight alone leave stage 0's parameters without gradients)
The three are interleaved within each repetition; medians (and min/max) over repetitions.

    PYTHONPATH=src python benchmarks/split_backward.py [--reps 15] [--clock cpu|wall] [--out PATH]

``--overhead`` instead measures W's engine overhead where matmuls are tiny (what dominates on a
GPU): W and B against the fused backward, and the ``autograd.grad`` calls W makes, on residual
stacks of 16-wide layers (a chain: x + gelu(lin(x)); and gated: x + down(silu(gate(x)) * up(x)),
whose gate/up projections W batches into one call) and on a TinyGPT transformer-block stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)

from zbpipe.backward import backward_input

CONFIGS = [(256, 4096), (1024, 1024)]  # (hidden, rows): one layer's matmul takes several ms


def _stack(hidden: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*mods)


def _forward(m: nn.Module, x0: torch.Tensor, first: bool):
    x = x0.detach().clone().requires_grad_(not first)
    return m(x), x


# Thread CPU time is the default clock: with one intra-op thread it is the compute a pass costs,
# and it does not count time the core was taken by another process (this 2-core machine is shared).
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def _timer(clock):
    def timed(fn) -> float:
        t = clock()
        fn()
        return clock() - t

    return timed


def _one_rep(m, x0, g, first, clock) -> dict[str, float]:
    _time = _timer(clock)
    params = list(m.parameters())
    r: dict[str, float] = {}
    m.zero_grad(set_to_none=True)
    out, x = _forward(m, x0, first)
    r["fused"] = _time(lambda: torch.autograd.backward([out], [g]))
    del out, x

    m.zero_grad(set_to_none=True)
    out, x = _forward(m, x0, first)
    holder = {}
    r["zb_B"] = _time(lambda: holder.setdefault("w", backward_input([out], [g], [x], params)[1]))
    r["zb_W"] = _time(holder["w"].run)
    del out, x, holder

    m.zero_grad(set_to_none=True)
    out, x = _forward(m, x0, first)
    holder = {}
    if (
        first
    ):  # torch/distributed/pipelining/stage.py: backward_one_chunk / backward_weight_one_chunk
        r["torch_I"] = _time(lambda: None)
        r["torch_W"] = _time(lambda: stage_backward([out], [g], [x]))
    else:
        r["torch_I"] = _time(
            lambda: holder.setdefault("pg", stage_backward_input([out], [g], [x], iter(params))[1])
        )
        r["torch_W"] = _time(lambda: stage_backward_weight(iter(params), holder["pg"]))
    del out, x, holder
    return r


def _check_equal(m: nn.Module, x0: torch.Tensor, g: torch.Tensor, first: bool) -> None:
    """The timed zbpipe path computes the fused gradients (bitwise: no weight reuse here)."""
    params = list(m.parameters())
    m.zero_grad(set_to_none=True)
    out, x = _forward(m, x0, first)
    torch.autograd.backward([out], [g])
    ref = [p.grad for p in params]
    m.zero_grad(set_to_none=True)
    out, x = _forward(m, x0, first)
    backward_input([out], [g], [x], params)[1].run()
    if not all(torch.equal(p.grad, r) for p, r in zip(params, ref)):
        raise RuntimeError("zbpipe's split gradients differ from the fused backward")
    m.zero_grad(set_to_none=True)


def run(reps: int, layers: int, warmup: int, clock) -> list[dict]:
    rows = []
    for hidden, rows_n in CONFIGS:
        torch.manual_seed(0)
        m = _stack(hidden, layers)
        x0 = torch.randn(rows_n, hidden)
        g = torch.randn(rows_n, hidden)
        for first in (False, True):
            _check_equal(m, x0, g, first)
            for _ in range(warmup):
                _one_rep(m, x0, g, first, clock)
            samples = [_one_rep(m, x0, g, first, clock) for _ in range(reps)]
            ratio_zb = [(s["zb_B"] + s["zb_W"]) / s["fused"] for s in samples]
            ratio_t = [(s["torch_I"] + s["torch_W"]) / s["fused"] for s in samples]
            med = {k: statistics.median(s[k] for s in samples) * 1e3 for k in samples[0]}
            rows.append(
                {
                    "hidden": hidden,
                    "rows": rows_n,
                    "layers": layers,
                    "stage": "stage0" if first else "middle",
                    "reps": reps,
                    "median_ms": med,
                    "zbpipe_ratio": _stats(ratio_zb),
                    "torch_ratio": _stats(ratio_t),
                    "zbpipe_B_share": med["zb_B"] / (med["zb_B"] + med["zb_W"]),
                    "torch_I_share": med["torch_I"] / (med["torch_I"] + med["torch_W"]),
                }
            )
    return rows


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _print(rows: list[dict]) -> None:
    head = (
        f"{'hidden':>6} {'rows':>5} {'stage':>6} | {'fused':>7} {'zb B':>7} {'zb W':>7} "
        f"{'zb ratio':>18} {'B share':>7} | {'torch I':>7} {'torch W':>7} {'torch ratio':>18} "
        f"{'I share':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        t = r["median_ms"]
        zr, tr = r["zbpipe_ratio"], r["torch_ratio"]
        print(
            f"{r['hidden']:>6} {r['rows']:>5} {r['stage']:>6} | {t['fused']:7.2f} {t['zb_B']:7.2f} "
            f"{t['zb_W']:7.2f} {zr['median']:6.3f} [{zr['min']:.2f},{zr['max']:.2f}] "
            f"{r['zbpipe_B_share']:7.2f} | {t['torch_I']:7.2f} {t['torch_W']:7.2f} "
            f"{tr['median']:6.3f} [{tr['min']:.2f},{tr['max']:.2f}] {r['torch_I_share']:7.2f}"
        )
    print("times: median ms; ratio = (B+W)/B_full median [min,max]; share = B/(B+W)")


class _Residual(nn.Module):
    def __init__(self, hidden: int, layers: int, gated: bool) -> None:
        super().__init__()
        n = 3 if gated else 1
        self.lins = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n * layers))
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = nn.functional
        if not self.gated:
            for lin in self.lins:
                x = x + f.gelu(lin(x))
            return x
        for i in range(0, len(self.lins), 3):
            gate, up, down = self.lins[i : i + 3]
            x = x + down(f.silu(gate(x)) * up(x))
        return x


def _overhead_cases():
    from zbpipe.testing.models import TinyGPTConfig, build_stages

    for layers in (8, 32, 64):
        yield f"chain L={layers}", _Residual(16, layers, False), (8, 16)
    for layers in (8, 32):
        yield f"gated L={layers}", _Residual(16, layers, True), (8, 16)
    cfg = TinyGPTConfig(hidden=256, seq=64, heads=4, blocks_per_stage=4)
    yield "gpt h256 4 blocks", build_stages(cfg, 2)[1], (4, 64, 256)


def run_overhead(reps: int, warmup: int, clock) -> list[dict]:
    """Median B, W and fused times (ms) and W's autograd.grad calls, per case."""
    _time = _timer(clock)
    real_grad = torch.autograd.grad
    rows = []
    for name, m, shape in _overhead_cases():
        params = list(m.parameters())
        samples, calls = [], 0
        for rep in range(warmup + reps):
            x = torch.randn(shape, requires_grad=True)
            out = m(x)
            g = torch.randn_like(out)
            r = {"fused": _time(lambda: torch.autograd.backward([out], [g]))}
            m.zero_grad(set_to_none=True)
            out = m(x)
            holder = {}
            r["B"] = _time(
                lambda: holder.setdefault("w", backward_input([out], [g], [x], params)[1])
            )
            counted = [0]

            def counting(*a, **k):
                counted[0] += 1
                return real_grad(*a, **k)

            torch.autograd.grad = counting
            try:
                r["W"] = _time(holder["w"].run)
            finally:
                torch.autograd.grad = real_grad
            calls = counted[0]
            m.zero_grad(set_to_none=True)
            del out, holder
            if rep >= warmup:
                samples.append(r)
        med = {k: statistics.median(s[k] for s in samples) * 1e3 for k in samples[0]}
        rows.append({"case": name, "median_ms": med, "w_calls": calls, "reps": reps})
        print(
            f"{name:>18} | fused {med['fused']:7.2f} | B {med['B']:7.2f} | W {med['W']:7.2f} | "
            f"W/fused {med['W'] / med['fused']:5.2f} | W calls {calls}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument(
        "--out", default=None, help="default: benchmarks/results/split_backward[_overhead].json"
    )
    ap.add_argument("--overhead", action="store_true", help="measure W's engine overhead (above)")
    args = ap.parse_args()
    if args.threads != 1 and args.clock == "cpu":
        raise ValueError("--clock cpu measures one thread: use --threads 1 or --clock wall")
    torch.set_num_threads(args.threads)
    if args.overhead:
        rows = run_overhead(args.reps, args.warmup, CLOCKS[args.clock])
    else:
        rows = run(args.reps, args.layers, args.warmup, CLOCKS[args.clock])
        _print(rows)
    suffix = "_overhead" if args.overhead else ""
    out = Path(args.out or f"benchmarks/results/split_backward{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": args.threads,
                "clock": args.clock,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
