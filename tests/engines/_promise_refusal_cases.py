"""Per-rank body of tests/engines/test_graph_promise_refusal.py (module level: spawned ranks
import it): which engine a real schedule takes on checkpointed stages, and what it logs."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.pipelining import PipelineStage

import zbpipe


class ConvBlock(nn.Module):
    """``x + conv(x)``: a weight only the graph engine defers (so ``auto`` prefers it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 5, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def choices(rank: int, world: int, todo: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
    """For each (schedule class name, split, wrapped): build the schedule on one rank holding
    its stages (2 for a V schedule, else 1) of ConvBlocks, ``checkpoint_wrapper``ed (full
    checkpointing) where ``wrapped``, run one step; the engine taken and the engine-choice log
    records of WARNING and of INFO that name checkpointing."""
    out = []
    logger = logging.getLogger("zbpipe.engines.auto_split")
    for cls_name, split, wrapped in todo:
        cls = getattr(zbpipe, cls_name)
        n = 2 if cls.layout == "v" else 1
        torch.manual_seed(0)
        mods = [
            nn.Sequential(checkpoint_wrapper(ConvBlock()) if wrapped else ConvBlock())
            for _ in range(n)
        ]
        stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in range(n)]
        handler = _Records()
        logger.addHandler(handler)
        level = logger.level
        logger.setLevel(logging.INFO)
        try:
            sched = cls(stages, 4, loss_fn=F.mse_loss, split=split)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        sched.step(torch.randn(8, 8, 4), target=torch.randn(8, 8, 4))
        out.append(
            {
                "split": sched.split,
                "warnings": [m for lv, m in handler.records if lv == "WARNING"],
                "info_ac": [m for lv, m in handler.records if lv == "INFO" and "checkpointed" in m],
            }
        )
    return out
