"""Per-rank body for tests/schedules/test_varlen_4ranks.py: microbatches of drawn lengths on 4
gloo ranks (8 stages under V placement), gradients against the unpipelined model of
tests/schedules/_varlen_cases.py (same layers, one block per stage)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from tests.schedules._varlen_cases import (
    Block,
    Embed,
    Head,
    data,
    owned_grads_close,
    reference,
    token_loss,
)
from zbpipe.schedules import classes


def _model(num_stages: int) -> tuple[list[nn.Module], list[list[int]]]:
    """Embedding, one block per stage, head; stage 0 holds the embedding, the last the head."""
    torch.manual_seed(0)
    mods = [Embed(), *(Block() for _ in range(num_stages)), Head()]
    parts = [[s + 1] for s in range(num_stages)]
    parts[0].insert(0, 0)
    parts[-1].append(num_stages + 1)
    return mods, parts


def varlen_4ranks(rank: int, world: int, schedules: list[str], draws: list[list[int]]) -> float:
    """Each schedule, one step per draw of lengths (loss divided by the step's token count);
    returns the largest gradient difference."""
    worst = 0.0
    for name in schedules:
        cls = getattr(classes, name)
        num_stages = world * cls.stages_per_rank
        mods, parts = _model(num_stages)
        mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
        stages = [
            PipelineStage(nn.Sequential(*(mods[i] for i in parts[s])), s, num_stages, "cpu")
            for s in mine
        ]
        m = len(draws[0])
        # measure_memory=False: the memory re-plan after the first step searches ZB-V's plans
        # for seconds on 8 stages; what is checked here does not depend on the plan's order
        sched = cls(
            stages,
            m,
            loss_fn=token_loss,
            scale_grads=False,
            variable_shapes=True,
            measure_memory=False,
        )
        first, last = 0 in mine, num_stages - 1 in mine
        owned = {id(p) for s in mine for i in parts[s] for p in mods[i].parameters()}
        for i, lengths in enumerate(draws):
            ids, targets = data(lengths, seed=i)
            expected = reference(mods, ids, targets, tokens=True)
            nn.Sequential(*mods).zero_grad(set_to_none=True)
            sched.step(
                arg_mbs=[(x,) for x in ids] if first else None,
                target_mbs=targets if last else None,
                loss_kwargs={"num_tokens": sum(t.numel() for t in targets)},
            )
            params = list(nn.Sequential(*mods).parameters())
            worst = max(worst, owned_grads_close(params, expected, owned, name, lengths))
    return worst
