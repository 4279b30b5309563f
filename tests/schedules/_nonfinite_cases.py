"""Rank functions for tests/schedules/test_nonfinite.py (module level: run_ranks pickles them)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from zbpipe.schedules.nonfinite import NonfiniteLosses


def dtensor_losses(rank: int, world: int) -> dict[str, list[int]]:
    """Each rank records DTensor losses (tensor parallelism's loss_parallel gives such) and
    reads back which microbatches were non-finite."""
    mesh = init_device_mesh("cpu", (world,))
    nan, inf = float("nan"), float("inf")
    # Replicate: every rank holds the full value. Partial (a pending sum over ranks): one rank's
    # inf makes the loss inf, a non-finite part on no rank keeps it finite.
    replicated = [DTensor.from_local(torch.tensor(v), mesh, [Replicate()]) for v in (1.0, nan)]
    parts = [(1.0, 2.0), (1.0, inf)]  # per loss: (rank 0's part, rank 1's part)
    partial = [DTensor.from_local(torch.tensor(p[rank]), mesh, [Partial()]) for p in parts]
    out = {}
    for name, losses in (("replicate", replicated), ("partial", partial)):
        check = NonfiniteLosses(rank=rank)
        check.record(losses)
        out[name] = check.resolve()
    return out
