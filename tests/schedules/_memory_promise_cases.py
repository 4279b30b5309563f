"""Per-rank bodies of the memory-promise tests (module level: spawned processes import them).

Every peak here is measured by :class:`tests.memory._independent_meter.LiveStorageMeter`, which
shares nothing with zbpipe's probe, meter or plans.
"""

from __future__ import annotations

import copy
import gc
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import zbpipe
from tests.memory._independent_meter import (
    SEAM_ACTIONS,
    TORCH_ACTIONS,
    LiveStorageMeter,
    mark_after,
)
from zbpipe.planning import loop_placement, simulate, v_placement
from zbpipe.testing.models import Block, Embed, Head, TinyGPTConfig, lm_loss, synthetic_batch

#: a shape no other test uses: a head of 512 tokens over hidden 24 weighs a few blocks
SHAPE = dict(vocab=512, hidden=24, seq=12, heads=2)
ROWS = 3


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: keep the matmuls' outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Experts(nn.Module):
    """A mixture of experts with its experts as one 3-D weight (``bmm``), every token weighted
    by its router's softmax over all experts (dense dispatch: deterministic, no capacity)."""

    def __init__(self, h: int, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(h, n)
        self.w1 = nn.Parameter(torch.randn(n, h, 2 * h) * h**-0.5)
        self.w2 = nn.Parameter(torch.randn(n, 2 * h, h) * (2 * h) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        xs = x.reshape(-1, h)
        gate = self.router(xs).softmax(-1)
        y = torch.bmm(xs.unsqueeze(0).expand(self.w1.shape[0], -1, -1), self.w1)
        y = torch.bmm(F.gelu(y), self.w2)
        return x + (y * gate.t().unsqueeze(-1)).sum(0).view(b, t, h)


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, mode: str) -> None:
        super().__init__()
        self.inner, self.mode = inner, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "full":
            return checkpoint(self.inner, x, use_reentrant=False)
        ctx = partial(create_selective_checkpoint_contexts, _policy)
        return checkpoint(self.inner, x, use_reentrant=False, context_fn=ctx)


def build(n_stages: int, world: int, ac: str = "", moe: bool = False, vocab: int = 0) -> list:
    """The model (2 x world blocks) in ``n_stages`` stages; ``ac`` "full" or "selective"
    checkpoints every block; ``moe`` gives every block an expert layer."""
    cfg = TinyGPTConfig(**{**SHAPE, **({"vocab": vocab} if vocab else {})})
    torch.manual_seed(11)
    per = 2 * world // n_stages
    out = []
    for s in range(n_stages):
        layers: list[nn.Module] = [Embed(cfg)] if s == 0 else []
        for _ in range(per):
            inner: nn.Module = nn.Sequential(Block(cfg), Experts(cfg.hidden)) if moe else Block(cfg)
            layers.append(Checkpointed(inner, ac) if ac else inner)
        if s == n_stages - 1:
            layers.append(Head(cfg))
        out.append(nn.Sequential(*layers))
    return out


def _steps(
    sched: Any, stages: list, mine: list, m: int, steps: int, box: list, vocab: int, last_only: bool
) -> list:
    """The held peak of each step (``last_only``: of the last; the others run unmetered)."""
    cfg = TinyGPTConfig(**{**SHAPE, "vocab": vocab})
    last = max(st.stage_index for st in stages) == _num_stages(stages) - 1
    peaks = []
    for step in range(steps):
        ids, tgt = synthetic_batch(cfg, m * ROWS, step)
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        if last_only and step < steps - 1:
            sched.step(*((ids,) if 0 in mine else ()), target=tgt if last else None)
            continue
        gc.collect()
        box[0] = meter = LiveStorageMeter()
        with meter:
            sched.step(*((ids,) if 0 in mine else ()), target=tgt if last else None)
        box[0] = None
        gc.collect()
        peaks.append(meter.step_peaks()[0])
    return peaks


def run(
    rank: int,
    world: int,
    name: str,
    m: int,
    steps: int,
    build_kw: dict,
    last_only: bool = False,
    grads: bool = False,
    **options: Any,
):
    """This rank's held peak per step (``last_only``: of the last step only), the schedule,
    for its predictions, and (``grads``) the largest difference of the last step's gradients
    from the unpipelined model's on the same batch (else None)."""
    v = name != "torch" and zbpipe.get_schedule_class(name).layout == "v"
    n = 2 * world if v else world
    mods = build(n, world, **build_kw)
    ref = copy.deepcopy(nn.Sequential(*mods)) if grads else None
    placement = v_placement(world) if v else loop_placement(world, n)
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    box: list = [None]
    if name == "torch":
        sched: Any = Schedule1F1B(stages[0], m, loss_fn=lm_loss)
        mark_after(stages[0], TORCH_ACTIONS, box)
    else:
        sched = zbpipe.get_schedule_class(name)(stages, m, loss_fn=lm_loss, trace=False, **options)
        mark_after(sched.seam, SEAM_ACTIONS, box)
    vocab = build_kw.get("vocab") or SHAPE["vocab"]
    peaks = _steps(sched, stages, mine, m, steps, box, vocab, last_only)
    if ref is None:
        return peaks, sched, None
    ids, tgt = synthetic_batch(TinyGPTConfig(**{**SHAPE, "vocab": vocab}), m * ROWS, steps - 1)
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    diff = max(
        (p.grad - q.grad).abs().max().item()
        for s in mine
        for p, q in zip(mods[s].parameters(), ref[s].parameters(), strict=True)
    )
    return peaks, sched, diff


def _num_stages(stages: list) -> int:
    return int(stages[0].num_stages)


def promise_rows(rank: int, world: int, m: int, runs: list, build_kw: dict | None = None) -> dict:
    """torch 1F1B's held peak per step, then each ``(name, split, mode)`` of ``runs`` (and,
    under ``"grads"``, its last step's largest gradient difference from the reference).

    Two steps with defaults: the first runs the plan made before any byte is known (a V
    schedule's measured start), the second the plan re-made for the measured bytes. With
    ``costs="profile"`` three: a warm-up, one profiled step, then the plan re-made from the
    profile (a second profiled step would run the same plan as the first). ``build_kw``: the
    model's options (:func:`build`), torch 1F1B's included."""
    torch.set_num_threads(1)
    build_kw = build_kw or {}
    out: dict = {"torch": run(rank, world, "torch", m, 2, build_kw)[0], "grads": {}}
    for name, split, mode in runs:
        options: dict = {"split": split}
        steps = 2
        if mode == "profile":
            options.update(costs="profile", profile=zbpipe.ProfileConfig(comm=0.0, profile_steps=1))
            steps = 3
        peaks, _, diff = run(rank, world, name, m, steps, build_kw, grads=True, **options)
        out[(name, split, mode)], out["grads"][(name, split, mode)] = peaks, diff
    return out


def checkpointed_rows(
    rank: int, world: int, m: int, build_kw: dict, names: list, split: str = "deferred"
) -> dict:
    """Per schedule (engine ``split``, defaults): the held peak of the step after the re-plan,
    and the re-made plan's predicted peak in bytes (max over ranks, every rank alike)."""
    torch.set_num_threads(1)
    out: dict = {}
    for name in names:
        peaks, sched, _ = run(rank, world, name, m, 2, build_kw, last_only=True, split=split)
        r = simulate(sched.plan, sched.memory_costs)
        out[name] = {
            "measured": peaks[-1],
            "predicted": max(r.peak_memory.values()) * sched.memory_unit_bytes,
        }
    return out


def all_rows(rank: int, world: int, m: int, runs: list, checkpointed: dict, names: list) -> dict:
    """:func:`promise_rows` of ``runs``, then :func:`checkpointed_rows` of ``names`` for each
    ``{key: build_kw}`` of ``checkpointed``: every 4-rank run of the promise tests in one
    process group (starting 4 ranks is slow on 2 cores)."""
    out = {"promise": promise_rows(rank, world, m, runs)}
    for key, build_kw in checkpointed.items():
        out[key] = checkpointed_rows(rank, world, m, build_kw, names)
    return out
