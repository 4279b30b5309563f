"""Per-rank bodies of the DualPipeV re-plan tests (module level: spawned ranks import them).

The model is zbpipe.testing.moe with unequal stages: stage 0 runs its block plainly, stages 1
to 3 under full activation checkpointing, so after F a microbatch of stage 0 holds about nine
times what the others hold (and their B holds several times their F). Measured in the first
step, those bytes do not let the DualPipeV order keep all its pairs within ``memory="zb"``'s
budget.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from tests.schedules._dualpipev_cases import CFG, Checkpointed, groups, points
from zbpipe import ScheduleDualPipeV
from zbpipe.testing.models import lm_loss, synthetic_batch
from zbpipe.testing.moe import MoEBlock, build_moe_stages


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def _unequal_stages(ep_group, seed):
    mods = build_moe_stages(CFG, 4, ep_group, 0, seed=seed)
    ref = copy.deepcopy(nn.Sequential(*mods))
    for mod in mods[1:]:
        for i, layer in enumerate(mod):
            if isinstance(layer, MoEBlock):
                mod[i] = Checkpointed(layer, selective=False)
    return mods, ref


def default_arguments(rank, world, m, memory_limit=None, seed=7):
    """Two steps of ScheduleDualPipeV with default arguments (and the model's points declared;
    ``memory_limit`` if given) on the unequal stages: the pairs before and after the re-plan
    for the measured bytes, whether they overlap, the largest gradient difference of the second
    step from an unpipelined reference, and rank 0's log lines."""
    pp_group, ep_group, _, _ = groups(rank, world, 1)
    mods, ref = _unequal_stages(ep_group, seed)
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=seed)
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    mine = (rank, 3 - rank)
    stages = [PipelineStage(mods[s], s, 4, torch.device("cpu"), group=pp_group) for s in mine]
    lines = _Lines()
    log = logging.getLogger("zbpipe")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    options = {} if memory_limit is None else {"memory_limit": memory_limit}
    sched = ScheduleDualPipeV(
        stages, m, loss_fn=lm_loss, comm_points=points(mods[s] for s in mine), **options
    )
    pairs = []
    for _ in range(2):
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        pairs.append(len(sched.plan.pairs))
        sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == 0 else None)
    log.removeHandler(lines)
    pairs.append(len(sched.plan.pairs))
    worst = 0.0
    for s in mine:
        ref_params = dict(ref[s].named_parameters())
        for name, p in mods[s].named_parameters():
            q = ref_params[name.replace("block.", "")]
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return {
        "pairs": pairs,
        "whole": sched.plan.meta["skeleton_pairs"],
        "overlaps": sched.overlaps,
        "worst": worst,
        "lines": lines.lines,
    }


def profiled(rank, world, m, latency, seed=11):
    """costs="profile" on the MoE model whose every all-to-all waits ``latency`` seconds: four
    steps (the profile re-plans after the third); the measured costs, the pairs' halves of the
    profiled steps, the plan's pairs and mode, and the largest gradient difference of the
    fourth step (run by the re-made plan) from an unpipelined reference."""
    pp_group, ep_group, _, _ = groups(rank, world, 1)
    mods = build_moe_stages(CFG, 4, ep_group, 0, latency=latency, seed=seed)
    ref = copy.deepcopy(nn.Sequential(*mods))
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=seed)
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    mine = (rank, 3 - rank)
    stages = [PipelineStage(mods[s], s, 4, torch.device("cpu"), group=pp_group) for s in mine]
    sched = ScheduleDualPipeV(
        stages, m, loss_fn=lm_loss, comm_points=points(mods[s] for s in mine), costs="profile"
    )
    for _ in range(4):
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == 0 else None)
    worst = 0.0
    for s in mine:
        ref_params = dict(ref[s].named_parameters())
        for name, p in mods[s].named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6)
            worst = max(worst, (p.grad - ref_params[name].grad).abs().max().item())
    halves = [
        (e.kind, e.stage, e.end - e.start - e.waited, overlapped)
        for e, overlapped in sched._profiler.halves
    ]
    return {
        "costs": sched.measured_costs,
        "plan": sched.plan,
        "halves": halves,
        "worst": worst,
        "overlaps": sched.overlaps,
    }
