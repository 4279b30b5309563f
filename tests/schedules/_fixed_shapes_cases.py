"""Per-rank body for tests/schedules/test_fixed_shapes.py: schedules built without
``variable_shapes=True`` send no shapes; a microbatch of another shape gets a ValueError on the
rank of stage 0 before any message of its step.

"Before any message" is checked by what follows the error: stage 0's rank catches it and runs
the step again with good microbatches, which the other rank (still inside its one call of
``step()``) must take as its step, with the unpipelined model's gradients. A message sent before
the error would have left the two ranks one message apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.schedules._varlen_cases import data, my_stages, reference, token_loss
from zbpipe.schedules import classes

EQUAL = [16, 16, 16, 16]


def fixed_shape_steps(rank: int, world: int, schedules: list[str]) -> None:
    """Each schedule: a bad first step then its retry, a good step, a bad step then its retry,
    ``microbatch_costs`` refused then the retry; gradients checked after every step that ran.
    Then a bad step left uncaught on stage 0's rank: its process fails with the ValueError and
    the launcher ends the other one (the test reads both)."""
    for name in schedules:
        sched, mine, mods, parts = _build(rank, world, name)
        first, last = 0 in mine, len(parts) - 1 in mine
        bad_steps = {
            0: (
                [16, 9, 16, 16],
                "microbatch 1's argument 0 has shape (1, 9), but the stages "
                "were set up for (1, 16)",
            ),
            2: ([16, 16, 16, 30], "microbatch 3's argument 0 has shape (1, 30)"),
        }
        for i in range(4):
            ids, targets = data(EQUAL, seed=i)
            expected = reference(mods, ids, targets, tokens=True)
            nn.Sequential(*mods).zero_grad(set_to_none=True)
            total = sum(t.numel() for t in targets)
            if first and i in bad_steps:
                lengths, phrase = bad_steps[i]
                bad, _ = data(lengths, seed=i)
                with pytest.raises(ValueError, match="variable_shapes=True") as err:
                    sched.step(
                        arg_mbs=[(x,) for x in bad],
                        target_mbs=targets if last else None,  # V: stage 0's rank holds the last
                        loss_kwargs={"num_tokens": total},
                    )
                assert phrase in str(err.value), str(err.value)
            if first and i == 3:
                with pytest.raises(ValueError, match="needs the schedule built with"):
                    sched.step(
                        arg_mbs=[(x,) for x in ids],
                        target_mbs=targets if last else None,
                        loss_kwargs={"num_tokens": total},
                        microbatch_costs=[1.0, 2.0, 3.0, 4.0],
                    )
            sched.step(  # the retry on stage 0's rank; the only call on the other
                arg_mbs=[(x,) for x in ids] if first else None,
                target_mbs=targets if last else None,
                loss_kwargs={"num_tokens": total},
            )
            _check_grads(mods, parts, mine, expected)
    ids, targets = data(EQUAL, seed=9)
    bad, _ = data([16, 16, 5, 16], seed=9)
    sched.step(
        arg_mbs=[(x,) for x in bad] if first else None,
        target_mbs=targets if last else None,
        loss_kwargs={"num_tokens": 64},
    )


def _build(rank: int, world: int, name: str) -> tuple:
    cls = getattr(classes, name)
    stages, mine, mods, parts, num_stages = my_stages(rank, world, cls)
    sched = cls(stages, len(EQUAL), loss_fn=token_loss, scale_grads=False)
    return sched, mine, mods, parts


def _check_grads(mods: list, parts: list, mine: list[int], expected: list) -> None:
    owned = {id(p) for s in mine for j in parts[s] for p in mods[j].parameters()}
    for p, e in zip(nn.Sequential(*mods).parameters(), expected, strict=True):
        if id(p) in owned:
            # fp32; microbatches are summed in another order than the reference's
            torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
