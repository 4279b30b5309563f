"""What one gloo send and receive cost to post: alone, and inside a 2-rank pipeline step.

docs/results/host-time.md ("Two gloo ranks: where the step goes") attributes ScheduleZBV's 2-rank
step at hidden 64 partly to posting twice 1F1B's cross-rank messages. This script says how much
of a posted send is the transport's call itself and where it is paid:

* **alone**: 2 gloo ranks, rank 0 posts ``--n`` sends (``dist.isend``) of one microbatch's
  activation (seq x hidden floats) while rank 1 posts the matching receives; thread-free wall
  clock per call;
* **in a step**: the shapes of benchmarks/host_overhead_ranks.py (Llama-style blocks, 4 blocks,
  m = 8), each schedule's steps under ``cProfile`` on both ranks, the time inside torch's C++
  ``send``/``recv`` bindings (``torch._C._distributed_c10d``) per call.

    PYTHONPATH=src python benchmarks/send_cost.py --out send_cost

Writes benchmarks/results/<--out>.json; docs/results/host-time.md quotes it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _alone(rank: int, args: argparse.Namespace) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    t = torch.randn(args.seq, args.hidden)
    per: list[float] = []
    for _ in range(5):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            works = [dist.isend(t, 1) for _ in range(args.n)]
            per.append((time.perf_counter() - t0) / args.n)
        else:
            bufs = [torch.empty_like(t) for _ in range(args.n)]
            t0 = time.perf_counter()
            works = [dist.irecv(b, 0) for b in bufs]
            per.append((time.perf_counter() - t0) / args.n)
        for w in works:
            w.wait()
    return {("isend_us" if rank == 0 else "irecv_us"): statistics.median(per) * 1e6}


def _in_steps(rank: int, row: str, args: argparse.Namespace) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from host_overhead_ranks import _build

    sched, stages = _build(row, rank, 2, args)
    x = torch.randn(args.microbatches, args.seq, args.hidden)
    y = torch.randn_like(x)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)

    def step() -> None:
        dist.barrier()
        sched.step(*((x,) if first else ()), target=y if last else None)

    for _ in range(3):
        step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    wall = time.perf_counter() - t0
    out = {"step_ms": wall / args.steps * 1e3}
    for (_, _, name), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if name in ("<built-in method torch._C._distributed_c10d.send>",
                    "<built-in method torch._C._distributed_c10d.recv>"):  # fmt: skip
            kind = name.rsplit(".", 1)[1].rstrip(">")
            out[f"{kind}_calls_per_step"] = ncalls / args.steps
            out[f"{kind}_us_per_call"] = tottime / ncalls * 1e6
            out[f"{kind}_ms_per_step"] = tottime / args.steps * 1e3
    return out


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    res: dict[str, Any] = {"alone": _alone(rank, args)}
    for row in args.rows:
        res[row] = _in_steps(rank, row, args)
    return res


def main() -> None:
    from host_overhead_ranks import add_shape_arguments

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(ap)
    ap.add_argument("--n", type=int, default=400, help="sends posted alone")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps per schedule")
    ap.add_argument("--rows", default="torch:1F1B,ZBH1,ZBV")
    ap.add_argument("--out", default=None, help="results file name (benchmarks/results/)")
    args = ap.parse_args()
    args.rows = tuple(args.rows.split(","))
    per_rank = run_ranks(_rank_main, 2, args, timeout=1200)
    alone = {**per_rank[0]["alone"], **per_rank[1]["alone"]}
    print(f"alone: isend {alone['isend_us']:.1f} us, irecv {alone['irecv_us']:.1f} us per call")
    for row in args.rows:
        for rank, res in enumerate(per_rank):
            r = res[row]
            print(
                f"{row:11} rank {rank}: step {r['step_ms']:.1f} ms (profiled); "
                f"send {r.get('send_calls_per_step', 0):.0f}/step x "
                f"{r.get('send_us_per_call', 0):.1f} us, recv {r.get('recv_calls_per_step', 0):.0f}"
                f"/step x {r.get('recv_us_per_call', 0):.1f} us"
            )
    if args.out:
        from results_io import write_result

        config = {k: getattr(args, k) for k in ("hidden", "seq", "blocks", "microbatches", "n")}
        config |= {"steps": args.steps, "rows": list(args.rows)}
        rows = {row: [res[row] for res in per_rank] for row in args.rows}
        print("wrote", write_result(args.out, {"config": config, "alone": alone, "rows": rows}))


if __name__ == "__main__":
    main()
