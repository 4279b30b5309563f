"""Convergence of continuous training: sync vs 2bw (with and without its correction) vs stash vs
flushed 1F1B, over seeds and learning rates, on two tasks.

* ``gpt`` (zbpipe's own): the tiny GPT of ``zbpipe.testing.models`` on its synthetic counting
  task, a fresh synthetic batch per step. Metric: the mean training loss over the last
  ``--tail`` mini-batches (fresh data each step, so it tracks generalization).
* ``digits`` (a task someone else wrote): the handwritten-digits set of UCI (Alpaydin and
  Kaynak; 1,797 8x8 images, 10 classes) as scikit-learn ships it inside its wheel
  (``sklearn.datasets.load_digits``, no download), a 4-layer MLP (64-128-128-128-10, ReLU),
  cross entropy; 1,497 images to train on (shuffled per epoch), 300 held out. Metrics: the
  held-out loss after the last step, and the training loss of the last ``--tail`` mini-batches.

Both: 2 gloo ranks (one thread each), AdamW (weight decay 0), ``m`` microbatches per mini-batch;
every configuration starts from the same initial weights for a given seed.

    PYTHONPATH=src python benchmarks/continuous_convergence.py               # both tasks, ~4 min
    PYTHONPATH=src python benchmarks/continuous_convergence.py --task digits --seeds 0 1 2 3 4

Writes ``benchmarks/results/continuous_convergence.json`` (gpt) and
``continuous_convergence_digits.json``. Not a test: nothing is asserted. The digits task needs
scikit-learn (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from zbpipe.continuous import ScheduleContinuous
from zbpipe.schedules import Schedule1F1BMulti
from zbpipe.testing import run_ranks
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

MODES = ("1F1B", "sync", "2bw", "2bw+predict", "2bw+nesterov", "stash")
CFG = TinyGPTConfig(hidden=32, blocks_per_stage=1)
DIGITS_TEST = 300


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def _digits_stage(rank: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU()]
    if rank == 1:
        torch.manual_seed(seed + 1000)
        layers = [nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)]
    return nn.Sequential(*layers)


class _Task:
    """One task's model (this rank's stage), data per step and held-out evaluation."""

    def __init__(self, name: str, rank: int, world: int, seed: int, batch: int) -> None:
        self.name, self.rank, self.world, self.seed, self.batch = name, rank, world, seed, batch
        if name == "gpt":
            self.module: nn.Module = build_stages(CFG, world, seed=seed)[rank]
            self.loss_fn: Any = lm_loss
        else:
            self.module = _digits_stage(rank, seed)
            self.loss_fn = nn.functional.cross_entropy
            x, y = _digits()
            self.test = (x[:DIGITS_TEST], y[:DIGITS_TEST])
            self.train = (x[DIGITS_TEST:], y[DIGITS_TEST:])
            self._order = torch.empty(0, dtype=torch.long)
            self._gen = torch.Generator().manual_seed(1000 + seed)

    def data(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name == "gpt":
            return synthetic_batch(CFG, batch=self.batch, step=k, seed=1000 + self.seed)
        x, y = self.train
        per_epoch = len(y) // self.batch
        if k % per_epoch == 0:
            self._order = torch.randperm(len(y), generator=self._gen)
        idx = self._order[(k % per_epoch) * self.batch : (k % per_epoch + 1) * self.batch]
        return x[idx], y[idx]

    def held_out_loss(self) -> float | None:
        """digits: the pipeline's forward on the held-out images (rank 0 sends its output)."""
        if self.name == "gpt":
            return None
        x, y = self.test
        with torch.no_grad():
            if self.rank == 0:
                dist.send(self.module(x).contiguous(), 1)
                return None
            h = torch.empty(len(y), 128)
            dist.recv(h, 0)
            return float(self.loss_fn(self.module(h), y))


def _one_run(
    rank: int, world: int, task: str, mode: str, lr: float, seed: int, a: argparse.Namespace
) -> tuple[list[float], float | None]:
    t = _Task(task, rank, world, seed, a.batch)
    stage = PipelineStage(t.module, rank, world, torch.device("cpu"))
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)  # noqa: E731
    losses: list[float] = []
    m = a.microbatches
    if mode == "1F1B":
        sched: Any = Schedule1F1BMulti([stage], m, loss_fn=t.loss_fn, check_peers=False)
        opt = make_opt(list(t.module.parameters()))
    else:
        base, _, corr = mode.partition("+")
        sched = ScheduleContinuous(
            [stage],
            m,
            loss_fn=t.loss_fn,
            optimizer=make_opt,
            mode=base,
            correction=corr or None,
            check_peers=False,
        )
    for k in range(a.steps):
        x, y = t.data(k)
        args = (x,) if rank == 0 else ()
        target = y if rank == world - 1 else None
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
    return losses, t.held_out_loss()


def _all_runs(rank: int, world: int, task: str, grid: list[tuple], a: argparse.Namespace) -> dict:
    return {
        (mode, lr, seed): _one_run(rank, world, task, mode, lr, seed, a) for mode, lr, seed in grid
    }


