"""Per-rank body for tests/schedules/test_varlen_steady.py: which steps of a varlen pipeline run
the shape exchange's all-reduce. Counted by wrapping ``dist.all_reduce`` in the rank process
(the exchange calls it through ``torch.distributed``), with every step's gradients checked
against the unpipelined model (tests/schedules/_varlen_cases.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.schedules._varlen_cases import data, my_stages, reference, token_loss
from zbpipe.schedules import classes


def all_reduces_per_step(
    rank: int, world: int, schedules: list[str], draws: list[list[int]]
) -> dict[str, list[int]]:
    """For each schedule, one step per draw of lengths: how many all-reduces each step ran (on
    this rank). Asserts each step's gradients against the whole model's."""
    calls = [0]
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        return {name: _steps(rank, world, name, draws, calls) for name in schedules}
    finally:
        dist.all_reduce = original


def _steps(rank: int, world: int, schedule: str, draws: list[list[int]], calls: list[int]):
    cls = getattr(classes, schedule)
    stages, mine, mods, parts, num_stages = my_stages(rank, world, cls)
    sched = cls(stages, len(draws[0]), loss_fn=token_loss, scale_grads=False, variable_shapes=True)
    whole = nn.Sequential(*mods)
    counts = []
    for i, lengths in enumerate(draws):
        ids, targets = data(lengths, seed=i)
        expected = reference(mods, ids, targets, tokens=True)
        whole.zero_grad(set_to_none=True)
        before = calls[0]
        sched.step(
            arg_mbs=[(x,) for x in ids] if 0 in mine else None,
            target_mbs=targets if num_stages - 1 in mine else None,
            loss_kwargs={"num_tokens": sum(t.numel() for t in targets)},
        )
        counts.append(calls[0] - before)
        owned = {id(p) for s in mine for j in parts[s] for p in mods[j].parameters()}
        for p, e in zip(whole.parameters(), expected, strict=True):
            if id(p) in owned:
                # fp32; microbatches are summed in another order than the reference's
                torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
    return counts
