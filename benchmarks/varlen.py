"""Sequences as they come (issue 44): zbpipe on unpadded microbatches of different lengths
against torch's schedules on the same sequences padded to the longest.

2 gloo ranks, one thread each, a tiny GPT (``zbpipe.testing.models``: causal attention as a
masked full matrix, so its cost grows with the square of the length). Each microbatch is one
sequence; its length is drawn from a lognormal distribution (median ``--median`` tokens,
``--sigma``), clipped to ``[--min-len, --max-len]``: a long tail, as in fine-tuning data. Each
repetition draws a new step of ``--microbatches`` lengths and runs every schedule on it, in a
rotating order:

* ``torch:1F1B`` (torch's ``Schedule1F1B``) and ``torch:ZBVZeroBubble``: every sequence padded to
  the longest of the whole run's draws (torch sizes its buffers once, so a step cannot change
  shape), the padding's targets ignored by the loss;
* ``ZBH1``, ``ZBV``: zbpipe on the unpadded sequences (``arg_mbs``/``target_mbs``), built with
  ``variable_shapes=True``;
* ``ZBH1+order``, ``ZBV+order``: the same, with ``microbatch_costs=token_scales(lengths,
  quadratic_at=6 * hidden)`` (the microbatches in the order the simulator finds fastest).

The loss sums the real tokens' cross entropy (divided by a constant): the same gradients with
and without padding. Reported per schedule: tokens/s of real tokens (median), the step time
(max over ranks), and tokens/s ratios paired per repetition against torch's best schedule of
that repetition, against ``torch:1F1B`` and, for ``+order``, against the same schedule in data
order (min/median/max). Nothing here is a test.

Run:  PYTHONPATH=src python benchmarks/varlen.py [--reps 30] [--out benchmarks/results/varlen.json]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = ("torch:1F1B", "torch:ZBVZeroBubble", "ZBH1", "ZBH1+order", "ZBV", "ZBV+order")
NORM = 1000.0  # the loss's constant divisor (timing only; the same for every schedule)


@dataclass(frozen=True, kw_only=True)
class Config:
    reps: int = 30
    microbatches: int = 8
    median: int = 64
    """median length of the lognormal draw, in tokens"""
    sigma: float = 1.0
    """sigma of the lognormal draw (of the log of the length)"""
    min_len: int = 8
    max_len: int = 512
    hidden: int = 128
    blocks: int = 4
    seed: int = 0
    schedules: tuple[str, ...] = SCHEDULES


def draw_lengths(cfg: Config) -> list[list[int]]:
    """Every step's lengths (warm-up step first), the same on every rank and for every schedule."""
    import random

    rng = random.Random(cfg.seed)
    mu = math.log(cfg.median)

    def one() -> int:
        return min(cfg.max_len, max(cfg.min_len, round(rng.lognormvariate(mu, cfg.sigma))))

    return [[one() for _ in range(cfg.microbatches)] for _ in range(cfg.reps + 1)]


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, target.reshape(-1), ignore_index=-100, reduction="sum") / NORM


def _build(name: str, rank: int, cfg: Config, pad_to: int) -> tuple[Any, list]:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    from zbpipe._compat import with_local_stage_init
    from zbpipe.planning import loop_placement, v_placement
    from zbpipe.schedules import ScheduleZBH1, ScheduleZBV
    from zbpipe.testing.models import TinyGPTConfig, build_stages

    base = name.split("+")[0]
    v = base in ("torch:ZBVZeroBubble", "ZBV")
    n_stages = 4 if v else 2
    mcfg = TinyGPTConfig(
        vocab=256, hidden=cfg.hidden, seq=pad_to, heads=4, blocks_per_stage=cfg.blocks // n_stages
    )
    modules = build_stages(mcfg, n_stages, seed=0)
    placement = v_placement(2) if v else loop_placement(2, n_stages)
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = [PipelineStage(modules[s], s, n_stages, torch.device("cpu")) for s in mine]
    m = cfg.microbatches
    if base == "torch:1F1B":
        sched = Schedule1F1B(stages[0], m, loss_fn=_loss)
    elif base == "torch:ZBVZeroBubble":
        sched = with_local_stage_init(ScheduleZBVZeroBubble)(stages, m, loss_fn=_loss)
    elif base == "ZBH1":
        sched = ScheduleZBH1(stages, m, loss_fn=_loss, variable_shapes=True)
    else:
        sched = ScheduleZBV(stages, m, loss_fn=_loss, variable_shapes=True)
    return sched, stages


