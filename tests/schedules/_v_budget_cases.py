"""Per-rank body of test_v_min_graph_budget.py (module level: spawned processes import it)."""

from __future__ import annotations

import torch

from tests.schedules import _memory_promise_cases as cases


def v_min_graph_rows(rank: int, world: int, m: int) -> dict:
    """torch 1F1B's held peak per step, V-Min's under the graph engine (default arguments, two
    steps: the measured start, then the re-made plan), the bytes the probe measured for chunks 0
    and 1 (after F, and added by B until W) and the re-made plan's budget in bytes."""
    torch.set_num_threads(1)
    out: dict = {"torch": cases.run(rank, world, "torch", m, 2, {})[0]}
    peaks, sched, _ = cases.run(rank, world, "ZBVMin", m, 2, {}, split="graph")
    unit = sched.memory_unit_bytes
    sc = sched.memory_costs.per_stage(2 * world)
    out["vmin"] = {
        "peaks": peaks,
        "mem_f": [sc[0].mem_f * unit, sc[1].mem_f * unit],
        "mem_b": [sc[0].mem_b * unit, sc[1].mem_b * unit],
        "plan_budget": float(sched.plan.meta["memory_budget"]) * unit,
    }
    return out
