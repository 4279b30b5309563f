"""Per-rank bodies of the overlapped-pair tests (module level: spawned ranks import them).

The model is :mod:`zbpipe.testing.moe`: a real expert all-to-all over an expert-parallel group.
Ranks form a ``pp x ep`` grid, rank ``r = pp_rank * ep + ep_rank``: a pipeline runs down each
column (one ``ep_rank``), the all-to-all along each row (one ``pp_rank``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from zbpipe import CommPoint, ScheduleDualPipeV
from zbpipe.testing.models import lm_loss, synthetic_batch
from zbpipe.testing.moe import MoEBlock, TinyMoEConfig, build_moe_stages, moe_layers

CFG = TinyMoEConfig()


def groups(rank: int, pp: int, ep: int):
    """(pipeline group, expert-parallel group, pp_rank, ep_rank) of ``rank``; every rank makes
    every group (torch's rule for new_group)."""
    pp_groups = [dist.new_group([p * ep + e for p in range(pp)]) for e in range(ep)]
    ep_groups = [dist.new_group([p * ep + e for e in range(ep)]) for p in range(pp)]
    pp_rank, ep_rank = divmod(rank, ep)
    return pp_groups[ep_rank], ep_groups[pp_rank], pp_rank, ep_rank


def points(mods):
    """Every MoE layer's ``exchange`` as a communication point: its collective is its argument."""
    return [
        CommPoint(owner=layer, method="exchange", collective=lambda x, a2a: (x, a2a))
        for mod in mods
        for layer in moe_layers(mod)
    ]


class Checkpointed(nn.Module):
    """A block under non-reentrant ``torch.utils.checkpoint``: full, or selective (saving the
    matrix products' outputs, recomputing the rest)."""

    def __init__(self, block: nn.Module, selective: bool) -> None:
        super().__init__()
        self.block, self.selective = block, selective

    def forward(self, x):
        if not self.selective:
            return checkpoint(self.block, x, use_reentrant=False)
        ctx = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=ctx)


def _save_matmuls(ctx, op, *args, **kwargs):
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(mods, how):
    if how in ("full", "selective"):
        for mod in mods:
            for i, layer in enumerate(mod):
                if isinstance(layer, MoEBlock):
                    mod[i] = Checkpointed(layer, selective=how == "selective")
    elif how == "compiled":  # compiled blocks between the points: attention, the experts
        for mod in mods:
            for layer in mod.modules():
                if isinstance(layer, MoEBlock):
                    layer.attn.compile()
                    layer.moe.experts.compile()


def grads_match(rank, world, pp, ep, m, how=None, options=None, seed=3):
    """One step of ScheduleDualPipeV on the ``pp x ep`` grid against an unpipelined reference
    (the whole model on each rank, the same expert-parallel row, the same batch); returns the
    largest gradient difference. ``how``: None, "full" / "selective" checkpointing, "compiled"."""
    pp_group, ep_group, pp_rank, ep_rank = groups(rank, pp, ep)
    num_stages = 2 * pp
    mods = build_moe_stages(CFG, num_stages, ep_group, ep_rank, seed=seed)
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=seed + ep_rank)  # each column its data
    ref = copy.deepcopy(nn.Sequential(*mods))
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    _wrap(mods, how)
    mine = sorted(s for s, r in ScheduleDualPipeV.stage_index_to_rank(pp).items() if r == pp_rank)
    stages = [
        PipelineStage(mods[s], s, num_stages, torch.device("cpu"), group=pp_group) for s in mine
    ]
    sched = ScheduleDualPipeV(
        stages, m, loss_fn=lm_loss, comm_points=points(mods[s] for s in mine), **(options or {})
    )
    got: list = []
    first = (ids,) if 0 in mine else ()
    sched.step(*first, target=tgt if num_stages - 1 in mine else None, losses=got)
    worst = 0.0
    for s in mine:
        ref_params = dict(ref[s].named_parameters())
        for name, p in mods[s].named_parameters():
            q = ref_params[name.replace("block.", "")]
            where = f"stage {s} {name} ({how})"
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda e, where=where: f"{where}: {e}"
            )
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    if num_stages - 1 in mine:
        torch.testing.assert_close(
            torch.stack(got), torch.stack([loss.detach() for loss in losses])
        )
    return worst, sched.overlaps, len(sched.plan.pairs)


def grads_cases(rank, world, pp, ep, cases):
    return [grads_match(rank, world, pp, ep, m, how, opts) for m, how, opts in cases]


