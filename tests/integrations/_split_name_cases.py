"""Per-rank body of the engine-in-the-name test (module level: spawned processes import it)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage


class Mixer(nn.Module):
    """``x + tanh(x @ w) * sigmoid(gate(x))``: most weight elements in a plain matrix parameter
    (256 against the gate Linear's 17), so ``split="auto"`` picks the graph engine."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.gate = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.w) * torch.sigmoid(self.gate(x))


def built_by_name(rank: int, world: int, names: list[str], m: int = 4) -> list[Any]:
    """For each name: the class torch's ``get_schedule_class`` returns once zbpipe registered,
    built as torchtitan builds it, one step on one rank holding a V of two Mixer stages. Returns,
    per name, the class name, the engine the schedule runs (``sched.split``) and the largest
    difference of the step's gradients from an unpipelined reference (losses summed, as
    ``scale_grads=False``)."""
    from torch.distributed.pipelining import schedules

    from zbpipe.integrations.names import register, unregister

    register()
    try:
        out = []
        for name in names:
            cls = schedules.get_schedule_class(name)
            torch.manual_seed(0)
            mods = [nn.Sequential(Mixer(), Mixer()) for _ in range(2)]
            ref = copy.deepcopy(nn.Sequential(*mods))
            x, tgt = torch.randn(4 * m, 16), torch.randn(4 * m, 16)
            losses = [F.mse_loss(ref(a), b) for a, b in zip(x.chunk(m), tgt.chunk(m))]
            torch.stack(losses).sum().backward()
            stages = [PipelineStage(mods[s], s, 2, torch.device("cpu")) for s in range(2)]
            sched = cls(
                stages,
                n_microbatches=m,
                loss_fn=F.mse_loss,
                scale_grads=False,
                backward_requires_autograd=True,
            )
            sched.step(x, target=tgt)
            worst = max(
                (p.grad - q.grad).abs().max().item()
                for s in range(2)
                for p, q in zip(mods[s].parameters(), ref[s].parameters(), strict=True)
            )
            out.append((type(sched).__name__, sched.split, worst))
        return out
    finally:
        unregister()