def _report(task: str, res: dict, a: argparse.Namespace, lrs: list[float], wall: float) -> dict:
    curves = {key: val[0] for key, val in res.items()}  # rank 1 holds the last stage
    held = {key: val[1] for key, val in res.items()}
    metric = (
        "held-out loss after the last step"
        if task == "digits"
        else (f"mean loss of the last {a.tail} mini-batches")
    )
    print(
        f"\n{task}: 2 ranks, AdamW, m={a.microbatches}, batch={a.batch}, {a.steps} steps, "
        f"seeds {a.seeds}; {metric} (mean and min..max over seeds)"
    )
    print(f"{'lr':>8} " + " ".join(f"{mode:>22}" for mode in a.modes))
    rows = []
    for lr in lrs:
        if task == "digits":
            finals = {mode: [held[mode, lr, s] for s in a.seeds] for mode in a.modes}
        else:
            finals = {
                mode: [statistics.mean(curves[mode, lr, s][-a.tail :]) for s in a.seeds]
                for mode in a.modes
            }
        tails = {
            mode: [statistics.mean(curves[mode, lr, s][-a.tail :]) for s in a.seeds]
            for mode in a.modes
        }
        cells = [f"{statistics.mean(v):8.4f} ({min(v):.3f}..{max(v):.3f})" for v in finals.values()]
        print(f"{lr:8.0e} " + " ".join(f"{c:>22}" for c in cells))
        sync_vs_1f1b = max(
            abs(x - y)
            for s in a.seeds
            for x, y in zip(curves["sync", lr, s], curves["1F1B", lr, s])
        )
        rows.append(
            dict(
                lr=lr,
                final={k: v for k, v in finals.items()},
                final_mean={k: statistics.mean(v) for k, v in finals.items()},
                train_tail_mean={k: statistics.mean(v) for k, v in tails.items()},
                gap_to_1f1b={
                    k: statistics.mean(finals[k]) - statistics.mean(finals["1F1B"]) for k in a.modes
                },
                sync_vs_1f1b_max_loss_diff=sync_vs_1f1b,
            )
        )
    best = {mode: min(r["final_mean"][mode] for r in rows) for mode in a.modes}
    best_lr = {mode: min(rows, key=lambda r: r["final_mean"][mode])["lr"] for mode in a.modes}
    print(
        "best over lr: "
        + ", ".join(f"{mode} {best[mode]:.4f} (lr {best_lr[mode]:g})" for mode in a.modes)
    )
    gaps = {mode: best[mode] - best["sync"] for mode in a.modes}
    print(
        "gap to sync at each mode's best lr: " + ", ".join(f"{k} {v:+.4f}" for k, v in gaps.items())
    )
    largest = max(r["sync_vs_1f1b_max_loss_diff"] for r in rows)
    print(f"largest |sync - 1F1B| training-loss difference over every step: {largest:.2e}")
    print(f"wall time {wall:.0f} s")
    return dict(
        config=dict(
            task=task,
            steps=a.steps,
            microbatches=a.microbatches,
            batch=a.batch,
            lrs=lrs,
            seeds=a.seeds,
            tail=a.tail,
            metric=metric,
            model=str(CFG) if task == "gpt" else "MLP 64-128-128 | 128-128-10 (ReLU)",
            ranks=2,
            optimizer="AdamW(weight_decay=0)",
        ),
        rows=rows,
        best=best,
        best_lr=best_lr,
        gap_to_sync_at_best_lr=gaps,
        curves={f"{mode}|{lr:g}|{seed}": c for (mode, lr, seed), c in curves.items()},
        held_out={f"{mode}|{lr:g}|{seed}": v for (mode, lr, seed), v in held.items()},
        wall_seconds=wall,
    )


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("gpt", "digits", "both"), default="both")
    ap.add_argument("--steps", type=int, default=80, help="mini-batches per run")
    ap.add_argument(
        "--microbatches",
        type=int,
        default=2,
        help="microbatches per mini-batch (small m: most staleness)",
    )
    ap.add_argument("--batch", type=int, default=0, help="per mini-batch (0: gpt 8, digits 32)")
    ap.add_argument("--lrs", type=float, nargs="+", default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tail", type=int, default=10, help="mini-batches averaged at the end")
    ap.add_argument("--modes", nargs="+", default=list(MODES), help="modes (1F1B, sync always)")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    a.modes = ["1F1B", "sync"] + [mode for mode in a.modes if mode not in ("1F1B", "sync")]
    tasks = ("gpt", "digits") if a.task == "both" else (a.task,)
    for task in tasks:
        lrs = a.lrs or ([3e-3, 1e-2, 3e-2, 1e-1] if task == "gpt" else [1e-3, 3e-3, 1e-2, 3e-2])
        batch = a.batch
        a.batch = batch or (8 if task == "gpt" else 32)
        grid = [(mode, lr, seed) for lr in lrs for seed in a.seeds for mode in a.modes]
        t0 = time.perf_counter()
        res = run_ranks(_all_runs, 2, task, grid, a, timeout=3600, pg_timeout=600)
        data = _report(task, res[1], a, lrs, time.perf_counter() - t0)
        name = "continuous_convergence" + ("" if task == "gpt" else f"_{task}")
        write_result(name, data, path=Path(a.out_dir) / f"{name}.json")
        a.batch = batch


if __name__ == "__main__":
    main()
