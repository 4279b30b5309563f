"""What ``variable_shapes=True`` (issue 44's shape exchange) costs a pipeline whose shapes never
vary, against the default (no exchange).

2 gloo ranks, one thread each, ``real_run.py``'s tiny GPT and batch (every microbatch the same
shape). Each schedule runs twice, as two copies of the same model: built with
``variable_shapes=True`` (the shape exchange of :mod:`zbpipe.schedules.varlen`) and with the
default (no exchange; the rank of stage 0 compares each microbatch's input shapes with the first
step's, :mod:`zbpipe.schedules.fixed_shapes`). Repetitions are interleaved in a rotating order.
Reported per schedule: the step time (max over ranks) of each copy, their ratio paired per
repetition (min/median/max), the time per step inside ``ShapeExchange.before_step`` (the
exchange) and inside ``FixedShapes.check`` (the default's check, stage 0's rank only), each
wrapped with a ``perf_counter`` pair (the wrapper's own cost included), and whether the
exchange's steady steps skipped its all-reduce.

Run:  PYTHONPATH=src python benchmarks/varlen_overhead.py [--reps 40] [--schedules ZBH1,ZBV]
      [--out benchmarks/results/varlen_opt_in.json]
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


def timed_calls(obj: Any, method: str, spent: list[float], after: Any = None) -> None:
    """Wrap ``obj.method`` so each call appends its duration to ``spent`` (then runs ``after``)."""
    inner = getattr(obj, method)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent.append(time.perf_counter() - t0)
            if after is not None:
                after()

    setattr(obj, method, timed)


def _rank_main(rank: int, world: int, cfg: Config) -> dict | None:
    import torch.distributed as dist

    runs: dict[str, Any] = {}
    exchange_s: dict[str, list[float]] = {}
    check_s: dict[str, list[float]] = {}
    skipped: dict[str, list[bool]] = {}
    for name in cfg.schedules:
        for label in (f"{name}+varshapes", name):
            run = _build(label, rank, world, cfg)
            sched = run[0]
            exchange_s[label], check_s[label], skipped[label] = [], [], []
            if sched._shapes is not None:
                sh = sched._shapes
                after = lambda _sh=sh, _l=label: skipped[_l].append(_sh.skipped_agree)  # noqa: E731
                timed_calls(sh, "before_step", exchange_s[label], after)
            if sched._fixed_shapes is not None:
                timed_calls(sched._fixed_shapes, "check", check_s[label])
            runs[label] = run
    labels = list(runs)
    ids, tgt = _batch(cfg)
    for label in labels:  # warm-up: shape inference, the memory probe, the first exchange
        _timed_step(runs[label], ids, tgt)
    for label in labels:
        exchange_s[label].clear()
        check_s[label].clear()
        skipped[label].clear()
    records = []
    for rep in range(cfg.reps):
        k = rep % len(labels)
        for label in labels[k:] + labels[:k]:
            t0, t1, _, _ = _timed_step(runs[label], ids, tgt)
            records.append((rep, label, t1 - t0))
    mine = {
        "records": records,
        "exchange_s": exchange_s,
        "check_s": check_s,
        "skipped": skipped,
    }
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
        checks = [g["check_s"][label] for g in gathered if g["check_s"][label]]
        if checks:
            out[label]["default_check_s_stage0_rank"] = checks[0]
    for name in cfg.schedules:
        out[f"{name}+varshapes"]["ratio_to_default"] = paired_ratios(
            out[f"{name}+varshapes"]["step_time_s"], out[name]["step_time_s"]
        )
    return out


def main() -> None:
    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--schedules", default="ZBH1,ZBV")
    ap.add_argument("--out", default="benchmarks/results/varlen_opt_in.json")
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
    from results_io import cpu_model

    cpu = cpu_model()
    print(f"2 ranks, {cpu}, m={cfg.microbatches}, {cfg.reps} interleaved reps ({took:.0f} s)")
    for name in cfg.schedules:
        on, off = res[f"{name}+varshapes"], res[name]
        q = on["ratio_to_default"]
        ex = [statistics.median(r) * 1e3 for r in on["exchange_s_per_rank"]]
        check_us = statistics.median(off["default_check_s_stage0_rank"]) * 1e6
        print(
            f"{name:6s} step variable_shapes=True "
            f"{statistics.median(on['step_time_s']) * 1e3:7.2f} ms, "
            f"default {statistics.median(off['step_time_s']) * 1e3:7.2f} ms, "
            f"ratio {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}); "
            f"exchange per step (median, ranks 0/1) {ex[0]:.3f}/{ex[1]:.3f} ms, "
            f"all-reduce skipped: {on['steady_steps_skipped_all_reduce']}; "
            f"default's check {check_us:.1f} us per step (stage 0's rank)"
        )
    from results_io import write_result

    write_result(
        "", {"cpu": cpu, "seconds": took, "config": asdict(cfg), "results": res}, path=args.out
    )


if __name__ == "__main__":
    main()
