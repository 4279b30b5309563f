"""Speed of ScheduleContinuous's modes against torch's Schedule1F1B + optimizer.step().

The setup of issue 29: 2 gloo ranks (one thread each), each holding 4 x (Linear(hidden) + ReLU),
``--rows`` rows per microbatch, MSE loss, SGD, a *round* of ``--minibatches`` mini-batches each
followed by its optimizer step. Variants:

* ``torch:1F1B``: torch's ``Schedule1F1B.step()`` then ``optimizer.step()`` per mini-batch (the
  baseline every ratio is paired with);
* ``ZBH1``: zbpipe's flushed ``ScheduleZBH1`` then ``optimizer.step()``;
* ``sync`` / ``2bw`` / ``stash``: ``ScheduleContinuous`` (its own optimizer step), ``step()`` per
  mini-batch and a ``flush()`` at the end of the round, inside the timed region;
* ``2bw+nesterov``: 2bw with its delay correction (``correction="nesterov"``; ``"predict"``
  costs the same);
* a ``@exact`` suffix (``2bw@exact``) passes ``exact=True``.

Rounds are interleaved (each repetition runs every variant once, in a rotating order, after a
barrier); a round's time is the slowest rank's, divided by the mini-batches. Reported: the
median time per mini-batch, its ratio to torch's 1F1B paired per repetition, the paired ratio
of every continuous mode to ``sync`` (min/median/max), the ratio of the best (least disturbed)
rounds, and the same for the CPU time of the round summed over both ranks
(``time.process_time``: the work itself, waiting excluded, which other processes on a shared
machine move much less than the wall time).

    PYTHONPATH=src python benchmarks/continuous_speed.py            # m = 4 and m = 2, 2-4 min
    PYTHONPATH=src python benchmarks/continuous_speed.py --m 2 --reps 20

Writes ``benchmarks/results/continuous_speed.json``. Not a test: nothing is asserted. On a shared
machine wrap it in ``flock`` so two timing runs never overlap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

VARIANTS = ("torch:1F1B", "ZBH1", "sync", "2bw", "stash", "2bw+nesterov")


def _stage_module(hidden: int, layers: int, rank: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(100 + rank)
    return nn.Sequential(
        *[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.ReLU())]
    )


def _mse(out: Any, target: Any) -> Any:
    return (out - target).pow(2).mean()


def _build(name: str, rank: int, world: int, m: int, a: argparse.Namespace) -> dict:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from zbpipe import ScheduleContinuous, ScheduleZBH1

    mod = _stage_module(a.hidden, a.layers, rank)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))

    def make_opt(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=a.lr)

    if name == "torch:1F1B":
        return dict(sched=Schedule1F1B(stage, m, loss_fn=_mse), opt=make_opt(mod.parameters()))
    if name == "ZBH1":
        return dict(sched=ScheduleZBH1([stage], m, loss_fn=_mse), opt=make_opt(mod.parameters()))
    name, _, option = name.partition("@")  # "2bw@exact": ScheduleContinuous(exact=True)
    mode, _, corr = name.partition("+")
    extra: dict[str, Any] = {"correction": corr} if corr else {}
    if option == "exact":
        extra["exact"] = True
    sched = ScheduleContinuous([stage], m, loss_fn=_mse, optimizer=make_opt, mode=mode, **extra)
    return dict(sched=sched, opt=None)


def _rank_main(rank: int, world: int, m: int, a: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    names = a.variants
    runs = {name: _build(name, rank, world, m, a) for name in names}
    torch.manual_seed(7)
    data = [
        (torch.randn(m * a.rows, a.hidden), torch.randn(m * a.rows, a.hidden))
        for _ in range(a.minibatches)
    ]

    def one_round(name: str) -> tuple[float, float]:
        run = runs[name]
        sched, opt = run["sched"], run["opt"]
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        for x, y in data:
            args = (x,) if rank == 0 else ()
            tgt = y if rank == world - 1 else None
            sched.step(*args, target=tgt)
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        if opt is None:
            sched.flush()
        wall = (time.perf_counter() - t0) / len(data)
        return wall, (time.process_time() - c0) / len(data)

    for name in names:  # warm-up: shape inference, allocator, first versions
        one_round(name)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for rep in range(a.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(one_round(name))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank != 0:
        return None
    # wall: the slowest rank's; CPU: summed over the ranks (what the stage's work costs,
    # waiting excluded: a loaded machine moves it much less than the wall time)
    return {
        "wall": {
            name: [max(g[name][i][0] for g in gathered) for i in range(a.reps)] for name in names
        },
        "cpu": {
            name: [sum(g[name][i][1] for g in gathered) for i in range(a.reps)] for name in names
        },
    }


def _loadavg() -> list[float] | None:
    """The machine's load averages (1, 5, 15 minutes), where Linux reports them."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return None


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import paired_ratios, write_result

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[4, 2], help="microbatches per mini-batch")
    ap.add_argument("--reps", type=int, default=16, help="interleaved repetitions")
    ap.add_argument("--minibatches", type=int, default=6, help="mini-batches per round")
    ap.add_argument("--rows", type=int, default=32, help="rows per microbatch")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="Linear+ReLU layers per rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None, help="default benchmarks/results/continuous_speed.json")
    a = ap.parse_args()
    a.variants = tuple(a.variants.split(","))
    base = a.variants[0]
    results: dict[str, Any] = {}
    load_start = _loadavg()
    t0 = time.perf_counter()
    for m in a.m:
        both = run_ranks(_rank_main, 2, m, a, timeout=1800, pg_timeout=600)[0]
        times, cpu = both["wall"], both["cpu"]
        rows: dict[str, Any] = {}
        print(
            f"\n2 gloo ranks, {a.layers} x Linear({a.hidden})+ReLU per rank, "
            f"m={m} x {a.rows} rows, SGD, {a.minibatches} mini-batches per round, "
            f"{a.reps} interleaved rounds"
        )
        print(
            f"{'variant':>16} {'ms/mini-batch':>14} {'vs ' + base:>26} {'vs sync':>26} "
            f"{'CPU ms (2 ranks)':>17} {'CPU vs sync':>26} {'best, ms':>9} {'vs sync':>8}"
        )
        for name in a.variants:
            t = times[name]
            row = dict(
                seconds_per_minibatch=t,
                median_ms=statistics.median(t) * 1e3,
                ratio_to_baseline=paired_ratios(t, times[base]),
            )
            row["cpu_seconds_per_minibatch"] = cpu[name]
            row["cpu_median_ms"] = statistics.median(cpu[name]) * 1e3
            if "sync" in times:
                row["ratio_to_sync"] = paired_ratios(t, times["sync"])
                row["cpu_ratio_to_sync"] = paired_ratios(cpu[name], cpu["sync"])
                # the least disturbed round of each (other processes only ever add time)
                row["best_ratio_to_sync"] = min(t) / min(times["sync"])
            row["best_ms"] = min(t) * 1e3
            rows[name] = row

            def fmt(q: dict[str, float] | None) -> str:
                if q is None:
                    return ""
                return f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})"

            print(
                f"{name:>16} {row['median_ms']:14.2f} {fmt(row['ratio_to_baseline']):>26} "
                f"{fmt(row.get('ratio_to_sync')):>26} {row['cpu_median_ms']:17.2f} "
                f"{fmt(row.get('cpu_ratio_to_sync')):>26} {row['best_ms']:9.2f} "
                f"{row.get('best_ratio_to_sync', float('nan')):8.3f}"
            )
        results[f"m={m}"] = rows
    wall = time.perf_counter() - t0
    print(f"wall time {wall:.0f} s")
    config = {k: v for k, v in vars(a).items() if k != "out"}
    write_result(
        "continuous_speed",
        {
            "config": config,
            "baseline": base,
            "results": results,
            "wall_seconds": wall,
            "loadavg_start": load_start,
            "loadavg_end": _loadavg(),
        },
        path=a.out,
    )


if __name__ == "__main__":
    main()
