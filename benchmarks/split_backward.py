"""What splitting the backward costs: B + W of each engine against one fused backward.

Zero bubble only pays if B + W costs what the fused backward costs. For each stage below, every
repetition runs, on fresh forwards of the same module and data, interleaved in a rotating order:

  fused     torch.autograd.backward (the stage's ordinary backward)
  deferred  zbpipe's deferred engine: B = one autograd pass in which Linears queue their weight
            GEMMs, W = WeightGradStore.run (zbpipe.engines.deferred)
  graph     zbpipe's graph engine: B = autograd.grad to the inputs, W = WeightGrad.run
            (zbpipe.engines.graph_backward)
  torch     torch's stage_backward_input / stage_backward_weight (a middle stage only: on stage
            0 torch skips I and runs a whole backward in W)

Stages: Linear+GELU stacks (hidden 256 and 1024; 32 and 512 rows; a middle stage, whose input
needs a gradient, and stage 0, whose input does not) and Llama-style blocks (RMSNorm, causal
SDPA, SwiGLU; benchmarks/llama_blocks.py). Reported: medians (min, max) of (B + W) / fused over
repetitions, twice: for the first microbatch of a step (no ``.grad`` yet: every pass creates it)
and for the others (``.grad`` exists: every pass accumulates into it, which the deferred engine
does inside its GEMM), with each pass's time and the largest gradient difference from the
fused backward.

On CPU the clock is the thread's CPU time (one intra-op thread: the compute a pass costs, not
time another process took the core). On CUDA each pass reports device time (CUDA events) and host
time (the Python and launch cost, which a fast GPU cannot hide when it exceeds the kernels).

    PYTHONPATH=src python benchmarks/split_backward.py [--reps 15] [--quick]
    PYTHONPATH=src python benchmarks/split_backward.py --device cuda --dtype bfloat16

Writes benchmarks/results/split_backward[_cuda].json; docs/results/split-backward.md records what
we saw.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_blocks import build_chunks  # noqa: E402
from results_io import paired_ratios, write_result  # noqa: E402

from zbpipe.engines.deferred import WeightGradStore  # noqa: E402
from zbpipe.engines.fused import backward_full  # noqa: E402
from zbpipe.engines.graph_backward import WeightGrad, backward_input  # noqa: E402
from zbpipe.engines.linear_patch import StoreSlot, patch_linears  # noqa: E402

ENGINES = ("fused", "deferred", "graph", "torch")


def linear_stack(hidden: int, layers: int = 4) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*mods)


def cases(quick: bool, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """(name, module factory, input shape, first) for every stage measured."""
    out = []
    linear = [(256, 32), (1024, 32)] if quick else [(256, 32), (256, 512), (1024, 32), (1024, 512)]
    for hidden, rows in linear:
        for first in (False, True):
            out.append(
                {
                    "name": f"linear h{hidden} rows{rows} {'stage0' if first else 'middle'}",
                    "make": lambda h=hidden: linear_stack(h),
                    "shape": (rows, hidden),
                    "first": first,
                }
            )
    llama = (
        [(256, 128, 2)]
        if device.type == "cpu"
        else [(h, min(h, 4096), 2) for h in (1024, 2048, 4096)]
    )
    if quick:
        llama = [(128, 32, 1)]
    for hidden, seq, blocks in llama:
        out.append(
            {
                "name": f"llama h{hidden} seq{seq} x{blocks}",
                "make": lambda h=hidden, b=blocks: build_chunks(
                    h, b, 1, seed=0, dtype=dtype, device=device
                )[0],
                "shape": (1, seq, hidden),
                "first": False,
            }
        )
    return out


class Clock:
    """Times one pass: CPU time on CPU; device and host time on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float]:
        if not self.cuda:
            t = time.thread_time()
            fn()
            cpu = time.thread_time() - t
            return cpu, cpu
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h = time.perf_counter()
        start.record()
        fn()
        end.record()
        host = time.perf_counter() - h
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, host


def _deferred_b(
    store: WeightGradStore, out: torch.Tensor, g: torch.Tensor, x: torch.Tensor
) -> None:
    """The deferred engine's B: one autograd pass in which the Linears queue their W GEMMs."""
    store.deferring = True
    backward_full([out], [g], [x])
    store.deferring = False


def _graph_b(
    pending: dict[str, WeightGrad],
    out: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    params: list[nn.Parameter],
) -> None:
    """The graph engine's B; leaves its W in ``pending["w"]``."""
    pending["w"] = backward_input([out], [g], [x], params)[1]


def _torch_b(
    groups: dict[str, list[dict]],
    out: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    params: list[nn.Parameter],
) -> None:
    """torch's stage_backward_input; leaves the param groups its W needs in ``groups["g"]``."""
    groups["g"] = stage_backward_input([out], [g], [x], iter(params))[1]