def overlap_log(rank, world, m, overlap):
    """One step with the model logging its collectives and its experts' compute; the log."""
    pp_group, ep_group, pp_rank, ep_rank = groups(rank, world, 1)
    log: list = []
    mods = build_moe_stages(CFG, 2 * world, ep_group, ep_rank, log=log, seed=5)
    mine = sorted(s for s, r in ScheduleDualPipeV.stage_index_to_rank(world).items() if r == rank)
    stages = [
        PipelineStage(mods[s], s, 2 * world, torch.device("cpu"), group=pp_group) for s in mine
    ]
    sched = ScheduleDualPipeV(
        stages, m, loss_fn=lm_loss, comm_points=points(mods[s] for s in mine), overlap=overlap
    )
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=0)
    sched.step(*((ids,) if 0 in mine else ()), target=tgt if 2 * world - 1 in mine else None)
    return log


def pair_trace(rank, world, m, overlap):
    """One step of the overlap test's model (no log) traced on a counter clock (every clock
    read the next integer: a span or piece's ends are the order the tracer read them in, not
    measured times); the rank's traced events and pieces, the plan's pairs of this rank as
    (F's stage, mb, B's kind, stage, mb), and the Chrome JSON."""
    from zbpipe.observe import trace as tracing

    ticks = itertools.count()
    tracing.time = SimpleNamespace(perf_counter=lambda: float(next(ticks)))  # type: ignore[attr-defined]
    try:
        return _pair_trace(rank, world, m, overlap)
    finally:
        tracing.time = time  # type: ignore[attr-defined]


def _pair_trace(rank, world, m, overlap):
    pp_group, ep_group, pp_rank, ep_rank = groups(rank, world, 1)
    mods = build_moe_stages(CFG, 2 * world, ep_group, ep_rank, seed=5)
    mine = sorted(s for s, r in ScheduleDualPipeV.stage_index_to_rank(world).items() if r == rank)
    stages = [
        PipelineStage(mods[s], s, 2 * world, torch.device("cpu"), group=pp_group) for s in mine
    ]
    sched = ScheduleDualPipeV(
        stages,
        m,
        loss_fn=lm_loss,
        comm_points=points(mods[s] for s in mine),
        overlap=overlap,
        measure_memory=False,  # the plan that ran is the plan read after the step
    )
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=0)
    sched.step(*((ids,) if 0 in mine else ()), target=tgt if 2 * world - 1 in mine else None)
    pairs = [
        (f.stage, f.microbatch, b.kind, b.stage, b.microbatch)
        for f, b in sched.plan.pairs
        if f.stage in mine
    ]
    trace = sched.tracer.gather()
    return list(sched.tracer.events), list(sched.tracer.pieces), pairs, trace.to_chrome()


def pair_order(rank, world, m):
    """Both settings of ``overlap``, in one process group: the model's log of a step
    (:func:`overlap_log`) and the traced pair pieces of another (:func:`pair_trace`)."""
    return {
        overlap: (overlap_log(rank, world, m, overlap), pair_trace(rank, world, m, overlap))
        for overlap in (True, False)
    }


def saved_peak(rank, world, m, modes):
    """Per memory mode: this rank's peak bytes held for backward in the third step (the plan
    re-made for the bytes the first step measured) and how many pairs that plan has; and each
    chunk's bytes after F, counted on a standalone forward (tests/schedules/_dist_cases.py's
    model and count)."""
    from tests.schedules._dist_cases import _deep_v_chunk, _mean_loss
    from zbpipe.memory import SavedActivationMeter
    from zbpipe.memory.saved import SavedTensors, param_storages

    rows, n_stages = 8, 2 * world
    mine = (rank, n_stages - 1 - rank)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, 64, generator=g) for _ in range(m)]
    probe, unit = _deep_v_chunk(0), SavedActivationMeter()
    with SavedTensors(observer=unit, skip=param_storages(probe.parameters())).hooks():
        y = probe(torch.randn(rows, 64, requires_grad=True))
    chunk_bytes = [unit.peak_bytes + (y.nbytes if s < n_stages - 1 else 0) for s in range(n_stages)]
    out = {}
    for mode in modes:
        stages = [PipelineStage(_deep_v_chunk(s), s, n_stages, torch.device("cpu")) for s in mine]
        sched = ScheduleDualPipeV(stages, m, loss_fn=_mean_loss, memory=mode, trace=False)
        meter = SavedActivationMeter()
        sched.attach_meter(meter)
        for _ in range(3):
            meter.begin_step()
            sched.step(
                arg_mbs=[(x,) for x in xs] if rank == 0 else None,
                target_mbs=xs if rank == 0 else None,
            )
        out[mode] = (meter.end_step().peak_bytes, len(sched.plan.pairs))
    return out, chunk_bytes
