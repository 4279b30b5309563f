"""One rank holding the whole pipeline: what the split backward costs where no bubble hides it.

One process, one thread, every stage local (no messages, no bubbles): 2 chunks of
``--blocks / 2`` Llama-style blocks (RMSNorm, causal SDPA, SwiGLU; benchmarks/llama_blocks.py)
for the V schedule, the same blocks as one stage for the others. Every schedule trains its own
copy of the same weights on the same batch; repetitions are interleaved in a rotating order and
each step's thread CPU time is compared with the baseline's in the same repetition (paired
ratios: median, min, max). The baseline is zbpipe's own ``Schedule1F1BMulti``, the same runtime
with a fused backward, so the ratios show the split's cost and nothing else; torch's
``Schedule1F1B`` is listed beside it.

    PYTHONPATH=src python benchmarks/one_rank.py [--reps 30]

Writes benchmarks/results/one_rank.json; docs/results/host-time.md records what we saw.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_blocks import build_chunks, mse_loss  # noqa: E402
from results_io import paired_ratios, write_result  # noqa: E402

import zbpipe  # noqa: E402

SCHEDULES = ("1F1BMulti", "ZBH1", "ZBV", "torch:1F1B")


def build(name: str, args: argparse.Namespace) -> tuple[object, list[torch.nn.Module]]:
    """The schedule ``name`` (``NAME@graph`` picks the engine) on its own copy of the model."""
    base, _, split = name.partition("@")
    chunks = 2 if base == "ZBV" else 1
    cpu = torch.device("cpu")
    mods = build_chunks(args.hidden, args.blocks, chunks, seed=0, dtype=torch.float32, device=cpu)
    stages = [PipelineStage(mod, i, chunks, cpu) for i, mod in enumerate(mods)]
    if base == "torch:1F1B":
        return Schedule1F1B(stages[0], args.microbatches, loss_fn=mse_loss), mods
    cls = {
        "1F1BMulti": zbpipe.Schedule1F1BMulti,
        "ZBH1": zbpipe.ScheduleZBH1,
        "ZBV": zbpipe.ScheduleZBV,
    }[base]
    options = {"split": split} if split else {}
    return cls(stages, args.microbatches, loss_fn=mse_loss, **options), mods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="the first is the baseline")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    names = args.schedules.split(",")
    runs = {name: build(name, args) for name in names}
    torch.manual_seed(1)
    x = torch.randn(args.microbatches, args.seq, args.hidden)
    y = torch.randn_like(x)

    def step(name: str) -> float:
        sched, mods = runs[name]
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        t = time.thread_time()
        sched.step(x, target=y)  # type: ignore[attr-defined]
        return time.thread_time() - t

    for name in names:  # warm-up: shape inference, allocator
        step(name)
        step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(step(name))
    results = {}
    print(f"{'schedule':14} {'step ms':>9}   vs {names[0]} median (min-max)")
    for name in names:
        results[name] = {
            "step_cpu_s": times[name],
            "ratio_to_first": paired_ratios(times[name], times[names[0]]),
        }
        q = results[name]["ratio_to_first"]
        print(
            f"{name:14} {statistics.median(times[name]) * 1e3:9.1f}   "
            f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})"
        )
    config = {k: getattr(args, k) for k in ("reps", "hidden", "seq", "blocks", "microbatches")}
    write_result("one_rank", {"config": {**config, "schedules": names}, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
