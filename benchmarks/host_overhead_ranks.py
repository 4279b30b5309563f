"""Host-bound steps on 2 gloo ranks: zbpipe's schedules against torch's ``Schedule1F1B``.

The shapes of benchmarks/host_overhead.py (Llama-style blocks, hidden 64, seq 32, 4 blocks,
m = 8; Python is most of a step) split over two processes, one thread each: torch's
``Schedule1F1B``, ``Schedule1F1BMulti`` and ``ScheduleZBH1`` hold 2 blocks per rank, ``ScheduleZBV``
1 block per chunk (rank 0: chunks 0 and 3, rank 1: 1 and 2). Each schedule trains its own copy
of the same blocks; repetitions are interleaved in a rotating order, each step starts after a
barrier, and its time is the slower rank's wall clock (a pipeline waits, so thread time would
miss the bubbles). Reported: the median step and its ratio to torch's ``Schedule1F1B`` paired
per repetition (min-max).

    PYTHONPATH=src python benchmarks/host_overhead_ranks.py --reps 30 --out host_overhead_2ranks

Writes benchmarks/results/<--out>.json; docs/results/host-time.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: row -> (class, options); "torch:1F1B" is torch's Schedule1F1B
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch:1F1B": ("torch", {}),
    "1F1BMulti": ("Schedule1F1BMulti", {}),
    "ZBH1": ("ScheduleZBH1", {}),
    "ZBV": ("ScheduleZBV", {}),
}


def _build(row: str, rank: int, world: int, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    import torch
    from llama_blocks import build_chunks, mse_loss
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import zbpipe

    cls_name, options = ROWS[row]
    cpu = torch.device("cpu")
    v = cls_name == "ScheduleZBV"
    n = 2 * world if v else world
    mods = build_chunks(args.hidden, args.blocks, n, seed=0, dtype=torch.float32, device=cpu)
    if cls_name == "torch":
        stage = PipelineStage(mods[rank], rank, n, cpu)
        return Schedule1F1B(stage, args.microbatches, loss_fn=mse_loss), [stage]
    cls = getattr(zbpipe, cls_name)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, n, cpu) for s in mine]
    return cls(stages, args.microbatches, loss_fn=mse_loss, **options), stages


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rows = list(args.rows)
    runs = {row: _build(row, rank, world, args) for row in rows}
    torch.manual_seed(1)
    x = torch.randn(args.microbatches, args.seq, args.hidden)
    y = torch.randn_like(x)

    def one_step(row: str) -> float:
        sched, stages = runs[row]
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(*((x,) if first else ()), target=y if last else None)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took.item())

    for row in rows:  # warm-up: shape inference, the first step's memory probe, the allocator
        for _ in range(2):
            one_step(row)
    times: dict[str, list[float]] = {row: [] for row in rows}
    for rep in range(args.reps):
        k = rep % len(rows)
        for row in rows[k:] + rows[:k]:
            times[row].append(one_step(row))
    return {"step_s": times} if rank == 0 else None


def _paired(times: list[float], base: list[float]) -> dict[str, float]:
    r = [a / b for a, b in zip(times, base, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def main() -> None:
    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20, help="interleaved repetitions")
    ap.add_argument("--rows", default=",".join(ROWS), help="rows to time (torch:1F1B first)")
    ap.add_argument("--out", default=None, help="results file name (benchmarks/results/)")
    args = ap.parse_args()
    args.rows = tuple(args.rows.split(","))
    if args.rows[0] != "torch:1F1B":
        ap.error("--rows must start with torch:1F1B (the baseline)")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    res = run_ranks(_rank_main, 2, args, timeout=1800)[0]
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    base = res["step_s"]["torch:1F1B"]
    table = {}
    print(
        f"2 gloo ranks, hidden {args.hidden}, seq {args.seq}, {args.blocks} blocks, "
        f"m = {args.microbatches}, {args.reps} interleaved repetitions (wall clock, slower rank)"
    )
    for row in args.rows:
        t = res["step_s"][row]
        q = _paired(t, base)
        table[row] = {"step_ms": statistics.median(t) * 1e3, "ratio_to_torch_1f1b": q}
        print(
            f"{row:12} {statistics.median(t) * 1e3:8.2f} ms  vs torch 1F1B {q['median']:.3f} "
            f"({q['min']:.3f}-{q['max']:.3f})"
        )
    if args.out:
        from results_io import write_result

        config = {k: getattr(args, k) for k in ("hidden", "seq", "blocks", "microbatches", "reps")}
        config["rows"] = list(args.rows)
        config["ZBPIPE_NATIVE"] = os.environ.get("ZBPIPE_NATIVE", "unset")  # the weight capture
        config["loadavg_before_after"] = [load_before, load_after]
        data = {"config": config, "rows": table, "step_s": res["step_s"]}
        print("wrote", write_result(args.out, data))


if __name__ == "__main__":
    main()
