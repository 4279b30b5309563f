"""How much slower a stage's passes run when the other rank computes at the same time.

``continuous_speed.py``'s stage (4 x Linear(1024)+ReLU, 32 rows, one thread), forward with
autograd then backward (F + B + W as one fused backward), timed on 2 ranks in three phases:
rank 0 alone (rank 1 sleeps), rank 1 alone, both at once. The ratio "both / alone" is what a
schedule that removes idle time (2bw and stash against sync) pays on every pass it now runs
beside the other rank's: the two processes share the cache and the memory bus (and, on a VM,
whatever the host shares between the two vCPUs).

    PYTHONPATH=src python benchmarks/continuous_speed_contention.py     # about 30 s

Writes ``benchmarks/results/continuous_speed_contention.json``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any


def _rank_main(rank: int, world: int, a: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(100 + rank)
    mod = nn.Sequential(
        *[x for _ in range(a.layers) for x in (nn.Linear(a.hidden, a.hidden), nn.ReLU())]
    )
    x = torch.randn(a.rows, a.hidden)

    def one() -> None:
        mod(x).sum().backward()

    def timed(seconds: float) -> list[float]:
        one()
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            one()
            times.append(time.perf_counter() - t0)
        return times

    out: dict[str, list[float]] = {"alone": [], "both": []}
    for _ in range(a.rounds):  # interleaved: alone (each rank in turn), then both
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                out["alone"] += timed(a.seconds)
            else:
                time.sleep(a.seconds + 0.05)
        dist.barrier()
        out["both"] += timed(a.seconds)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()} | {
        "iterations": {k: len(v) for k, v in out.items()}
    }


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_result

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.5, help="per phase and round")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    load_start = [float(v) for v in open("/proc/loadavg").read().split()[:3]]
    per_rank = run_ranks(_rank_main, 2, a, timeout=600, pg_timeout=300)
    results: dict[str, Any] = {}
    for r, res in enumerate(per_rank):
        res["ratio_both_to_alone"] = res["both"] / res["alone"]
        results[f"rank{r}"] = res
        print(
            f"rank {r}: F+B+W {res['alone']:.3f} ms alone, {res['both']:.3f} ms beside the other "
            f"rank: {res['ratio_both_to_alone']:.3f}"
        )
    config = {k: v for k, v in vars(a).items() if k != "out"}
    load_end = [float(v) for v in open("/proc/loadavg").read().split()[:3]]
    data = {"config": config, "results": results, "loadavg_start": load_start}
    data["loadavg_end"] = load_end
    write_result("continuous_speed_contention", data, path=a.out)


if __name__ == "__main__":
    main()