def one_rep(
    m: nn.Module,
    slot: StoreSlot,
    x0: torch.Tensor,
    g: torch.Tensor,
    first: bool,
    engines: tuple[str, ...],
    clock: Clock,
    accumulate: bool = False,
) -> tuple[dict, dict]:
    """Each engine once on a fresh forward: {pass: seconds} (device) and the gradients.

    ``accumulate``: the weights already hold a gradient (zeros), as in every microbatch of a
    pipeline step but the first, so each pass adds to ``.grad`` instead of creating it.
    """
    times: dict[str, tuple[float, float]] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    params = list(m.parameters())
    for engine in engines:
        m.zero_grad(set_to_none=not accumulate)
        x = x0.detach().clone().requires_grad_(not first)
        store = WeightGradStore()
        slot.store = store if engine == "deferred" else None
        out = m(x)
        slot.store = None
        # The passes get their tensors as arguments (partial), not by closing over the loop's
        # variables, which ``del out`` below empties.
        if engine == "fused":
            times["fused"] = clock(partial(torch.autograd.backward, [out], [g]))
        elif engine == "deferred":
            times["deferred B"] = clock(partial(_deferred_b, store, out, g, x))
            times["deferred W"] = clock(store.run)
        elif engine == "graph":
            pending: dict[str, WeightGrad] = {}
            times["graph B"] = clock(partial(_graph_b, pending, out, g, x, params))
            times["graph W"] = clock(pending["w"].run)
        elif engine == "torch":
            groups: dict[str, list[dict]] = {}
            times["torch B"] = clock(partial(_torch_b, groups, out, g, x, params))
            times["torch W"] = clock(partial(stage_backward_weight, iter(params), groups["g"]))
        del out
        grads[engine] = [p.grad.detach().clone() for p in params if p.grad is not None]
    return times, grads


def measure(case: dict, reps: int, warmup: int, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    m = case["make"]().to(device=device, dtype=dtype)
    slot = StoreSlot()
    patch_linears(m, slot)
    x0 = torch.randn(case["shape"], device=device, dtype=dtype)
    with torch.no_grad():
        g = torch.randn_like(m(x0))
    engines = ENGINES if not case["first"] else ENGINES[:3]
    clock = Clock(device)
    samples: dict[bool, dict[str, list[tuple[float, float]]]] = {False: {}, True: {}}
    worst = {e: 0.0 for e in engines[1:]}
    for rep in range(warmup + reps):
        k = rep % len(engines)
        for accumulate in (rep % 2 == 1, rep % 2 == 0):  # which goes first alternates too
            times, grads = one_rep(
                m, slot, x0, g, case["first"], engines[k:] + engines[:k], clock, accumulate
            )
            for e in engines[1:]:
                assert len(grads[e]) == len(grads["fused"]), f"{case['name']}: {e} lost a grad"
                scale = max(r.abs().max().item() for r in grads["fused"])
                diff = max((a - r).abs().max().item() for a, r in zip(grads[e], grads["fused"]))
                worst[e] = max(worst[e], diff / scale)
            if rep >= warmup:
                for name, t in times.items():
                    samples[accumulate].setdefault(name, []).append(t)
    row: dict = {"name": case["name"], "passes_s": {}, "host_s": {}}
    for name, ts in samples[False].items():
        row["passes_s"][name] = statistics.median(t[0] for t in ts)
        row["host_s"][name] = statistics.median(t[1] for t in ts)
    # "ratio": the first microbatch of a step (no .grad yet); "ratio_accumulating": the others
    for key, accumulate in (("ratio", False), ("ratio_accumulating", True)):
        got = samples[accumulate]
        fused = [t[0] for t in got["fused"]]
        row[key] = {}
        for e in engines[1:]:
            r = [b[0] + w[0] for b, w in zip(got[f"{e} B"], got[f"{e} W"])]
            row[key][e] = paired_ratios(r, fused)
    row["max_rel_grad_diff"] = worst
    return row


def print_rows(rows: list[dict], cuda: bool) -> None:
    print(
        f"{'stage':34} {'engine':9} {'(B+W)/fused: first mb':24} {'accumulating':24}"
        f" {'B ms':>8} {'W ms':>8}"
        + (f" {'B host ms':>10}" if cuda else "")
        + f" {'grad diff':>10}"
    )
    for row in rows:
        fused = row["passes_s"]["fused"] * 1e3
        print(f"{row['name']:34} {'fused':9} {'':49} {fused:8.3f}")
        for e, r in row["ratio"].items():
            b, w = row["passes_s"][f"{e} B"] * 1e3, row["passes_s"][f"{e} W"] * 1e3
            spreads = [
                f"{q['median']:.3f} ({q['min']:.2f}-{q['max']:.2f})"
                for q in (r, row["ratio_accumulating"][e])
            ]
            host = f" {row['host_s'][f'{e} B'] * 1e3:10.3f}" if cuda else ""
            print(
                f"{'':34} {e:9} {spreads[0]:24} {spreads[1]:24} {b:8.3f} {w:8.3f}{host} "
                f"{row['max_rel_grad_diff'][e]:10.1e}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--quick", action="store_true", help="small sizes, 2 repetitions (a smoke test)"
    )
    ap.add_argument("--out", default=None, help="result name (default split_backward[_cuda])")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    reps = 2 if args.quick else args.reps
    rows = [measure(c, reps, args.warmup, device, dtype) for c in cases(args.quick, device, dtype)]
    print_rows(rows, device.type == "cuda")
    config = {
        "reps": reps,
        "warmup": args.warmup,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "quick": args.quick,
    }
    name = args.out or (
        "split_backward" if device.type == "cpu" else f"split_backward_{device.type}"
    )
    if not args.quick:
        write_result(name, {"config": config, "rows": rows})


if __name__ == "__main__":
    main()
