"""Where the first step's time goes when the memory probe measures it (issue 37).

2 gloo ranks, the shape of issue 37 (``real_run.py --model mlp``: Linear(hidden)+ReLU layers, one
thread per rank). Each repetition builds every schedule afresh (its first step is what is timed)
and runs ``--steps`` steps; the schedules alternate order between repetitions. Per schedule and
rank: the first step, the median of the later steps (the last two), and, for zbpipe's schedules,
the time inside the first step of each part, measured by wrapping the functions that do it:

* torch's shape inference (``initialize_stages``), which every schedule's first step pays;
* a V schedule's measured start (:mod:`zbpipe.schedules.measured_start`): part 1, microbatch 0's
  round trip with the other rank waiting; the re-plan (``replanner.choose``: the gather of the
  bytes, ``build_plan``, the candidates' simulation, the log line's), ``rest_after``, the
  lowering and binding of each part; part 2, the rest of the step;
* the memory probe's hooks (``KeyBytes.on_pack``/``on_free``, ``inputs_of``).

The wrappers add a ``perf_counter`` pair per call (tens of calls per first step).

Run:  PYTHONPATH=src python benchmarks/first_step_time.py [--reps 8] [--steps 4]
      [--schedules ZBV,ZBV+units,torch:1F1B] [--out benchmarks/results/first_step_time.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from real_run import Config, _build  # noqa: E402

PARTS: collections.defaultdict[str, float] = collections.defaultdict(float)


def _wrap(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[label] += time.perf_counter() - t

    setattr(owner, name, timed)


def _instrument() -> None:
    """Wrap the first step's parts (module docstring); the labels are the result's keys."""
    from zbpipe import _compat as C
    from zbpipe.memory import probe
    from zbpipe.schedules import measured_start as ms
    from zbpipe.schedules import memory_replan as mr
    from zbpipe.schedules import stage_seam

    _wrap(C, "initialize_stages", "shape inference (torch)")
    _wrap(ms.MeasuredStart, "_program", "lower + bind a part")
    _wrap(ms, "rest_after", "rest_after")
    _wrap(mr.MemoryReplanner, "choose", "re-plan (choose)")
    _wrap(mr, "gather_stage_values", "choose: gather the bytes")
    _wrap(mr.MemoryReplanner, "_plan", "choose: build_plan")
    _wrap(mr, "fastest_keeping", "choose: simulate the candidates")
    _wrap(mr, "cost_line", "choose: log line's cost")
    _wrap(mr.MemoryReplanner, "after_step", "after the step (lowering)")
    _wrap(probe.KeyBytes, "on_pack", "probe hooks")
    _wrap(probe.KeyBytes, "on_free", "probe hooks")
    _wrap(stage_seam, "inputs_of", "probe hooks")
    bind, calls = ms.bind_program, [0]

    def bind_timed(*args: Any, **kwargs: Any) -> Any:
        program = bind(*args, **kwargs)
        calls[0] += 1
        label = "part 1: microbatch 0's round trip" if calls[0] % 2 else "part 2: the rest"

        class Timed:
            def run(self, ctx: Any) -> None:
                t = time.perf_counter()
                try:
                    program.run(ctx)
                finally:
                    PARTS[label] += time.perf_counter() - t

        return Timed()

    ms.bind_program = bind_timed


def _rank_main(rank: int, world: int, cfg: Config, steps: int) -> list | None:
    import torch
    import torch.distributed as dist

    _instrument()
    torch.manual_seed(1)
    x = torch.randn(cfg.microbatches * cfg.microbatch_size, cfg.hidden)
    target = torch.randn_like(x)
    rows = []
    for rep in range(cfg.reps):
        names = cfg.schedules if rep % 2 == 0 else cfg.schedules[::-1]
        for name in names:
            sched, stages, _, _ = _build(name, rank, world, cfg)
            first = any(s.is_first for s in stages)
            last = any(s.is_last for s in stages)
            times, parts = [], {}
            for i in range(steps):
                PARTS.clear()
                for st in stages:
                    for p in st.submod.parameters():
                        p.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                sched.step(*((x,) if first else ()), target=target if last else None)
                times.append(time.perf_counter() - t0)
                if i == 0:
                    parts = dict(PARTS)
            rows.append(
                {"rep": rep, "schedule": name, "step_s": times, "first_step_parts_s": parts}
            )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    return gathered if rank == 0 else None


def summarize(per_rank: list[list[dict]], schedules: tuple[str, ...]) -> dict[str, Any]:
    """Medians over repetitions, per schedule and rank, in ms."""
    out: dict[str, Any] = {}
    for name in schedules:
        ranks = []
        for rows in per_rank:
            mine = [r for r in rows if r["schedule"] == name]
            first = [r["step_s"][0] * 1e3 for r in mine]
            later = [t * 1e3 for r in mine for t in r["step_s"][-2:]]
            labels = sorted({k for r in mine for k in r["first_step_parts_s"]})
            parts = {
                k: statistics.median(r["first_step_parts_s"].get(k, 0.0) * 1e3 for r in mine)
                for k in labels
            }
            ranks.append(
                {
                    "first_step_ms": statistics.median(first),
                    "later_step_ms": statistics.median(later),
                    "first_over_later": statistics.median(first) / statistics.median(later),
                    "first_step_parts_ms": parts,
                }
            )
        out[name] = ranks
    return out


def main() -> None:
    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--microbatch-size", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--schedules", default="ZBV,ZBV+units,torch:1F1B")
    ap.add_argument("--out", default="benchmarks/results/first_step_time.json")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the first, and two later ones)")
    cfg = Config(
        reps=args.reps,
        microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        hidden=args.hidden,
        blocks=args.blocks,
        meter=0,
        model="mlp",
        schedules=tuple(args.schedules.split(",")),
    )
    gathered = run_ranks(_rank_main, 2, cfg, args.steps, timeout=1800)[0]
    summary = summarize(gathered, cfg.schedules)
    for name, ranks in summary.items():
        for r, s in enumerate(ranks):
            print(
                f"{name} rank {r}: first step {s['first_step_ms']:.1f} ms, later "
                f"{s['later_step_ms']:.1f} ms ({s['first_over_later']:.2f}x)"
            )
            for k, v in s["first_step_parts_ms"].items():
                print(f"    {k:36s} {v:7.2f} ms")
    from dataclasses import asdict

    from results_io import write_result

    data = {"config": asdict(cfg), "steps": args.steps, "summary": summary, "raw": gathered}
    write_result("", data, path=args.out)


if __name__ == "__main__":
    main()
