"""The re-made plan against the plan for equal bytes, in the bytes the probe measured (issue 37).

2 gloo ranks, the shape of issue 37 (``real_run.py --model mlp``). Per schedule (default
arguments, one step: the probe measures, the plan is re-made): the bytes each stage holds after
F and after B, the memory costs and the unit's bytes, torch 1F1B's peak on the same model (the
promise), and for the plan for equal bytes (what ``measure_memory=False`` runs) and the re-made
plan, each one's simulated peak per rank and step time under the measured memory costs.

Run:  PYTHONPATH=src python benchmarks/replan_vs_equal.py [--schedules ZBV,ZBH1,ZB1P]
Writes benchmarks/results/replan_vs_equal_mlp_m4.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from real_run import Config, _build  # noqa: E402


def _plan_row(plan: Any, costs: Any, promise: float) -> dict:
    from zbpipe.planning import simulate

    sim = simulate(plan, costs)
    peak = max(sim.peak_memory.values())
    return {
        "order": {r: " ".join(f"{a.stage}{a.kind}{a.microbatch}" for a in acts)
                  for r, acts in plan.order.items()},
        "peak_units_per_rank": [sim.peak_memory[r] for r in sorted(sim.peak_memory)],
        "peak_over_promise": peak / promise,
        "step_time_units": sim.makespan,
    }  # fmt: skip


def _rank_main(rank: int, world: int, cfg: Config) -> dict | None:
    import torch

    from zbpipe.planning.yardsticks import onef1b_peak

    torch.manual_seed(1)
    x = torch.randn(cfg.microbatches * cfg.microbatch_size, cfg.hidden)
    target = torch.randn_like(x)
    out: dict[str, Any] = {}
    for name in cfg.schedules:
        sched, stages, _, _ = _build(name, rank, world, cfg)
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        sched.step(*((x,) if first else ()), target=target if last else None)
        c, unit = sched.memory_costs, sched.memory_unit_bytes
        chunks = sched._num_stages // world
        promise = onef1b_peak(world, cfg.microbatches, c.joined(chunks) if chunks > 1 else c)
        out[name] = {
            "mem_f": list(c.mem_f),
            "mem_b": list(c.mem_b),
            "unit_bytes": unit,
            "after_f_bytes": [f * unit for f in c.mem_f],
            "after_b_bytes": [(f + b) * unit for f, b in zip(c.mem_f, c.mem_b)],
            "promise_units": promise,
            "promise_bytes": promise * unit,
            "equal_bytes_plan": _plan_row(sched.equal_bytes_plan, c, promise),
            "remade_plan": _plan_row(sched.plan, c, promise),
        }
    return out if rank == 0 else None


def main() -> None:
    from results_io import write_result

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", default="ZBV,ZBH1,ZB1P")
    args = ap.parse_args()
    cfg = Config(
        reps=1, microbatches=4, microbatch_size=32, hidden=1024, blocks=8, meter=0, model="mlp",
        schedules=tuple(args.schedules.split(",")),
    )  # fmt: skip
    res = run_ranks(_rank_main, 2, cfg, timeout=900)[0]
    for name, r in res.items():
        e, n = r["equal_bytes_plan"], r["remade_plan"]
        print(
            f"{name}: promise {r['promise_bytes'] / 2**20:.3f} MiB; equal bytes "
            f"{e['peak_over_promise']:.2f}x it, {e['step_time_units']:g} units; re-made "
            f"{n['peak_over_promise']:.2f}x, {n['step_time_units']:g} units"
        )
    write_result("replan_vs_equal_mlp_m4", {"results": res})


if __name__ == "__main__":
    main()
