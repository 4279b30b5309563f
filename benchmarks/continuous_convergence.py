"""Convergence of continuous training: sync vs 2bw vs stash vs flushed 1F1B, over seeds and
learning rates.

The tiny GPT of ``zbpipe.testing.models`` on its synthetic counting task, split over 2 gloo
ranks (one thread each), AdamW, ``m`` microbatches per mini-batch, a fresh synthetic batch per
step. Every configuration starts from the same initial weights for a given seed. Reported: the
mean training loss over the last ``--tail`` mini-batches (fresh data each step, so it tracks
generalization), and its gap to flushed 1F1B.

    PYTHONPATH=src python benchmarks/continuous_convergence.py  # about 1-2 minutes on 2 cores
    PYTHONPATH=src python benchmarks/continuous_convergence.py --steps 200 --seeds 0 1 2 3 4

Writes ``benchmarks/results/continuous_convergence.json``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.pipelining import PipelineStage

from zbpipe.continuous import ScheduleContinuous
from zbpipe.schedules import Schedule1F1BMulti
from zbpipe.testing import run_ranks
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

MODES = ("1F1B", "sync", "2bw", "stash")
CFG = TinyGPTConfig(hidden=32, blocks_per_stage=1)


def _one_run(
    rank: int, world: int, mode: str, lr: float, seed: int, steps: int, m: int, batch: int
) -> list[float]:
    mod = build_stages(CFG, world, seed=seed)[rank]
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)  # noqa: E731
    losses: list[float] = []
    if mode == "1F1B":
        sched = Schedule1F1BMulti([stage], m, loss_fn=lm_loss, check_peers=False)
        opt = make_opt(list(mod.parameters()))
    else:
        sched = ScheduleContinuous(
            [stage], m, loss_fn=lm_loss, optimizer=make_opt, mode=mode, check_peers=False
        )
    for k in range(steps):
        ids, tgt = synthetic_batch(CFG, batch=batch, step=k, seed=1000 + seed)
        args = (ids,) if rank == 0 else ()
        target = tgt if rank == world - 1 else None
        if mode == "1F1B":
            mb: list = []
            sched.step(*args, target=target, losses=mb)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mb:
                losses.append(float(torch.stack(mb).detach().mean()))
        else:
            for _, mb in sched.step(*args, target=target):
                losses.append(float(torch.stack(mb).mean()))
    if mode != "1F1B":
        for _, mb in sched.flush():
            losses.append(float(torch.stack(mb).mean()))
    return losses


def _all_runs(rank: int, world: int, grid: list[tuple], steps: int, m: int, batch: int) -> dict:
    out = {}
    for mode, lr, seed in grid:
        t = time.perf_counter()
        out[(mode, lr, seed)] = (
            _one_run(rank, world, mode, lr, seed, steps, m, batch),
            time.perf_counter() - t,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80, help="mini-batches per run")
    ap.add_argument(
        "--microbatches",
        type=int,
        default=2,
        help="microbatches per mini-batch (small m: most staleness)",
    )
    ap.add_argument("--batch", type=int, default=8, help="sequences per mini-batch")
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2, 1e-1])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tail", type=int, default=10, help="mini-batches averaged at the end")
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "continuous_convergence.json")
    )
    a = ap.parse_args()
    grid = [(mode, lr, seed) for lr in a.lrs for seed in a.seeds for mode in MODES]
    t0 = time.perf_counter()
    res = run_ranks(
        _all_runs, 2, grid, a.steps, a.microbatches, a.batch, timeout=3600, pg_timeout=600
    )
    wall = time.perf_counter() - t0
    curves = {key: val[0] for key, val in res[1].items()}  # rank 1 holds the last stage: the losses
    rows = []
    print(
        f"tiny GPT, 2 ranks, AdamW, m={a.microbatches}, batch={a.batch}, {a.steps} steps, "
        f"seeds {a.seeds}; "
        f"mean loss of the last {a.tail} mini-batches (mean and min..max over seeds)"
    )
    print(f"{'lr':>8} " + " ".join(f"{mode:>22}" for mode in MODES) + "   gap to 1F1B (2bw, stash)")
    for lr in a.lrs:
        finals = {
            mode: [statistics.mean(curves[mode, lr, s][-a.tail :]) for s in a.seeds]
            for mode in MODES
        }
        cells = [f"{statistics.mean(v):8.4f} ({min(v):.3f}..{max(v):.3f})" for v in finals.values()]
        base = statistics.mean(finals["1F1B"])
        gaps = {mode: statistics.mean(finals[mode]) - base for mode in MODES}
        print(
            f"{lr:8.0e} "
            + " ".join(f"{c:>22}" for c in cells)
            + f"   {gaps['2bw']:+.4f}, {gaps['stash']:+.4f}"
        )
        sync_vs_1f1b = max(
            abs(x - y)
            for s in a.seeds
            for x, y in zip(curves["sync", lr, s], curves["1F1B", lr, s])
        )
        rows.append(
            dict(
                lr=lr,
                final={k: v for k, v in finals.items()},
                gap_to_1f1b=gaps,
                sync_vs_1f1b_max_loss_diff=sync_vs_1f1b,
            )
        )
    largest = max(r["sync_vs_1f1b_max_loss_diff"] for r in rows)
    print(f"largest |sync - 1F1B| loss difference over every step: {largest:.2e}")
    print(f"wall time {wall:.0f} s")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            dict(
                config=dict(
                    steps=a.steps,
                    microbatches=a.microbatches,
                    batch=a.batch,
                    lrs=a.lrs,
                    seeds=a.seeds,
                    tail=a.tail,
                    model=str(CFG),
                    ranks=2,
                    optimizer="AdamW(weight_decay=0)",
                ),
                rows=rows,
                curves={f"{mode}|{lr:g}|{seed}": c for (mode, lr, seed), c in curves.items()},
                wall_seconds=wall,
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
