"""What the V schedules hold against the budget their re-made plan keeps, per engine (issue 37).

``memory_promise.py`` divides V-Half's and V-Min's held peak by their formula in forward bytes
((p + 2) / 2 and (p + 4) / 3 microbatches of the model's first p-stage stage, from torch 1F1B's
rank 0). The promise zbpipe keeps (:func:`zbpipe.planning.yardsticks.v_budget`) adds what one
microbatch's backward holds beyond its forward on chunks 0 and 1 (the graph engine's recorded
gradients), so under the graph engine the two differ. This script runs the same model and meter
(tests/schedules/_memory_promise_cases.py, default arguments, 3 steps) and stores, per schedule
and engine: each step's held peak per rank, the re-made plan's predicted peak per rank and its
budget in bytes (probe units times the unit's bytes), and the forward-only formula.

Run:  PYTHONPATH=src:. python benchmarks/v_budget.py [--ranks 4] [--microbatches 8]
Writes benchmarks/results/v_budget_<ranks>ranks_m<m>.json.
"""

from __future__ import annotations

import argparse
from typing import Any

SCHEDULES = ("ZBV", "ZBVHalf", "ZBVMin")
ENGINES = ("deferred", "graph")


def rank_rows(rank: int, world: int, m: int) -> dict:
    """This rank's torch 1F1B peaks, and per (schedule, engine) its peaks and the plan's bytes."""
    import torch
    from tests.schedules import _memory_promise_cases as cases

    from zbpipe.planning import simulate

    torch.set_num_threads(1)
    out: dict[Any, Any] = {"torch": cases.run(rank, world, "torch", m, 2, {})[0]}
    for name in SCHEDULES:
        for split in ENGINES:
            peaks, sched = cases.run(rank, world, name, m, 3, {}, split=split)
            unit = sched.memory_unit_bytes
            sim = simulate(sched.plan, sched.memory_costs)
            c = sched.memory_costs
            out[(name, split)] = {
                "mem_f": list(c.mem_f),
                "mem_b": list(c.mem_b),
                "unit_bytes": unit,
                # what one microbatch's backward holds beyond F on chunks 0 and 1 (v_budget's)
                "backward_extra_units": max(0.0, c.mem_b[0] + c.mem_b[1]),
                "backward_extra_bytes": max(0.0, c.mem_b[0] + c.mem_b[1]) * unit,
                "peaks": peaks,
                "predicted": [sim.peak_memory[r] * unit for r in sorted(sim.peak_memory)],
                "budget": float(sched.plan.meta["memory_budget"]) * unit,
            }
    return out


def main() -> None:
    from results_io import write_result

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    p, m = args.ranks, args.microbatches
    per_rank = run_ranks(rank_rows, p, m, timeout=3000)
    stage0 = per_rank[0]["torch"][-1] / min(p, m)
    formula = {"ZBV": None, "ZBVHalf": (p + 2) / 2 * stage0, "ZBVMin": (p + 4) / 3 * stage0}
    rows = []
    for name in SCHEDULES:
        for split in ENGINES:
            mine = per_rank[0][(name, split)]
            steps = [[per_rank[r][(name, split)]["peaks"][i] for r in range(p)] for i in range(3)]
            row = {
                "schedule": name,
                "engine": split,
                "peak_bytes": steps,
                "predicted_bytes": mine["predicted"],
                "budget_bytes": mine["budget"],
                "mem_f": mine["mem_f"],
                "mem_b": mine["mem_b"],
                "unit_bytes": mine["unit_bytes"],
                "backward_extra_units": mine["backward_extra_units"],
                "backward_extra_bytes": mine["backward_extra_bytes"],
                "forward_formula_bytes": formula[name],
                "vs_budget": [max(s) / mine["budget"] for s in steps],
                "vs_predicted": [max(s) / max(mine["predicted"]) for s in steps],
            }
            if formula[name]:
                row["vs_forward_formula"] = [max(s) / formula[name] for s in steps]
            rows.append(row)
            print(
                f"{name:<8} {split:<9} vs budget "
                + " ".join(f"{x:.3f}" for x in row["vs_budget"])
                + "  vs predicted "
                + " ".join(f"{x:.3f}" for x in row["vs_predicted"])
                + (
                    "  vs forward formula "
                    + " ".join(f"{x:.3f}" for x in row["vs_forward_formula"])
                    if formula[name]
                    else ""
                )
            )
    write_result(
        f"v_budget_{p}ranks_m{m}",
        {"config": {"ranks": p, "microbatches": m}, "torch_1f1b_peak_bytes": per_rank[0]["torch"],
         "rows": rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
