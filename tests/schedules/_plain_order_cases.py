"""Rank bodies for tests/schedules/test_plain_order.py (one 2-rank launch)."""

from __future__ import annotations

import logging

import torch

from tests.schedules._dist_cases import CFG, reference_grads, run_pipeline_step
from zbpipe import Costs, ScheduleZBV
from zbpipe.planning import Plan, plan
from zbpipe.testing.models import build_stages, synthetic_batch

#: per-chunk costs under which ZB-V's order for equal costs is slower than the V placement's
#: plain order (a heavy last chunk, W heavy in the middle chunks): test_plain_order.py checks it
#: in the simulator
COSTS = Costs(f=[1.0, 1.0, 1.0, 3.0], b=[1.0, 1.0, 1.0, 3.0], w=[0.2, 3.0, 3.0, 0.2])


class ScheduleZBVForEqualCosts(ScheduleZBV):
    """ZB-V that plans for equal costs whatever it is given (a cost-oblivious zero-bubble
    plan): for :data:`COSTS` its plan is slower than the plain order."""

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options) -> Plan:
        return plan("ZBV", num_ranks, n_microbatches, costs=Costs(), memory="zb")


def plain_order_runs_with_reference_grads(rank: int, world: int, m: int) -> tuple[str, int]:
    """One step of the schedule given :data:`COSTS`; every local grad against the unpipelined
    model's. Returns the plan's name and how many INFO lines said the plain order runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("zbpipe.schedules.plain_order")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    mods = build_stages(CFG, 2 * world, seed=3)
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=3)
    ref, ref_losses = reference_grads(mods, ids, tgt, m)
    mine, losses, sched = run_pipeline_step(
        rank, world, ScheduleZBVForEqualCosts, m, mods, ids, tgt, costs=COSTS, measure_memory=False
    )
    for s in mine:
        for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
            assert p.grad is not None, f"stage {s} {name} has no grad"
            # fp32, same ops; only the summation order across microbatches can differ
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    if 2 * world - 1 in mine:
        torch.testing.assert_close(
            torch.stack(losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-6
        )
    said = sum(
        "runs the plain order" in r.getMessage() for r in records if r.levelno == logging.INFO
    )
    return sched.plan.name, said
