"""Real multi-process runs: zbpipe's schedules against torch's built-ins on the same model.

N gloo processes (``--ranks``: 2, 4 or 8), one thread each. Every schedule trains its own copy
of the same tiny GPT (the model is fixed: ``--blocks``, by default 2 x ranks, split into one stage
per rank for 1-stage-per-rank schedules and into 2 chunks per rank for V/interleaved ones).
Repetitions are interleaved (each repetition runs every schedule once, in a rotating order) so
machine noise hits all alike. Reported per schedule: step time (max over ranks) with its ratio to
torch's Schedule1F1B paired per repetition (min/median/max), the bubble rate measured from traced
compute intervals, and the peak bytes of saved activations per rank.

Run:  PYTHONPATH=src python benchmarks/real_run.py [--ranks 2] [--reps 10] [--microbatches 4]
      [--hidden 512]
Writes benchmarks/results/real_run.json (2 ranks) or real_run_<N>ranks.json;
docs/results/real-runs.md records what we saw. Each rank needs a core of its own: measure 4
and 8 ranks only on a machine with at least that many cores (on fewer, the ratios measure the
OS scheduler, not the schedules).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

SCHEDULES = (
    "torch:1F1B",
    "torch:Interleaved1F1B",
    "torch:ZBVZeroBubble",
    "ZBH1",
    "ZBV",
    "ZBVHalf",
    "ZBVMin",
)


@dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int = 2
    """pipeline ranks (gloo processes, one thread each)"""
    reps: int = 10
    microbatches: int = 4
    microbatch_size: int = 4
    hidden: int = 512
    seq: int = 128
    blocks: int = 0
    """transformer blocks in the whole model; 0 means 2 x ranks (one block per V chunk)"""
    meter: int = 1
    """1: count saved activations (a pack hook on every saved tensor); 0: time without it"""
    model: str = "gpt"
    """"gpt": the tiny GPT (blocks = transformer blocks); "mlp": Linear(hidden)+ReLU layers
    (blocks = layers; microbatch_size = rows), loss the mean square error"""
    schedules: tuple[str, ...] = SCHEDULES


INT_FIELDS = (
    "ranks",
    "reps",
    "microbatches",
    "microbatch_size",
    "hidden",
    "seq",
    "blocks",
    "meter",
)


def _mlp_stages(hidden: int, layers: int, n_stages: int) -> list:
    """``layers`` Linear+ReLU layers split into ``n_stages`` equal chunks.

    The weights are the same for any split.
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)]
    per = layers // n_stages
    return [nn.Sequential(*mods[i * per : (i + 1) * per]) for i in range(n_stages)]


def _mse(out: Any, target: Any) -> Any:
    return (out - target).pow(2).mean()


