"""Rank bodies for tests/schedules/test_zb_interleaved.py (one 2-rank launch)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from tests.schedules._dist_cases import CFG, reference_grads
from zbpipe import Action, Costs, ScheduleZBInterleaved
from zbpipe.testing.models import build_stages, lm_loss, synthetic_batch

#: per-stage costs under which the plan defers W passes (heavy W, a heavy last stage): the run
#: then has Ws away from their B, not only the fused backward the runtime makes of adjacent ones
COSTS = Costs(f=[1, 1, 1, 1, 1, 2], b=[1, 1, 1, 1, 1, 2], w=[2, 2, 2, 2, 2, 0.5], comm=0.1)


def _run(
    rank: int, world: int, per_rank: int, m: int, steps: int = 1, **options: Any
) -> dict[str, Any]:
    """``steps`` steps of ScheduleZBInterleaved with ``per_rank`` stages per rank; every local
    grad of each step against the unpipelined model's (fresh grads per step)."""
    num_stages = world * per_rank
    mods = build_stages(CFG, num_stages, seed=5)
    mine = [s for s in range(num_stages) if s % world == rank]
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleZBInterleaved(stages, m, loss_fn=lm_loss, **options)
    worst = 0.0
    for step in range(steps):
        ids, tgt = synthetic_batch(CFG, batch=2 * m, step=step)
        ref, ref_losses = reference_grads(mods, ids, tgt, m)
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        losses: list = []
        sched.step(
            *((ids,) if 0 in mine else ()),
            target=tgt if num_stages - 1 in mine else None,
            losses=losses,
        )
        for s in mine:
            for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
                assert p.grad is not None, f"stage {s} {name} has no grad"
                # fp32, same ops; only the order microbatch gradients are summed in differs
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                worst = max(worst, (p.grad - q.grad).abs().max().item())
        if num_stages - 1 in mine:
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    order = sched.plan.order[rank]
    deferred = sum(
        1
        for i, a in enumerate(order)
        if a.kind == "W" and order[i - 1] != Action(a.stage, "B", a.microbatch)
    )
    return {"stages": mine, "plan": sched.plan.name, "deferred_w": deferred, "worst": worst}


def cases(rank: int, world: int) -> dict[str, Any]:
    """Every case, in one launch: 2 stages per rank (torchtitan's default; bytes measured on the
    first step and the plan re-made), 3 per rank with costs that defer Ws, 3 microbatches (one
    round of 3), and a count the schedule refuses, on every rank, before any message."""
    out: dict[str, Any] = {
        "two": _run(rank, world, 2, 4, steps=2),  # the second runs the re-made plan
        "three": _run(rank, world, 3, 4, costs=COSTS, measure_memory=False),
        "one_round": _run(rank, world, 2, 3, measure_memory=False),
    }
    mods = build_stages(CFG, 4, seed=5)
    stages = [PipelineStage(mods[s], s, 4, torch.device("cpu")) for s in (rank, rank + 2)]
    try:
        ScheduleZBInterleaved(stages, 5, loss_fn=lm_loss)
    except ValueError as e:
        out["refused"] = str(e)
    return out
