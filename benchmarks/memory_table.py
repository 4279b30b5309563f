"""Peak memory held for backward, per schedule and engine, against torch's Schedule1F1B.

N gloo processes (``--ranks``), one thread each, train one tiny GPT (``--blocks`` transformer
blocks, default 2 x ranks; an embedding in the first stage, the LM head and loss in the last).
Each zbpipe schedule is built with ``costs="profile"`` (``--costs units``: the default equal
costs instead): 1 warm-up step, 2 profiled steps (times and bytes measured, re-planned), then
``--steps`` measured steps. torch's ``Schedule1F1B`` runs the same model in ``ranks`` stages.

A :class:`zbpipe.memory.SavedActivationMeter` counts, on every rank, what is held for backward
by the same rules for every schedule (saved tensors, stage outputs, input gradients until
freed; for zbpipe also the deferred queue or the graph engine's recorded gradients). Reported:
the peak over the measured steps, max over ranks, and its ratio to torch 1F1B's; for V-Half and
V-Min also the ratio to their stated budget, ``(p + 2) / 2`` and ``(p + 4) / 3`` microbatches
of the model's first p-stage stage (its chunks 0 and 1), in the bytes ``costs="profile"``
measured.

Run:  PYTHONPATH=src python benchmarks/memory_table.py --ranks 4 [--vocab 256] [--costs profile]
Writes benchmarks/results/memory_table_<ranks>ranks_v<vocab>[_units].json.
Memory does not depend on speed: 4 ranks on 2 cores measure it honestly (slowly).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

SCHEDULES = ("ZBH1", "ZB1P", "ZBV", "ZBVHalf", "ZBVMin")
ENGINES = ("deferred", "graph")
V_FACTORS = {"ZBVHalf": lambda p: (p + 2) / 2, "ZBVMin": lambda p: (p + 4) / 3}


@dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int = 4
    microbatches: int = 8
    microbatch_size: int = 4
    hidden: int = 256
    seq: int = 64
    vocab: int = 256
    blocks: int = 0
    """transformer blocks in the whole model; 0 means 2 x ranks (one per V chunk)"""
    steps: int = 2
    costs: str = "profile"
    """"profile": costs="profile" (measured times and bytes); "units": equal unit costs"""


def _stages(cfg: Config, rank: int, world: int, n_stages: int, v: bool) -> list:
    import torch
    from torch.distributed.pipelining import PipelineStage

    from zbpipe.planning import loop_placement, v_placement
    from zbpipe.testing.models import TinyGPTConfig, build_stages

    blocks = cfg.blocks or 2 * world
    mcfg = TinyGPTConfig(
        vocab=cfg.vocab,
        hidden=cfg.hidden,
        seq=cfg.seq,
        heads=4,
        blocks_per_stage=blocks // n_stages,
    )
    modules = build_stages(mcfg, n_stages, seed=0)
    placement = v_placement(world) if v else loop_placement(world, n_stages)
    mine = sorted(s for s, r in placement.items() if r == rank)
    return [PipelineStage(modules[s], s, n_stages, torch.device("cpu")) for s in mine]


def _measure(cfg: Config, rank: int, world: int, name: str, engine: str | None) -> dict:
    """One schedule: this rank's peak over the measured steps, and the plan's figures."""
    import gc

    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    from zbpipe import get_schedule_class
    from zbpipe.memory import SavedActivationMeter
    from zbpipe.observe.profile import ProfileConfig
    from zbpipe.patching import undo_all
    from zbpipe.testing.models import TinyGPTConfig, lm_loss, synthetic_batch

    m = cfg.microbatches
    v = name.startswith("ZBV")
    stages = _stages(cfg, rank, world, 2 * world if v else world, v)
    meter = SavedActivationMeter()
    patches: list = []
    if name == "torch:1F1B":
        # torch computes the loss outside the stage's forward: count what it saves too
        sched = Schedule1F1B(stages[0], m, loss_fn=meter.watch_loss(lm_loss))
        for st in stages:
            patches += meter.attach(st)
    else:
        options: dict[str, Any] = {"split": engine}
        if cfg.costs == "profile":
            options["costs"] = "profile"
            options["profile"] = ProfileConfig(warmup_steps=1, profile_steps=2, comm=0.0)
        sched = get_schedule_class(name)(stages, m, loss_fn=lm_loss, trace=False, **options)
        sched.attach_meter(meter)
    mcfg = TinyGPTConfig(vocab=cfg.vocab, hidden=cfg.hidden, seq=cfg.seq)
    first = any(st.is_first for st in stages)
    last = any(st.is_last for st in stages)
    warm = 3 if cfg.costs == "profile" and name != "torch:1F1B" else 1
    peaks = []
    for step in range(warm + cfg.steps):
        x, y = synthetic_batch(mcfg, m * cfg.microbatch_size, step)
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        gc.collect()
        meter.begin_step()
        sched.step(*((x,) if first else ()), target=y if last else None)
        gc.collect()
        if step >= warm:
            peaks.append(meter.end_step().peak_bytes)
    undo_all(patches)
    dist.barrier()
    out: dict[str, Any] = {"peak": max(peaks)}
    profiler = getattr(sched, "_profiler", None)
    if profiler is not None and profiler.memory_unit_bytes is not None:
        out["unit_bytes"] = profiler.memory_unit_bytes
        costs = sched.measured_costs
        # V-Half / V-Min's stated budget: factor x the first p-stage stage (chunks 0 and 1)
        out["stage0_bytes"] = (costs.stage(0).mem_f + costs.stage(1).mem_f) * out["unit_bytes"]
    return out


def _rank_main(rank: int, world: int, cfg: Config) -> list[dict]:
    import logging

    import torch

    torch.set_num_threads(1)
    # rank 0 logs each re-plan: the measured costs and the plan's predicted peak
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    runs = [("torch:1F1B", None)] + [(s, e) for e in ENGINES for s in SCHEDULES]
    for name, engine in runs:
        rows.append(
            {"schedule": name, "engine": engine, **_measure(cfg, rank, world, name, engine)}
        )
    return rows


def peak_table(
    per_rank: list[list[dict]], ranks: int, keys: tuple[str, ...], budget_name: str
) -> list[dict]:
    """One entry per measured run: its ``keys``, every rank's peak, the max over ranks against
    the first run's (torch's 1F1B), and for V-Half / V-Min their formula's bytes
    (``<budget_name>_bytes``) and the peak against it (``vs_<budget_name>``)."""
    base = max(r[0]["peak"] for r in per_rank)
    table = []
    for i, row in enumerate(per_rank[0]):
        peaks = [r[i]["peak"] for r in per_rank]
        entry = {k: row[k] for k in keys}
        entry |= {"peak_bytes_per_rank": peaks, "vs_torch_1f1b": max(peaks) / base}
        if row["schedule"] in V_FACTORS and "stage0_bytes" in row:
            budget = V_FACTORS[row["schedule"]](ranks) * row["stage0_bytes"]
            entry[f"{budget_name}_bytes"] = budget
            entry[f"vs_{budget_name}"] = max(peaks) / budget
        table.append(entry)
    return table


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(Config()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(default), default=default)
    ap.add_argument("--out", default=None)
    args = vars(ap.parse_args(argv))
    out_path = args.pop("out")
    cfg = Config(**args)
    from zbpipe.testing import run_ranks

    per_rank = run_ranks(_rank_main, cfg.ranks, cfg, timeout=3000, pg_timeout=600)
    table = peak_table(per_rank, cfg.ranks, ("schedule", "engine"), "stated_budget")
    from results_io import write_result

    result = {"config": asdict(cfg), "rows": table}
    suffix = "" if cfg.costs == "profile" else "_units"
    write_result(f"memory_table_{cfg.ranks}ranks_v{cfg.vocab}{suffix}", result, path=out_path)
    print(f"{'schedule':<12} {'engine':<9} {'peak MiB per rank':<36} vs 1F1B  vs budget")
    for e in table:
        per = "/".join(f"{b / 2**20:.2f}" for b in e["peak_bytes_per_rank"])
        vb = f"{e['vs_stated_budget']:.3f}" if "vs_stated_budget" in e else ""
        print(
            f"{e['schedule']:<12} {e['engine'] or '':<9} {per:<36} {e['vs_torch_1f1b']:.3f}    {vb}"
        )
    return result


if __name__ == "__main__":
    main()
