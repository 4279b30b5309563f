"""Per-rank bodies of tests/test_torch_compat.py (module level so spawned processes import them)."""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage

import zbpipe
from tests.schedules._dist_cases import reference_grads
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch


def weighted_loss(logits, target, *, weight: float = 1.0):
    return weight * lm_loss(logits, target)


def one_rank_pipeline_grads(rank, world, schedule, m, loss_weight):
    """Every stage of ``schedule`` on this one rank, loss_kwargs={"weight": loss_weight}; returns
    the largest gradient difference from an unpipelined reference with the same weight."""
    cls = getattr(zbpipe, schedule)
    cfg = TinyGPTConfig(tricky=True)
    n = len(cls.stage_index_to_rank(world))
    mods = build_stages(cfg, n, seed=3)
    ids, tgt = synthetic_batch(cfg, batch=2 * m, step=3)
    ref, _ = reference_grads(mods, ids, tgt, m)
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in range(n)]
    sched = cls(stages, m, loss_fn=weighted_loss)
    losses: list = []
    sched.step(ids, target=tgt, losses=losses, loss_kwargs={"weight": loss_weight})
    worst = 0.0
    for s in range(n):
        for p, q in zip(mods[s].parameters(), ref[s].parameters()):
            # fp32, same ops; the loss weight is a power of two, so scaling is exact.
            torch.testing.assert_close(p.grad, loss_weight * q.grad, rtol=1e-5, atol=1e-6)
            worst = max(worst, (p.grad - loss_weight * q.grad).abs().max().item())
    return worst
