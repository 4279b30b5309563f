"""The main job: a real 2-rank pipeline training run on CPU, ZB-H1 against torch's 1F1B.

Two processes (gloo, one thread each) train the same tiny GPT from the same initial weights on
the same synthetic batches, once with torch's ``Schedule1F1B`` and once with zbpipe's
``ScheduleZBH1``, alternating step by step so machine noise hits both alike. Every step prints
the loss of each (they agree: the math is the same), the step time, and the bubble rate
measured from traced compute intervals. The summary gives the step-time ratio.

Run: ``zbpipe demo`` or ``python -m zbpipe.demo`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    steps: int = 8
    """Optimizer steps (the first is a warm-up and is left out of the summary)."""
    microbatches: int = 4
    """Microbatches per step (2p: where 1F1B's bubble is large and ZB-H1 removes most of it)."""
    microbatch_size: int = 4
    """Sequences per microbatch."""
    hidden: int = 512
    """Model width."""
    seq: int = 128
    """Sequence length."""
    blocks_per_stage: int = 2
    """Transformer blocks per pipeline stage."""
    lr: float = 3e-3
    """AdamW learning rate."""
    ranks: int = 2
    """Pipeline ranks (processes)."""

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "microbatches",
            "microbatch_size",
            "hidden",
            "seq",
            "blocks_per_stage",
            "ranks",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % 2:
            raise ValueError(
                f"DemoConfig.hidden must be even (2 attention heads), got {self.hidden}"
            )


SCHEDULES = ("torch 1F1B", "zbpipe ZBH1")


def _rank_main(rank: int, world: int, cfg: DemoConfig) -> list[dict[str, Any]] | None:
    """One rank of the main job: the same model trained with torch's 1F1B and with ZB-H1, each
    step traced; rank 0 returns the rows it prints.

    Long because it is one rank's whole demo run, in the order it prints."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from .observe.trace import Trace, Tracer, attach_stage_tracer
    from .schedules.classes import ScheduleZBH1
    from .testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

    mcfg = TinyGPTConfig(
        vocab=128, hidden=cfg.hidden, seq=cfg.seq, heads=2, blocks_per_stage=cfg.blocks_per_stage
    )
    runs = {}
    for name in SCHEDULES:
        module = build_stages(mcfg, world, seed=0)[rank]  # same init for both schedules
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        if name == "torch 1F1B":
            tracer = Tracer(rank=rank)
            attach_stage_tracer(stage, tracer)
            sched = Schedule1F1B(stage, cfg.microbatches, loss_fn=lm_loss)
        else:
            sched = ScheduleZBH1([stage], cfg.microbatches, loss_fn=lm_loss)
            tracer = sched.tracer
        opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr)
        runs[name] = (sched, tracer, opt)

    rows: list[dict[str, Any]] = []
    progress = _progress(cfg.steps * len(SCHEDULES)) if rank == 0 else None
    for step in range(cfg.steps):
        ids, tgt = synthetic_batch(mcfg, cfg.microbatches * cfg.microbatch_size, step)
        for name in SCHEDULES:
            sched, tracer, opt = runs[name]
            tracer.clear()
            opt.zero_grad(set_to_none=True)
            losses: list = []
            dist.barrier()
            t0 = time.perf_counter()
            sched.step(
                *((ids,) if rank == 0 else ()),
                target=tgt if rank == world - 1 else None,
                losses=losses,
            )
            opt.step()
            elapsed = time.perf_counter() - t0
            loss = torch.stack(losses).mean().item() if losses else None
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (rank, elapsed, loss, tracer.events))
            if rank == 0:
                trace = Trace({r: ev for r, _, _, ev in gathered})
                rows.append(
                    {
                        "step": step,
                        "schedule": name,
                        "loss": next(lo for _, _, lo, _ in gathered if lo is not None),
                        "step_time_s": max(t for _, t, _, _ in gathered),
                        "bubble_rate": trace.bubble_rate,
                    }
                )
                r = rows[-1]
                progress.console.print(
                    f"step {step:2d}  {name:<12}  loss {r['loss']:.4f}  "
                    f"step {r['step_time_s'] * 1e3:7.1f} ms  "
                    f"bubble {r['bubble_rate']:6.1%}"
                )
                progress.advance(progress.task_ids[0])
    if progress is not None:
        progress.stop()
    return rows if rank == 0 else None


def _progress(total: int) -> Any:
    """A live progress bar (rich) above the per-step lines; plain lines when not on a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    )
    progress.add_task("steps", total=total)
    progress.start()
    return progress


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step time and bubble rate per schedule (warm-up step excluded), and the ratio."""
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        mine = [r for r in rows if r["schedule"] == name and r["step"] > 0]
        out[name] = {
            "median_step_time_s": statistics.median(r["step_time_s"] for r in mine),
            "median_bubble_rate": statistics.median(r["bubble_rate"] for r in mine),
            "final_loss": mine[-1]["loss"],
        }
    # per-step ratios, paired (both schedules ran the same step back to back)
    ratios = [
        b["step_time_s"] / a["step_time_s"]
        for a, b in zip(
            (r for r in rows if r["schedule"] == SCHEDULES[0] and r["step"] > 0),
            (r for r in rows if r["schedule"] == SCHEDULES[1] and r["step"] > 0),
        )
    ]
    out["zbh1_over_1f1b_step_time"] = {
        "min": min(ratios),
        "median": statistics.median(ratios),
        "max": max(ratios),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from .testing import run_ranks

    parser = argparse.ArgumentParser(prog="zbpipe demo", description=__doc__.split("\n\n")[0])
    defaults = DemoConfig()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--json", help="also write the per-step rows and summary here")
    args = parser.parse_args(argv)
    cfg = DemoConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    print(
        f"zbpipe demo: {cfg.ranks} ranks (gloo, 1 thread each), {cfg.microbatches} microbatches x "
        f"{cfg.microbatch_size} sequences of {cfg.seq} tokens, hidden {cfg.hidden}, "
        f"{cfg.blocks_per_stage} blocks per stage",
        flush=True,
    )
    rows = run_ranks(_rank_main, cfg.ranks, cfg, timeout=max(300.0, 60.0 * cfg.steps))[0]
    summary = summarize(rows)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="zbpipe demo (warm-up step excluded)")
    for col in ("schedule", "median step", "median bubble", "final loss"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for name in SCHEDULES:
        s = summary[name]
        table.add_row(
            name,
            f"{s['median_step_time_s'] * 1e3:.1f} ms",
            f"{s['median_bubble_rate']:.1%}",
            f"{s['final_loss']:.4f}",
        )
    console = Console()
    console.print(table)
    r = summary["zbh1_over_1f1b_step_time"]
    console.print(
        f"ZBH1 / 1F1B step time: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "rows": rows, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
