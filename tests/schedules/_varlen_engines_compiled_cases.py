"""Per-rank body for tests/schedules/test_varlen_engines_compiled.py: compiled code under
``variable_shapes=True`` with both split engines and a V schedule, a new set of lengths every
step, each step's gradients against the eager unpipelined model.

Two ways of compiling, one per engine:

* ``"blocks"``: each attention block compiled in place (torchtitan's way). The deferred engine
  splits them (their Linears' GEMMs wait for W); the graph engine refuses them (a compiled block
  is one opaque autograd node, tests/engines/test_compiled_every_schedule.py).
* ``"cores"``: each block eager, its weight-free core (attention and the MLP's activation)
  compiled as one function. The graph engine sees every weight's region and passes through the
  compiled node in B; this is what it can compile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from tests.schedules._varlen_cases import (
    HEADS,
    Block,
    chunks,
    data,
    layers,
    owned_grads_close,
    reference,
    token_loss,
)
from tests.schedules._varlen_compiled_cases import MarkedEmbed
from zbpipe import _compat as C
from zbpipe.schedules import classes


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, heads merged back: (b, h, n, d/h) x 3 -> (b, n, d)."""
    b, _, n, _ = q.shape
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, n, -1)


class CoreBlock(nn.Module):
    """:class:`Block`'s weights and maths, with its weight-free parts through compiled
    functions (``attend``, ``act``) whose length dim is marked dynamic at each call."""

    def __init__(self, block: Block, attend: Any, act: Any) -> None:
        super().__init__()
        self.block, self.attend, self.act = block, attend, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blk = self.block
        b, n, d = x.shape
        q, k, v = blk.qkv(blk.ln1(x)).view(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        for t in (q, k, v):
            C.mark_dynamic(t, 2)
        x = x + blk.proj(self.attend(q, k, v))
        h = blk.up(blk.ln2(x))
        C.mark_dynamic(h, 1)
        return x + blk.down(self.act(h))


def _stage_module(mods: list[nn.Module], part: list[int], how: str, backend: str) -> nn.Sequential:
    if how == "blocks":
        seq = nn.Sequential(*(MarkedEmbed(mods[i]) if i == 0 else mods[i] for i in part))
        for block in seq:
            if isinstance(block, Block):
                block.compile(backend=backend, fullgraph=True)
        return seq
    # one compiled function object per stage module: dynamo's cache is per code object anyway
    attend = torch.compile(_attend, backend=backend, fullgraph=True)
    act = torch.compile(F.gelu, backend=backend, fullgraph=True)
    return nn.Sequential(
        *(CoreBlock(mods[i], attend, act) if isinstance(mods[i], Block) else mods[i] for i in part)
    )


def compiled_case(
    rank: int, world: int, schedule: str, split: str, how: str, backend: str, draws: list
) -> dict[str, Any]:
    """``schedule`` under ``split`` over the varlen model compiled ``how``, one step per draw of
    lengths, from an empty compile cache: the largest gradient difference against the eager
    unpipelined model, dynamo's graph count after each step, its graph breaks, the engine."""
    torch.compiler.reset()
    counters = C.dynamo_counters()
    counters.clear()
    cls = getattr(classes, schedule)
    num_stages = world * cls.stages_per_rank
    mods = layers(seed=0)
    parts = chunks(mods, num_stages)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [
        PipelineStage(
            _stage_module(mods, parts[s], how, backend), s, num_stages, torch.device("cpu")
        )
        for s in mine
    ]
    sched = cls(
        stages,
        len(draws[0]),
        loss_fn=token_loss,
        scale_grads=False,
        split=split,
        variable_shapes=True,
    )
    eager = layers(seed=0)  # the same weights, nothing compiled (no step changes them)
    owned = {id(p) for s in mine for i in parts[s] for p in mods[i].parameters()}
    params = list(nn.Sequential(*mods).parameters())
    graphs, worst = [], 0.0
    # the graph engine's B walks the compiled cores with retain_graph=True (W comes later):
    # they are compiled without donated buffers (the error otherwise: the test file)
    with C.donated_buffers(how != "cores"):
        for i, lengths in enumerate(draws):
            ids, targets = data(lengths, seed=i)
            expected = reference(eager, ids, targets, tokens=True)
            nn.Sequential(*mods).zero_grad(set_to_none=True)
            sched.step(
                arg_mbs=[(x,) for x in ids] if 0 in mine else None,
                target_mbs=targets if num_stages - 1 in mine else None,
                loss_kwargs={"num_tokens": sum(t.numel() for t in targets)},
            )
            what = f"{schedule}/{split}/{how}/{backend}"
            worst = max(worst, owned_grads_close(params, expected, owned, what, lengths))
            graphs.append(counters["stats"]["unique_graphs"])
    return {
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "worst": worst,
        "engine": sched.split,
        # the compiled callables on this rank: the blocks, or each stage's two cores
        "compiled": sum(isinstance(mods[i], Block) for s in mine for i in parts[s])
        if how == "blocks"
        else 2 * len(mine),
    }


def compiled_cases(rank: int, world: int, todo: list[tuple], draws: list) -> list[dict[str, Any]]:
    """Every case in one process group (starting ranks and warming dynamo is the slow part)."""
    return [compiled_case(rank, world, *case, draws) for case in todo]
