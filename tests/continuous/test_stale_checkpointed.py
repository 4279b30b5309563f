"""2bw and stash over blocks under eager activation checkpointing.

Non-reentrant ``torch.utils.checkpoint`` recomputes a block's forward during its backward, and the
recompute reads the module's parameter slots as they are then. A stale mode runs each microbatch
on a weight version put in those slots for its forward; by its B another microbatch's version (or
the master weights, put back after every ``step()``) may sit there. torch's checkpoint compares
only shapes and dtypes, so B ran at the wrong weights silently (0.3% of 2bw's update off on the
first stage). Each run here ends with the parameters the mode's version rule gives on the
unpipelined, uncheckpointed model, for both engines.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.pipelining import PipelineStage

import zbpipe
from tests.engines._compile_cases import Checkpointed, mlp_stages, mse
from tests.engines._compile_every_cases import N_CONTINUOUS, M, _sgd, batch, continuous_reference
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist


def _checkpointed_run(rank: int, world: int, mode: str, split: str) -> list[float]:
    mod = mlp_stages(world)[rank]
    for i, block in enumerate(mod):
        mod[i] = Checkpointed(block)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = zbpipe.ScheduleContinuous(
        [stage], M, loss_fn=mse, mode=mode, optimizer=_sgd, split=split
    )
    for k in range(N_CONTINUOUS):
        x, tgt = batch(k)
        sched.step(*((x,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
    sched.flush()
    want = continuous_reference(world, mode, "eager", "")[rank]
    return [
        float((p.detach() - q).abs().max()) for p, q in zip(mod.parameters(), want, strict=True)
    ]


RUNS = [(mode, split) for split in ("deferred", "graph") for mode in ("2bw", "stash")]


def _checkpointed_runs(rank: int, world: int) -> list[list[float]]:
    """Every (mode, split) of RUNS in one process group (starting ranks costs more than a run)."""
    return [_checkpointed_run(rank, world, mode, split) for mode, split in RUNS]


@pytest.fixture(scope="module")
def diffs() -> dict[tuple[str, str], list[list[float]]]:
    """{(mode, split): per rank, its parameters' largest differences from the reference}."""
    per_rank = run_ranks(_checkpointed_runs, 2, timeout=240)
    return {run: [rank[i] for rank in per_rank] for i, run in enumerate(RUNS)}


@pytest.mark.parametrize("split", ["deferred", "graph"])
def test_stale_modes_recompute_at_their_own_version(diffs, split):
    for mode in ("2bw", "stash"):
        for rank, diffs_of_rank in enumerate(diffs[mode, split]):
            # SGD with momentum over 3 mini-batches: fp32 rounding only
            np.testing.assert_array_less(diffs_of_rank, 1e-6, err_msg=f"{mode} {split} rank {rank}")
