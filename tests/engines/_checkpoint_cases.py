"""Per-rank bodies of the activation-checkpointing tests (module level: spawned ranks import them).

The blocks are residual, ``x + f(x)``, with ``f`` checkpointed (non-reentrant, the kind torchtitan
and torch's ``checkpoint_wrapper`` use). What matters to the split is the op ``f`` ends in: the
first node of the region a backward call runs is the one whose unpack recomputes it.

* ``"linear"``: ``tanh(x) -> Linear``: the Linear's node (a boundary, kept for W) goes first;
* ``"tanh"``: ``Linear -> tanh``: a weight-free node goes first (issue 39's reproduction);
* ``"combine"``: ``Linear(x) * softmax(x)``: a weight-free product of two branches, as an MoE
  combines its experts' outputs with the router's scores.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import zbpipe

ENDINGS = ("linear", "tanh", "combine")


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective-checkpointing policy in torchtitan's manner: keep the matmuls' outputs,
    recompute everything else."""
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    return create_selective_checkpoint_contexts(save_matmuls)


class Inner(nn.Module):
    """The checkpointed part of a block, ending in the op ``ending`` names."""

    def __init__(self, ending: str, dim: int = 8) -> None:
        super().__init__()
        self.ending = ending
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ending == "linear":
            return self.lin(torch.tanh(x))
        if self.ending == "tanh":
            return torch.tanh(self.lin(x))
        return self.lin(x) * F.softmax(x, dim=-1)


class Block(nn.Module):
    """``x + inner(x)``, ``inner`` checkpointed as ``ac`` says: "none", "full" or "selective"."""

    def __init__(self, ending: str, ac: str) -> None:
        super().__init__()
        self.inner, self.ac = Inner(ending), ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ac == "none":
            return x + self.inner(x)
        context = selective_context if self.ac == "selective" else None
        kwargs = {"context_fn": context} if context is not None else {}
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False, **kwargs)
        return x + out


def wrapped_block(ending: str) -> nn.Module:
    """A block whose inner part torch's ``checkpoint_wrapper`` wraps for selective
    checkpointing, as torchtitan's ``SelectiveAC`` wraps each transformer block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    block = Block(ending, "none")
    block.inner = checkpoint_wrapper(block.inner, context_fn=selective_context)  # type: ignore[assignment]
    return block


def stages_and_reference(
    ending: str, ac: str, m: int, wrapper: bool = False
) -> tuple[list[nn.Sequential], torch.Tensor, torch.Tensor, nn.Sequential]:
    """Two stage modules of two blocks each, a batch and its targets (4 rows per microbatch),
    and an unpipelined, uncheckpointed copy after the step's backward (microbatch losses
    averaged, as ``scale_grads=True``)."""
    torch.manual_seed(0)
    make = functools.partial(wrapped_block, ending) if wrapper else lambda: Block(ending, ac)
    mods = [nn.Sequential(make(), make()) for _ in range(2)]
    reference = nn.Sequential(*(nn.Sequential(*(_plain(b) for b in mod)) for mod in mods))
    x, tgt = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    losses = [F.mse_loss(reference(a), b) for a, b in zip(x.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    return mods, x, tgt, reference


def _plain(block: nn.Module) -> Block:
    """An uncheckpointed copy of ``block`` (same weights)."""
    inner = block.inner
    inner = getattr(inner, "_checkpoint_wrapped_module", inner)
    plain = Block(inner.ending, "none")
    plain.inner = copy.deepcopy(inner)
    return plain


def v_step_grads(
    rank: int, world: int, ending: str, ac: str, split: str, wrapper: bool = False, m: int = 4
) -> dict[str, Any]:
    """One rank holding a 2-stage V pipeline (``ScheduleZBV``, B and W apart: the plan for equal
    costs) of checkpointed blocks: two steps, the engine ``split`` chose, and the largest
    gradient difference of the last from the unpipelined reference."""
    mods, x, tgt, ref = stages_and_reference(ending, ac, m, wrapper)
    stages = [PipelineStage(mods[s], s, 2, torch.device("cpu")) for s in range(2)]
    sched = zbpipe.ScheduleZBV(stages, m, loss_fn=F.mse_loss, split=split, measure_memory=False)
    for _ in range(2):
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        sched.step(x, target=tgt)
    worst = max(
        (p.grad - q.grad).abs().max().item()
        for s in range(2)
        for p, q in zip(mods[s].parameters(), ref[s].parameters(), strict=True)
    )
    return {"split": sched.split, "worst": worst}


def several(rank: int, world: int, todo: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """:func:`v_step_grads` for each argument tuple of ``todo``, in one process (starting a
    rank costs more than a case)."""
    return [v_step_grads(rank, world, *args) for args in todo]