def _build(name: str, rank: int, world: int, cfg: Config) -> tuple[Any, list, Any, Any]:
    import torch
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    from zbpipe._compat import with_local_stage_init
    from zbpipe.memory import SavedActivationMeter
    from zbpipe.observe.trace import Tracer, attach_stage_tracer
    from zbpipe.planning import loop_placement, v_placement
    from zbpipe.schedules import ScheduleZB1P, ScheduleZBH1, ScheduleZBV
    from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss

    name, _, variant = name.partition("+")  # "ZBH1+units": measure_memory=False (issue 27)
    name, _, split = name.partition("@")  # "ZBV@graph": zbpipe's ZBV with the graph engine
    options: dict[str, Any] = {"split": split} if split else {}
    if variant == "units":  # the plan for equal bytes per stage, as before the first-step probe
        options["measure_memory"] = False
    if variant == "varshapes":  # each step's shapes sent down the pipeline (issue 44)
        options["variable_shapes"] = True
    two_chunks = name not in ("torch:1F1B", "ZBH1", "ZB1P")
    n_stages = 2 * world if two_chunks else world
    if cfg.blocks % n_stages:
        raise ValueError(
            f"--blocks {cfg.blocks} must be a multiple of {n_stages} stages for {name}"
        )
    if cfg.model == "mlp":
        modules, loss_fn = _mlp_stages(cfg.hidden, cfg.blocks, n_stages), _mse
    else:
        mcfg = TinyGPTConfig(
            vocab=256,
            hidden=cfg.hidden,
            seq=cfg.seq,
            heads=4,
            blocks_per_stage=cfg.blocks // n_stages,
        )
        modules, loss_fn = build_stages(mcfg, n_stages, seed=0), lm_loss
    placement = (
        v_placement(world)
        if name in ("torch:ZBVZeroBubble", "ZBV", "ZBVHalf", "ZBVMin")
        else loop_placement(world, n_stages)
    )
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = [PipelineStage(modules[s], s, n_stages, torch.device("cpu")) for s in mine]
    meter = SavedActivationMeter()
    m = cfg.microbatches
    if name.startswith("torch:"):
        tracer = Tracer(rank=rank)
        for st in stages:
            attach_stage_tracer(st, tracer)
            if cfg.meter:
                meter.attach(st)
        cls = {
            "torch:1F1B": Schedule1F1B,
            "torch:Interleaved1F1B": ScheduleInterleaved1F1B,
            "torch:ZBVZeroBubble": ScheduleZBVZeroBubble,
        }[name]
        if cls is not Schedule1F1B:
            # torch 2.11's own stage set-up sends a dummy tensor to every neighbour stage, its own
            # rank included; gloo has no link to itself, so torch's ScheduleZBVZeroBubble (the
            # last rank holds stages p-1 and p) fails in its first step on any number of ranks
            # ("Pair is not connected"). zbpipe's fix of that set-up: the one-time link warm-up
            # leaves out same-rank neighbours, compute untouched; torch's class itself on >= 2.13.
            cls = with_local_stage_init(cls)
        # torch computes the loss outside the stage's forward: the meter counts it through this
        counted_loss = meter.watch_loss(loss_fn) if cfg.meter else loss_fn
        sched = cls(stages[0] if cls is Schedule1F1B else stages, m, loss_fn=counted_loss)
    else:
        if name in ("ZBH1", "ZB1P"):
            cls = ScheduleZBH1 if name == "ZBH1" else ScheduleZB1P
            sched = cls(stages, m, loss_fn=loss_fn, **options)
        else:
            memory = {"ZBV": "zb", "ZBVHalf": "half", "ZBVMin": "min"}[name]
            sched = ScheduleZBV(stages, m, loss_fn=loss_fn, memory=memory, **options)
        tracer = sched.tracer
        if cfg.meter:
            sched.attach_meter(meter)
    return sched, stages, tracer, meter


def _batch(cfg: Config) -> tuple[Any, Any]:
    """The whole batch and its target: the same on every rank and for every schedule."""
    import torch

    from zbpipe.testing.models import TinyGPTConfig, synthetic_batch

    if cfg.model == "mlp":
        torch.manual_seed(1)
        ids = torch.randn(cfg.microbatches * cfg.microbatch_size, cfg.hidden)
        return ids, torch.randn_like(ids)
    mcfg = TinyGPTConfig(vocab=256, hidden=cfg.hidden, seq=cfg.seq)
    return synthetic_batch(mcfg, cfg.microbatches * cfg.microbatch_size, 0)


def _timed_step(
    run: tuple[Any, list, Any, Any], ids: Any, tgt: Any
) -> tuple[float, float, list, int]:
    """One step of a ``_build`` result from a barrier, gradients cleared first: its start and
    end (``perf_counter``), the tracer's events and the meter's peak bytes."""
    import torch.distributed as dist

    sched, stages, tracer, meter = run
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    for st in stages:
        for p in st.submod.parameters():
            p.grad = None
    tracer.clear()
    meter.reset_peak()
    dist.barrier()
    t0 = time.perf_counter()
    sched.step(*((ids,) if has_first else ()), target=tgt if has_last else None)
    return t0, time.perf_counter(), list(tracer.events), meter.peak_bytes


