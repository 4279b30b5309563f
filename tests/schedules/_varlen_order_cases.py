"""Per-rank body for tests/schedules/test_varlen_order.py: a step's microbatches run in the
order the simulator finds fastest (``step(microbatch_costs=...)`` on stage 0's rank only), and
the caller still gets losses, outputs and gradients as if they ran in data order."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.schedules._varlen_cases import data, my_stages, reference, token_loss
from zbpipe.planning.by_cost import order_by_cost, token_scales
from zbpipe.schedules import classes


def ordered_steps(
    rank: int, world: int, schedules: list[str], draws: list[list[int]]
) -> dict[str, list[tuple]]:
    """For each schedule, one step per draw; returns per step the order stage 0's rank expects
    to run (computed here from the plan) so the test can see that it is not data order."""
    return {name: _steps(rank, world, name, draws) for name in schedules}


def _steps(rank: int, world: int, schedule: str, draws: list[list[int]]) -> list[tuple]:
    cls = getattr(classes, schedule)
    stages, mine, mods, parts, num_stages = my_stages(rank, world, cls)
    sched = cls(stages, len(draws[0]), loss_fn=token_loss, scale_grads=False, variable_shapes=True)
    first, last = 0 in mine, num_stages - 1 in mine
    whole = nn.Sequential(*mods)
    seen = []
    for i, lengths in enumerate(draws):
        ids, targets = data(lengths, seed=i)
        total = sum(t.numel() for t in targets)
        expected = reference(mods, ids, targets, tokens=True)
        ref = nn.Sequential(*copy.deepcopy(mods))
        with torch.no_grad():  # each microbatch's loss, in data order
            ref_losses = [token_loss(ref(x), t, total) for x, t in zip(ids, targets, strict=True)]
        whole.zero_grad(set_to_none=True)
        scales = token_scales(lengths)
        losses: list = []
        out = sched.step(
            arg_mbs=[(x,) for x in ids] if first else None,
            target_mbs=targets if last else None,
            losses=losses if last else None,
            loss_kwargs={"num_tokens": total},
            microbatch_costs=scales if first else None,  # only stage 0's rank knows them
        )
        seen.append(order_by_cost(sched.plan, sched.costs, scales).slots)
        if last:
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
            assert [o.shape[1] for o in out] == lengths, [o.shape for o in out]
        owned = {id(p) for s in mine for j in parts[s] for p in mods[j].parameters()}
        for p, e in zip(whole.parameters(), expected, strict=True):
            if id(p) in owned:
                # fp32; microbatches are summed in another order than the reference's
                torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
    return seen
