"""Overlapped pairs on a slow network: zbpipe's ScheduleDualPipeV with and without overlap (and
with ``costs="profile"``), torch's ScheduleDualPipeV and zbpipe's ScheduleZBV, on the same MoE
model, 2 gloo ranks.

The model is zbpipe.testing.moe (attention, then an MoE layer whose tokens go through an
all-to-all, the experts, and an all-to-all back), one block per chunk, 4 chunks in V placement.
Each rank's all-to-all runs over a process group of its own rank (expert parallelism 1: the
exchange is a local copy) and waits, by sleeping, until ``latency`` seconds after it started: a
slow network, not a slow CPU. ``latency`` is ``--latency-share`` times one chunk's forward
compute, measured on the rank first (with no latency): with the default 0.5, each all-to-all
waits half a chunk's forward compute, so a chunk's forward (two of them) waits as long as it
computes. Every schedule trains its own copy of the same weights on the same batch, with the
same latency; repetitions are interleaved (each runs every schedule once, in a rotating order).
Reported per schedule and latency: step time (the slower rank's), its median, and the overlapped
ScheduleDualPipeV's time over it, paired per repetition (min/median/max).

The zbpipe schedules run with their default arguments (the model's points declared): the first
step measures bytes and re-plans, ``costs="profile"`` re-plans again after its third step (it
measures what the all-to-alls cost, ``Costs.a2a``, and keeps the pairs that pay). Three untimed
steps per schedule come first, so every timed step runs the final plan; each run records every
zbpipe schedule's pairs. ``--measure-memory 0`` gives ``measure_memory=False`` (the first run,
overlap.json, used it: the plan of equal bytes every step).

Run:  PYTHONPATH=src python benchmarks/overlap.py [--reps 10] [--microbatches 8] [--hidden 512]
      [--name overlap]   (--from-json FILE summarises a stored run again)
Writes benchmarks/results/NAME.json; docs/results/dualpipev.md reports them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

SCHEDULES = (
    "DualPipeV overlap",
    "DualPipeV no overlap",
    "DualPipeV profile",
    "torch:DualPipeV",
    "ZBV",
)


@dataclass(frozen=True, kw_only=True)
class Config:
    reps: int = 10
    microbatches: int = 8
    microbatch_size: int = 2
    hidden: int = 512
    seq: int = 128
    experts: int = 2
    latency_share: float = 0.5
    """each all-to-all's latency, as a share of one chunk's forward compute"""
    latencies: tuple[float, ...] = (-1.0, 0.0)
    """-1: ``latency_share`` of the measured forward; else seconds"""
    measure_memory: int = 1
    """1: zbpipe's default (bytes measured in the first step, the plan re-made); 0: off"""


def _build(name: str, rank: int, cfg: Config, latency: float, groups: dict[str, Any]) -> Any:
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    import zbpipe
    from zbpipe.testing.models import lm_loss
    from zbpipe.testing.moe import TinyMoEConfig, build_moe_stages, moe_layers

    mcfg = TinyMoEConfig(vocab=256, hidden=cfg.hidden, seq=cfg.seq, heads=4, experts=cfg.experts)
    mods = build_moe_stages(mcfg, 4, groups["ep"], 0, latency=latency, seed=0)
    mine = (rank, 3 - rank)
    stages = [PipelineStage(mods[s], s, 4, torch.device("cpu"), group=groups["pp"]) for s in mine]
    m = cfg.microbatches
    if name == "torch:DualPipeV":
        return ScheduleDualPipeV(stages, m, loss_fn=lm_loss), stages
    measure = bool(cfg.measure_memory)
    if name == "ZBV":
        return zbpipe.ScheduleZBV(stages, m, loss_fn=lm_loss, measure_memory=measure), stages
    points = [
        zbpipe.CommPoint(owner=layer, method="exchange", collective=lambda x, a2a: (x, a2a))
        for s in mine
        for layer in moe_layers(mods[s])
    ]
    sched = zbpipe.ScheduleDualPipeV(
        stages,
        m,
        loss_fn=lm_loss,
        comm_points=points,
        overlap=name != "DualPipeV no overlap",
        measure_memory=measure,
        costs="profile" if name == "DualPipeV profile" else None,
    )
    return sched, stages


