"""Per-rank body of tests/engines/test_recompute_once.py (module level: spawned ranks import it).

One rank holds a 2-stage V pipeline (``ScheduleZBV``, the plan for equal bytes: B and W apart
for most pairs) of 2 checkpointed MLP blocks per stage, m = 4, under each engine and each
checkpointing flavour, in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import checkpoint

import zbpipe
from tests.engines._checkpoint_cases import selective_context
from tests.engines._compile_cases import mse, stages_and_reference


class CountedBlock(nn.Module):
    """``block`` under non-reentrant checkpointing (``ac``: "full", or "selective" with a policy
    that saves the matmuls) counting every run of its forward: the step's and the recomputes'."""

    def __init__(self, block: nn.Module, ac: str, calls: list[int]) -> None:
        super().__init__()
        self.block, self.ac, self.calls = block, ac, calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {"context_fn": selective_context} if self.ac == "selective" else {}
        out: torch.Tensor = checkpoint(self._run, x, use_reentrant=False, **kwargs)
        return out

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        out: torch.Tensor = self.block(x)
        return out


def block_forwards(split: str, ac: str, m: int = 4) -> dict[str, Any]:
    """The block forwards of a step (the second: the first also infers shapes) and the largest
    gradient difference from an uncheckpointed, unpipelined reference."""
    mods, x, tgt, ref = stages_and_reference(2, m)
    calls = [0]
    for mod in mods:
        for i, block in enumerate(mod):
            mod[i] = CountedBlock(block, ac, calls)
    stages = [PipelineStage(mods[s], s, 2, torch.device("cpu")) for s in range(2)]
    sched = zbpipe.ScheduleZBV(stages, m, loss_fn=mse, split=split, measure_memory=False)
    for _ in range(2):
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        calls[0] = 0
        sched.step(x, target=tgt)
    worst = max(
        (p.grad - q.grad).abs().max().item()
        for s in range(2)
        for p, q in zip(mods[s].parameters(), ref[s].parameters(), strict=True)
    )
    return {"split": sched.split, "forwards": calls[0], "worst": worst}


def all_block_forwards(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """:func:`block_forwards` for both engines and both flavours, keyed "split/ac"."""
    return {
        f"{split}/{ac}": block_forwards(split, ac)
        for split in ("deferred", "graph")
        for ac in ("full", "selective")
    }
