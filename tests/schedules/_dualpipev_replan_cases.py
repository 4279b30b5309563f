"""Per-rank bodies of the DualPipeV re-plan tests (module level: spawned ranks import them).

The model is zbpipe.testing.moe with unequal stages: stage 0 runs its block plainly, stages 1
to 3 under full activation checkpointing, so after F a microbatch of stage 0 holds about nine
times what the others hold (and their B holds several times their F). Measured in the first
step, those bytes do not let the DualPipeV order keep all its pairs within ``memory="zb"``'s
budget.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from types import SimpleNamespace

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


class VirtualLatency:
    """A clock for the schedule's timings: the real ``perf_counter`` plus every ``sleep`` so
    far, where ``sleep`` sleeps nothing but moves the clock on. Installed in the model
    (:mod:`zbpipe.testing.moe`), the pair runner and the tracer, a collective's latency is then
    an exact injected amount of clock time, which lands in ``Costs.a2a`` and never in F or B
    if the waits are accounted right, whatever the machine's load."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def sleep(self, seconds: float) -> None:
        self.offset += max(seconds, 0.0)


def profiled(rank, world, m, latency, seed=11):
    """costs="profile" on the MoE model whose every all-to-all waits ``latency`` seconds of a
    :class:`VirtualLatency` clock: three steps (a warm-up, one profiled step that re-plans at
    its end, one of the re-made plan); the measured costs, the pairs' halves of the profiled
    step, the plan's pairs and mode, the plan the schedule makes for fixed times (collectives
    twice the compute), and the largest gradient difference of the third step
    from an unpipelined reference."""
    from zbpipe.observe import trace
    from zbpipe.observe.profile import ProfileConfig
    from zbpipe.schedules import pairs as pair_runner
    from zbpipe.testing import moe

    clock = VirtualLatency()
    fake = SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep)
    for module in (moe, trace, pair_runner):
        module.time = fake  # type: ignore[attr-defined]
    pp_group, ep_group, _, _ = groups(rank, world, 1)
    mods = build_moe_stages(CFG, 4, ep_group, 0, latency=latency, seed=seed)
    ref = copy.deepcopy(nn.Sequential(*mods))
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=seed)
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    mine = (rank, 3 - rank)
    stages = [PipelineStage(mods[s], s, 4, torch.device("cpu"), group=pp_group) for s in mine]
    sched = ScheduleDualPipeV(
        stages,
        m,
        loss_fn=lm_loss,
        comm_points=points(mods[s] for s in mine),
        costs="profile",
        profile=ProfileConfig(profile_steps=1),
    )
    ran = 0  # the pairs with a B (whose halves are measured) of the plan the profiled step runs
    try:
        for step in range(3):
            if step == 1:
                ran = sum(1 for f, b in sched.plan.pairs if f.stage in mine and b.kind == "B")
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == 0 else None)
    finally:
        for module in (moe, trace, pair_runner):
            module.time = time  # type: ignore[attr-defined]
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
    # the schedule's own re-plan (pairs="paying" once profiled) for the measured bytes with fixed
    # times: each chunk's collectives twice its compute
    fixed = dataclasses.replace(
        sched.measured_costs, f=(1.0,) * 4, b=(1.0,) * 4, w=(1.0,) * 4, a2a=(2.0,) * 4
    )
    return {
        "costs": sched.measured_costs,
        "plan": sched.plan,
        "fixed": (fixed, sched.build_plan(world, m, fixed)),
        "halves": halves,
        "profiled_pairs": ran,
        "worst": worst,
        "overlaps": sched.overlaps,
    }