def _forward_time(rank: int, cfg: Config, groups: dict[str, Any]) -> float:
    """Median seconds of one chunk's forward (a middle chunk, no latency), on this rank."""
    import torch

    from zbpipe.testing.moe import TinyMoEConfig, build_moe_stages

    mcfg = TinyMoEConfig(vocab=256, hidden=cfg.hidden, seq=cfg.seq, heads=4, experts=cfg.experts)
    chunk = build_moe_stages(mcfg, 4, groups["ep"], 0, seed=0)[1]
    x = torch.randn(cfg.microbatch_size, cfg.seq, cfg.hidden, requires_grad=True)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        chunk(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _rank_main(rank: int, world: int, cfg: Config) -> dict | None:
    import torch
    import torch.distributed as dist

    from zbpipe.testing.models import synthetic_batch
    from zbpipe.testing.moe import TinyMoEConfig

    pp = dist.new_group([0, 1])
    eps = [dist.new_group([r]) for r in range(world)]
    groups = {"pp": pp, "ep": eps[rank]}
    forward = torch.tensor([_forward_time(rank, cfg, groups)])
    dist.all_reduce(forward, op=dist.ReduceOp.MAX)
    mcfg = TinyMoEConfig(vocab=256, hidden=cfg.hidden, seq=cfg.seq)
    ids, tgt = synthetic_batch(mcfg, cfg.microbatches * cfg.microbatch_size, 0)
    out: dict[str, Any] = {"chunk_forward_s": forward.item(), "runs": {}}
    for setting in cfg.latencies:
        latency = cfg.latency_share * forward.item() if setting < 0 else setting
        runs = {name: _build(name, rank, cfg, latency, groups) for name in SCHEDULES}
        times = _interleaved(rank, cfg, runs, ids, tgt)
        plans = {n: r[0].plan for n, r in runs.items() if n != "torch:DualPipeV"}
        pairs = {n: len(p.pairs) for n, p in plans.items()}
        how = {n: str(p.meta.get("strategy", "")) for n, p in plans.items()}
        a2a = getattr(runs["DualPipeV profile"][0].measured_costs, "a2a", None)
        out["runs"][f"{latency:.6f}"] = {
            "latency_s": latency, "times": times, "pairs": pairs, "strategy": how,
            "profiled_a2a_ms": list(a2a) if isinstance(a2a, tuple) else a2a,
        }  # fmt: skip
    return out if rank == 0 else None


def _interleaved(rank: int, cfg: Config, runs: dict, ids: Any, tgt: Any) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    def one_step(name: str) -> float:
        sched, stages = runs[name]
        for st in stages:
            for p in st.submod.parameters():
                p.grad = None
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(*((ids,) if first else ()), target=tgt if last else None)
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slower rank ends
        return took.item()

    for name in SCHEDULES:  # warm-up: shape inference, the allocator, the re-plans
        for _ in range(3):
            one_step(name)
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    for rep in range(cfg.reps):
        order = SCHEDULES[rep % len(SCHEDULES) :] + SCHEDULES[: rep % len(SCHEDULES)]
        for name in order:
            times[name].append(one_step(name))
    return times


def main() -> None:
    import json

    from results_io import RESULTS, write_result

    from zbpipe.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for field, default in asdict(Config()).items():
        if field != "latencies":
            parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--from-json", help="summarise a stored result again (no run)")
    parser.add_argument("--name", default="overlap", help="results file: NAME.json")
    args = vars(parser.parse_args())
    stored, name = args.pop("from_json"), args.pop("name")
    if stored:  # the times as measured, with the summary this version computes
        res = json.loads(open(stored).read())
        _summarise(res)
        (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        return
    cfg = Config(**args)
    res = run_ranks(_rank_main, 2, cfg, timeout=3000)[0]
    _summarise(res)
    path = write_result(name, {"config": asdict(cfg), **res})
    print(f"wrote {path}")


def _summarise(res: dict[str, Any]) -> None:
    """Medians, each schedule's time over the overlapped one's and the overlapped one's over
    each (paired per repetition); printed as a table."""
    from results_io import paired_ratios

    print(f"one chunk's forward: {res['chunk_forward_s'] * 1e3:.2f} ms")
    for run in res["runs"].values():
        base = run["times"]["DualPipeV overlap"]
        run["median_s"] = {n: statistics.median(t) for n, t in run["times"].items()}
        run["ratio_to_overlap"] = {n: paired_ratios(t, base) for n, t in run["times"].items()}
        run["overlap_over"] = {n: paired_ratios(base, t) for n, t in run["times"].items()}
        if "DualPipeV profile" in run["times"]:
            prof = run["times"]["DualPipeV profile"]
            run["profile_over"] = {n: paired_ratios(prof, t) for n, t in run["times"].items()}
        print(f"latency {run['latency_s'] * 1e3:.2f} ms per all-to-all; pairs {run['pairs']}")
        for name, t in run["times"].items():
            r = run["overlap_over"][name]
            q = run.get("profile_over", {}).get(name)
            print(
                f"  {name:<22} median {statistics.median(t) * 1e3:8.1f} ms   overlap / this "
                f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
                + (f"   profile / this {q['median']:.3f}" if q else "")
            )


if __name__ == "__main__":
    main()
