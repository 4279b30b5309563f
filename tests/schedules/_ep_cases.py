"""Per-rank body of the expert-parallel x pipeline-parallel test (module level: ranks import it).

Four ranks: PP = 2 x EP = 2. Rank ``r`` is pipeline rank ``r // 2`` of replica ``r % 2``; the two
ranks of one pipeline rank form an EP group (they hold the same stages, and each stage's experts
are split between them); each replica is a pipeline of its own with its own data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import zbpipe
from zbpipe.testing.expert_parallel import ExpertParallelMoE

DIM, EXPERTS, ROWS = 8, 4, 6


def stage_module(index: int, ep_group: Any, reference: bool = False) -> nn.Sequential:
    """Stage ``index``: a Linear (deferred to W by the deferred engine), then an EP MoE layer."""
    torch.manual_seed(100 + index)
    dense = nn.Linear(DIM, DIM)
    moe = ExpertParallelMoE(DIM, EXPERTS, ep_group, seed=200 + index, reference=reference)
    return nn.Sequential(dense, moe)


def batch(replica: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + replica)
    return torch.randn(m * ROWS, DIM, generator=gen), torch.randn(m * ROWS, DIM, generator=gen)


def ep_pp_grads(rank: int, world: int, runs: list[tuple[str, dict[str, Any]]], m: int = 4) -> Any:
    """For each ``(schedule name, options)``: two steps of that schedule on every replica, then
    the largest difference of this rank's gradients (the replicated weights' summed over the EP
    group, as data parallelism sums them) from an unpipelined single-process model with every
    expert, trained on both replicas' batches. Also the engine each schedule ran."""
    pp_rank, replica = divmod(rank, 2)
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_group, pp_group = ep_groups[pp_rank], pp_groups[replica]
    out = []
    for name, options in runs:
        cls = zbpipe.get_schedule_class(name)
        n = 2 * cls.stages_per_rank
        mine = sorted(s for s, r in cls.stage_index_to_rank(2).items() if r == pp_rank)
        mods = {s: stage_module(s, ep_group) for s in mine}
        ref = nn.Sequential(*(stage_module(s, None, reference=True) for s in range(n)))
        total = sum(
            torch.stack(
                [F.mse_loss(ref(a), b) for a, b in zip(*(t.chunk(m) for t in batch(e, m)))]
            ).mean()
            for e in range(2)
        )
        total.backward()
        stages = [PipelineStage(mods[s], s, n, torch.device("cpu"), group=pp_group) for s in mine]
        sched = cls(stages, m, loss_fn=F.mse_loss, **options)
        x, tgt = batch(replica, m)
        for _ in range(2):  # the second on the plan re-made for the bytes the first measured
            for mod in mods.values():
                mod.zero_grad(set_to_none=True)
            sched.step(*((x,) if 0 in mine else ()), target=tgt if n - 1 in mine else None)
        worst = 0.0
        for s, mod in mods.items():
            for (pname, p), q in zip(mod.named_parameters(), ref[s].parameters(), strict=True):
                grad = p.grad
                if pname.endswith("experts"):
                    want = q.grad[mod[1].local_slice()]
                else:  # replicated over the EP group: each replica's share, summed
                    dist.all_reduce(grad, group=ep_group)
                    want = q.grad
                worst = max(worst, (grad - want).abs().max().item())
        out.append((name, sched.split, worst))
    return out
