"""What the varlen shape exchange costs a pipeline whose shapes never vary (issue 44).

2 gloo ranks, one thread each, ``real_run.py``'s tiny GPT and batch (every microbatch the same
shape). Each schedule runs twice, as two copies of the same model: with the shape exchange of
:mod:`zbpipe.schedules.varlen` (the default) and with it switched off (a private switch,
``sched._shapes.enabled = False``: torch's receive buffers from microbatch 0, what zbpipe did
before issue 44). Repetitions are interleaved in a rotating order. Reported per schedule: the
step time (max over ranks) of each copy, their ratio paired per repetition (min/median/max), and
the time inside ``ShapeExchange.before_step`` per step on each rank (wrapped with a
``perf_counter`` pair), with whether the steady steps skipped the all-reduce.

Run:  PYTHONPATH=src python benchmarks/varlen_overhead.py [--reps 40] [--schedules ZBH1,ZBV]
      [--out benchmarks/results/varlen_overhead.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from real_run import Config, _batch, _build, _timed_step  # noqa: E402


def _rank_main(rank: int, world: int, cfg: Config) -> dict | None:
    import torch.distributed as dist

    runs: dict[str, Any] = {}
    exchange_s: dict[str, list[float]] = {}
    skipped: dict[str, list[bool]] = {}
    for name in cfg.schedules:
        for on in (True, False):
            label = name if on else f"{name}-off"
            run = _build(name, rank, world, cfg)
            shapes = run[0]._shapes
            shapes.enabled = on
            exchange_s[label], skipped[label] = [], []
            if on:
                inner = shapes.before_step

                def timed(
                    *a: Any, _inner: Any = inner, _label: str = label, _sh: Any = shapes, **k: Any
                ) -> None:
                    t0 = time.perf_counter()
                    _inner(*a, **k)
                    exchange_s[_label].append(time.perf_counter() - t0)
                    skipped[_label].append(_sh.skipped_agree)

                shapes.before_step = timed
            runs[label] = run
    labels = list(runs)
    ids, tgt = _batch(cfg)
    for label in labels:  # warm-up: shape inference, the memory probe, the first exchange
        _timed_step(runs[label], ids, tgt)
    for label in labels:
        exchange_s[label].clear()
        skipped[label].clear()
    records = []
    for rep in range(cfg.reps):
        k = rep % len(labels)
        for label in labels[k:] + labels[:k]:
            t0, t1, _, _ = _timed_step(runs[label], ids, tgt)
            records.append((rep, label, t1 - t0))
    mine = {"records": records, "exchange_s": exchange_s, "skipped": skipped}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    from results_io import paired_ratios

    out: dict[str, Any] = {}
    for label in labels:
        times = [
            max(next(t for r, b, t in g["records"] if r == rep and b == label) for g in gathered)
            for rep in range(cfg.reps)
        ]
        out[label] = {"step_time_s": times}
        ex = [g["exchange_s"][label] for g in gathered]
        if ex[0]:
            out[label]["exchange_s_per_rank"] = ex
            out[label]["steady_steps_skipped_all_reduce"] = all(
                all(g["skipped"][label]) for g in gathered
            )
    for name in cfg.schedules:
        out[name]["ratio_to_off"] = paired_ratios(
            out[name]["step_time_s"], out[f"{name}-off"]["step_time_s"]
        )
    return out


def _cpu_model() -> str:
    import subprocess

    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")),
        "unknown",
    )


def main() -> None:
    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--schedules", default="ZBH1,ZBV")
    ap.add_argument("--out", default="benchmarks/results/varlen_overhead.json")
    args = ap.parse_args()
    cfg = Config(
        ranks=2,
        reps=args.reps,
        microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        hidden=args.hidden,
        seq=args.seq,
        blocks=4,
        meter=0,
        schedules=tuple(args.schedules.split(",")),
    )
    t0 = time.perf_counter()
    res = run_ranks(_rank_main, 2, cfg, timeout=900)[0]
    took = time.perf_counter() - t0
    cpu = _cpu_model()
    print(f"2 ranks, {cpu}, m={cfg.microbatches}, {cfg.reps} interleaved reps ({took:.0f} s)")
    for name in cfg.schedules:
        on, off = res[name], res[f"{name}-off"]
        q = on["ratio_to_off"]
        ex = [statistics.median(r) * 1e3 for r in on["exchange_s_per_rank"]]
        print(
            f"{name:6s} step {statistics.median(on['step_time_s']) * 1e3:7.2f} ms, "
            f"off {statistics.median(off['step_time_s']) * 1e3:7.2f} ms, "
            f"ratio {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}); "
            f"exchange per step (median, ranks 0/1) {ex[0]:.3f}/{ex[1]:.3f} ms; "
            f"all-reduce skipped: {on['steady_steps_skipped_all_reduce']}"
        )
    from results_io import write_result

    write_result(
        "", {"cpu": cpu, "seconds": took, "config": asdict(cfg), "results": res}, path=args.out
    )


if __name__ == "__main__":
    main()