def _data(lengths: list[int], step: int, pad_to: int) -> tuple[list, list, Any, Any]:
    """The step's sequences unpadded (lists) and padded to ``pad_to`` (one batch each)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    ids = [torch.randint(0, 256, (1, n), generator=g) for n in lengths]
    tgt = [torch.randint(0, 256, (1, n), generator=g) for n in lengths]
    pad_ids = torch.zeros(len(lengths), pad_to, dtype=torch.long)
    pad_tgt = torch.full((len(lengths), pad_to), -100, dtype=torch.long)
    for i, n in enumerate(lengths):
        pad_ids[i, :n], pad_tgt[i, :n] = ids[i][0], tgt[i][0]
    return ids, tgt, pad_ids, pad_tgt


def _step(name: str, run: tuple[Any, list], data: tuple, scales: tuple[float, ...]) -> float:
    import torch.distributed as dist

    sched, stages = run
    ids, tgt, pad_ids, pad_tgt = data
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    for st in stages:
        for p in st.submod.parameters():
            p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    if name.startswith("torch:"):
        sched.step(*((pad_ids,) if first else ()), target=pad_tgt if last else None)
    else:
        extra = {"microbatch_costs": scales} if name.endswith("+order") and first else {}
        sched.step(
            arg_mbs=[(x,) for x in ids] if first else None,
            target_mbs=tgt if last else None,
            **extra,
        )
    return time.perf_counter() - t0


def _time_exchange(sched: Any) -> list[float] | None:
    """A list that gets the time of each step's shape exchange (zbpipe's schedules only)."""
    shapes = getattr(sched, "_shapes", None)
    if shapes is None:
        return None
    from varlen_overhead import timed_calls

    spent: list[float] = []
    timed_calls(shapes, "before_step", spent)
    return spent


def _rank_main(rank: int, world: int, cfg: Config) -> dict | None:
    import torch.distributed as dist

    from zbpipe.planning.by_cost import token_scales

    draws = draw_lengths(cfg)
    pad_to = max(max(d) for d in draws)
    runs = {name: _build(name, rank, cfg, pad_to) for name in cfg.schedules}
    times: dict[str, list[float]] = {name: [] for name in cfg.schedules}
    exchange = {name: _time_exchange(runs[name][0]) for name in cfg.schedules}
    first: dict[str, float] = {}
    for step, lengths in enumerate(draws):
        data = _data(lengths, step, pad_to)
        scales = token_scales(lengths, quadratic_at=6 * cfg.hidden)
        k = step % len(cfg.schedules)
        for name in cfg.schedules[k:] + cfg.schedules[:k]:
            t = _step(name, runs[name], data, scales)
            if step == 0:
                first[name] = t  # warm-up: shape inference, memory probe, first fake forwards
            else:
                times[name].append(t)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "exchange": exchange})
    gathered_exchange = [g["exchange"] for g in gathered]
    gathered = [g["times"] for g in gathered]
    if rank != 0:
        return None
    step_s = {
        name: [max(g[name][i] for g in gathered) for i in range(cfg.reps)] for name in cfg.schedules
    }
    tokens = [sum(d) for d in draws[1:]]
    tps = {name: [n / t for n, t in zip(tokens, step_s[name])] for name in cfg.schedules}
    torch_names = [n for n in cfg.schedules if n.startswith("torch:")]
    best_torch = [max(tps[n][i] for n in torch_names) for i in range(cfg.reps)]
    from results_io import paired_ratios

    out: dict[str, Any] = {}
    for name in cfg.schedules:
        out[name] = {
            "first_step_s": first[name],
            "step_time_s": step_s[name],
            "real_tokens_per_s": tps[name],
            "tps_ratio_to_torch_best": paired_ratios(tps[name], best_torch),
        }
        if gathered_exchange[0][name] is not None:  # the shape exchange, per step and rank
            out[name]["exchange_s_per_rank"] = [g[name][1:] for g in gathered_exchange]
        if "torch:1F1B" in tps:
            out[name]["tps_ratio_to_torch_1f1b"] = paired_ratios(tps[name], tps["torch:1F1B"])
        if name.endswith("+order") and name.split("+")[0] in tps:
            out[name]["tps_ratio_to_data_order"] = paired_ratios(tps[name], tps[name.split("+")[0]])
    return {
        "lengths": draws,
        "padded_to": pad_to,
        "real_tokens_per_step": tokens,
        "padding_factor": statistics.mean(pad_to * cfg.microbatches / n for n in tokens),
        "results": out,
    }


def main() -> None:
    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    for f in ("reps", "microbatches", "median", "min_len", "max_len", "hidden", "blocks", "seed"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(defaults, f))
    ap.add_argument("--sigma", type=float, default=defaults.sigma)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--out", default="benchmarks/results/varlen.json")
    args = ap.parse_args()
    fields = {k: v for k, v in vars(args).items() if k not in ("schedules", "out")}
    cfg = Config(**fields, schedules=tuple(args.schedules.split(",")))
    t0 = time.perf_counter()
    res = run_ranks(_rank_main, 2, cfg, timeout=900)[0]
    took = time.perf_counter() - t0
    from results_io import cpu_model

    cpu = cpu_model()
    print(
        f"2 ranks, {cpu}; m={cfg.microbatches}, lengths lognormal(median {cfg.median}, sigma "
        f"{cfg.sigma}) clipped to [{cfg.min_len}, {cfg.max_len}], torch padded to "
        f"{res['padded_to']} (x{res['padding_factor']:.2f} tokens); {cfg.reps} reps ({took:.0f} s)"
    )
    for name in cfg.schedules:
        r = res["results"][name]
        q = r["tps_ratio_to_torch_best"]
        line = (
            f"{name:20s} {statistics.median(r['real_tokens_per_s']):9.0f} tok/s  "
            f"step {statistics.median(r['step_time_s']) * 1e3:7.1f} ms  "
            f"vs torch best {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})"
        )
        if "exchange_s_per_rank" in r:
            ex = [statistics.median(x) * 1e3 for x in r["exchange_s_per_rank"]]
            line += f"  exchange {ex[0]:.1f}/{ex[1]:.1f} ms"
        if "tps_ratio_to_data_order" in r:
            d = r["tps_ratio_to_data_order"]
            line += f"  vs data order {d['median']:.3f} ({d['min']:.3f}-{d['max']:.3f})"
        print(line)
    from results_io import write_result

    write_result(
        "",
        {"cpu": cpu, "seconds": took, "config": asdict(cfg), **res},
        path=args.out,
    )


if __name__ == "__main__":
    main()