def _rank_main(rank: int, world: int, cfg: Config) -> dict | None:
    import torch.distributed as dist

    from zbpipe.observe.trace import Trace

    runs = {name: _build(name, rank, world, cfg) for name in cfg.schedules}
    ids, tgt = _batch(cfg)

    def one_step(name: str) -> tuple[float, list, int]:
        t0, t1, events, peak = _timed_step(runs[name], ids, tgt)
        return t1 - t0, events, peak

    first = {}
    for name in cfg.schedules:  # warm-up (shape inference, allocator; the memory probe)
        first[name] = one_step(name)[0]
    records: list[tuple[int, str, float, list, int]] = []
    for rep in range(cfg.reps):
        k = rep % len(cfg.schedules)
        for name in cfg.schedules[k:] + cfg.schedules[:k]:
            t, events, peak = one_step(name)
            records.append((rep, name, t, events, peak))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank != 0:
        return None
    out: dict[str, Any] = {}
    for name in cfg.schedules:
        times, bubbles = [], []
        for rep in range(cfg.reps):
            per_rank = [next(r for r in recs if r[0] == rep and r[1] == name) for recs in gathered]
            times.append(max(r[2] for r in per_rank))
            bubbles.append(Trace({i: r[3] for i, r in enumerate(per_rank)}).bubble_rate)
        peaks = [max(r[4] for r in recs if r[1] == name) for recs in gathered]
        out[name] = {
            "first_step_s": first[name],
            "step_time_s": times,
            "bubble_rate": bubbles,
            "peak_saved_bytes_per_rank": peaks,
        }
    from results_io import paired_ratios

    base = out[cfg.schedules[0]]["step_time_s"]
    for name in cfg.schedules:
        out[name]["ratio_to_first"] = paired_ratios(out[name]["step_time_s"], base)
        if name + "+units" in out:  # the default (bytes measured) against measure_memory=False
            units = out[name + "+units"]["step_time_s"]
            out[name]["ratio_to_units"] = paired_ratios(out[name]["step_time_s"], units)
    return out


def main() -> None:
    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    for f in INT_FIELDS:
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(defaults, f))
    ap.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="names; ZBH1@graph etc. picks the engine"
    )
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    ap.add_argument("--out", help="default: benchmarks/results/real_run[_<N>ranks].json")
    args = ap.parse_args()
    if args.ranks not in (2, 4, 8):
        ap.error("--ranks must be 2, 4 or 8")
    fields = {f: getattr(args, f) for f in INT_FIELDS}
    fields["blocks"] = fields["blocks"] or 2 * args.ranks
    cfg = Config(**fields, model=args.model, schedules=tuple(args.schedules.split(",")))
    out_path = args.out or (
        "benchmarks/results/real_run.json"
        if cfg.ranks == 2
        else f"benchmarks/results/real_run_{cfg.ranks}ranks.json"
    )
    t0 = time.perf_counter()
    res = run_ranks(_rank_main, cfg.ranks, cfg, timeout=3600)[0]
    print(
        f"{cfg.ranks} ranks, m={cfg.microbatches}, "
        f"microbatch {cfg.microbatch_size}x{cfg.seq} tokens, hidden {cfg.hidden}, "
        f"{cfg.blocks} blocks, {cfg.reps} interleaved reps ({time.perf_counter() - t0:.0f} s)"
    )
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"real runs, {cfg.ranks} gloo ranks")
    for col in (
        "schedule",
        "median step",
        f"vs {cfg.schedules[0]} (min-max)",
        "bubble",
        "peak saved MiB/rank",
    ):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for name in cfg.schedules:
        r = res[name]
        q = r["ratio_to_first"]
        table.add_row(
            name,
            f"{statistics.median(r['step_time_s']) * 1e3:.1f} ms",
            f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})",
            f"{statistics.median(r['bubble_rate']):.1%}",
            "/".join(f"{b / 2**20:.1f}" for b in r["peak_saved_bytes_per_rank"]),
        )
    Console().print(table)
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_result

    write_result("", {"config": asdict(cfg), "results": res}, path=out_path)


if __name__ == "__main__":
    main()
