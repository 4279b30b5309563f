"""Per-rank bodies of the compiled default re-plan tests (module level: spawned processes import
them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from tests.engines._compile_cases import compile_blocks, mse, stages_and_reference
from zbpipe import _compat as C
from zbpipe.integrations.names import SCHEDULE_CLASSES

M = 4


def _compiled(mod: nn.Sequential, how: str) -> nn.Sequential:
    if how == "whole":  # the stage module itself, in place
        mod.compile(fullgraph=True, backend="aot_eager")
        return mod
    return compile_blocks(mod, how, "aot_eager")


def default_run(
    rank: int, world: int, name: str, how: str, measure_memory: bool = True
) -> dict[str, Any]:
    """Three steps of ``name`` with default arguments over blocks compiled as ``how`` says
    ("eager": not compiled; "whole": each stage module compiled whole). Returns the plan after
    the re-plan (name and order), the memory costs and bytes per unit it was made for, the graphs
    dynamo compiled in this run after each step (the process's cache may hold some already), the
    graph breaks so far and the largest gradient difference from an eager unpipelined reference
    over the steps."""
    cls = SCHEDULE_CLASSES[name]
    num_stages = world * cls.stages_per_rank
    mods, x, tgt, ref = stages_and_reference(num_stages, M)
    counters = C.dynamo_counters()
    start = counters["stats"]["unique_graphs"]
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [
        PipelineStage(_compiled(mods[s], how), s, num_stages, torch.device("cpu")) for s in mine
    ]
    sched = cls(stages, M, loss_fn=mse, measure_memory=measure_memory)
    equal_bytes = str(sched.plan.order)
    graphs, worst = [], 0.0
    for _ in range(3):
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        sched.step(*((x,) if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None)
        graphs.append(counters["stats"]["unique_graphs"] - start)
        for s in mine:
            for p, q in zip(mods[s].parameters(), ref[s].parameters()):
                worst = max(worst, (p.grad - q.grad).abs().max().item())
    costs = sched.memory_costs
    return {
        "plan": (sched.plan.name, str(sched.plan.order)),
        "replanned_order_differs": str(sched.plan.order) != equal_bytes,
        "memory": None if costs is None else (costs.mem_f, costs.mem_b, costs.mem_w),
        "unit_bytes": sched.memory_unit_bytes,
        "graphs": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "worst": worst,
    }


def runs(rank: int, world: int, todo: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Several ``default_run``s in one process group (starting processes is the slow part),
    sharing one compile cache, emptied here first."""
    torch.compiler.reset()
    C.dynamo_counters().clear()
    return [default_run(rank, world, *case) for case in todo]
