"""Per-rank body for tests/schedules/test_varlen_compiled.py: the varlen model's blocks each
compiled in place (torchtitan's way; backend aot_eager: inductor's C++ builds take minutes on
this machine) under ``variable_shapes=True``, a new set of lengths every step."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from tests.schedules._varlen_cases import Block, Embed, chunks, data, layers, reference, token_loss
from zbpipe import _compat as C
from zbpipe.schedules import classes


class MarkedEmbed(nn.Module):
    """The embedding (eager), its output's sequence dim marked dynamic for the compiled
    blocks after it on stage 0."""

    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.embed(ids)
        C.mark_dynamic(out, 1)
        return out


def compiled_steps(rank: int, world: int, draws: list[list[int]]) -> dict:
    """ZB-H1 (deferred engine), one step per draw; each step's gradients against the eager
    unpipelined model; dynamo's graph count after each step."""
    counters = C.dynamo_counters()
    mods = layers(seed=0)
    parts = chunks(mods, world)
    stage_mods = []
    for part in parts:
        seq = nn.Sequential(*(MarkedEmbed(mods[i]) if i == 0 else mods[i] for i in part))
        for block in seq:
            if isinstance(block, Block):
                block.compile(backend="aot_eager", fullgraph=True)
        stage_mods.append(seq)
    stage = PipelineStage(stage_mods[rank], rank, world, torch.device("cpu"))
    m = len(draws[0])
    sched = classes.ScheduleZBH1(
        [stage], m, loss_fn=token_loss, scale_grads=False, variable_shapes=True
    )
    eager = layers(seed=0)  # the same weights, nothing compiled (no step changes them)
    graphs, worst = [], 0.0
    for i, lengths in enumerate(draws):
        ids, targets = data(lengths, seed=i)
        expected = reference(eager, ids, targets, tokens=True)  # eager, same weights
        nn.Sequential(*mods).zero_grad(set_to_none=True)
        sched.step(
            arg_mbs=[(x,) for x in ids] if rank == 0 else None,
            target_mbs=targets if rank == world - 1 else None,
            loss_kwargs={"num_tokens": sum(t.numel() for t in targets)},
        )
        owned = {id(p) for j in parts[rank] for p in mods[j].parameters()}
        for p, e in zip(nn.Sequential(*mods).parameters(), expected, strict=True):
            if id(p) in owned:
                # fp32; compiled graphs and the split backward sum in other orders
                torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)
                worst = max(worst, (p.grad - e).abs().max().item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"graphs": graphs, "breaks": sum(counters["graph_break"].values()), "worst": worst}
