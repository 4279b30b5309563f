"""Per-rank bodies of the costs="profile" tests.

Module level so spawned processes can import them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

import zbpipe
from tests.schedules._dist_cases import reference_grads
from zbpipe.observe.agree import config_fingerprint
from zbpipe.observe.profile import ProfileConfig
from zbpipe.planning import Costs, plan
from zbpipe.schedules.replan import agree_on_plan
from zbpipe.testing.models import Block, TinyGPTConfig, build_stages, lm_loss, synthetic_batch

# Wide enough that a block's compute, not the runtime's per-action overhead, dominates F.
CFG = TinyGPTConfig(hidden=64, seq=16, tricky=True)


def build_model(num_stages: int, extra_last_blocks: int, seed: int) -> list[nn.Module]:
    """``build_stages`` plus ``extra_last_blocks`` more blocks on the last stage.

    They go before its head.
    """
    mods = build_stages(CFG, num_stages, seed=seed)
    torch.manual_seed(seed + 1)  # same extra weights on every rank
    extra = [Block(CFG) for _ in range(extra_last_blocks)]
    *body, head = list(mods[-1])
    mods[-1] = nn.Sequential(*body, *extra, head)
    return mods


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class FixedClock:
    """The clock of the tracer and of the comm measurement in a rank (``perf_counter``): it
    stands still, except at the end of a traced span, which moves it on by that span's fixed
    cost, ``costs[kind][stage]`` milliseconds (BW: B + W). Measured costs are then known
    exactly (comm: 0, its round trips take no time), whatever the machine's load."""

    def __init__(self, costs: dict[str, list[float]]) -> None:
        self.costs, self.now = costs, 1000.0

    def perf_counter(self) -> float:
        return self.now

    def cost(self, kind: str, stage: int) -> float:
        if kind == "BW":
            return self.cost("B", stage) + self.cost("W", stage)
        return self.costs[kind][stage] * 1e-3

    @contextlib.contextmanager
    def installed(self, tracer: Any) -> Iterator[None]:
        """The clock in place of the host clock of zbpipe.observe.trace and .profile, and
        ``tracer``'s spans moving it on as they end."""
        from zbpipe.observe import profile, trace

        def span(kind: str, stage: int, microbatch: int) -> Any:
            return _Advancing(self, inner(kind, stage, microbatch), self.cost(kind, stage))

        inner = tracer.span
        with mock.patch.object(trace, "time", self), mock.patch.object(profile, "time", self):
            tracer.span = span
            try:
                yield
            finally:
                del tracer.span


class _Advancing:
    """A traced span whose end is ``seconds`` after its start on a :class:`FixedClock`."""

    def __init__(self, clock: FixedClock, inner: Any, seconds: float) -> None:
        self.clock, self.inner, self.seconds = clock, inner, seconds

    def __enter__(self) -> None:
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.clock.now += self.seconds
        self.inner.__exit__(*exc)


def profiled_training(
    rank, world, schedule, m, steps, extra_last_blocks=0, options=None, seed=5, fixed=None
):
    """Run ``steps`` steps with costs="profile"; after every step compare grads with the reference.

    ``fixed``: the passes' costs in ms (``{"F": per stage, "B": ..., "W": ...}``), taken by a
    :class:`FixedClock` in place of the host clock; None: the host clock.
    Returns what the test checks across ranks: fingerprint of the final plan, measured costs,
    whether the plan changed from the equal-cost one, the info log lines and the worst grad diff.
    """
    cls = getattr(zbpipe, schedule)
    options = options or {}
    num_stages = world * cls.stages_per_rank
    mods = build_model(num_stages, extra_last_blocks, seed)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    log = logging.getLogger("zbpipe.schedules.replan")
    handler = _Collect()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    cfg = ProfileConfig(warmup_steps=1, profile_steps=2)
    sched = cls(stages, m, loss_fn=lm_loss, costs="profile", profile=cfg, **options)
    equal_cost_plan = sched.equal_bytes_plan  # the first steps run first_step_plan (loop)
    plans_per_step: list = []
    clock = contextlib.nullcontext() if fixed is None else FixedClock(fixed).installed(sched.tracer)
    with clock:
        worst = _steps(sched, cls, schedule, mods, mine, m, steps, plans_per_step)
    log.removeHandler(handler)
    return {
        "fingerprint": config_fingerprint(cls, m, num_stages, sched.plan),
        "plans_per_step": plans_per_step,
        "measured": sched.measured_costs,
        "changed": sched.plan.order != equal_cost_plan.order,
        "equal_cost_order": dict(equal_cost_plan.order),
        "order": dict(sched.plan.order),
        "log": handler.messages,
        "worst": worst,
    }


def _steps(sched, cls, schedule, mods, mine, m, steps, plans_per_step) -> float:
    """``steps`` steps, each checked against the reference; returns the worst difference."""
    num_stages = len(mods)
    worst = 0.0
    for step in range(steps):
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        ids, tgt = synthetic_batch(CFG, batch=2 * m, step=step)
        ref, ref_losses = reference_grads(mods, ids, tgt, m)
        losses: list = []
        sched.step(
            *((ids,) if 0 in mine else ()),
            target=tgt if num_stages - 1 in mine else None,
            losses=losses,
        )
        for s in mine:
            for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
                # fp32, same ops; only the order of summation over microbatches differs.
                torch.testing.assert_close(
                    p.grad,
                    q.grad,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda e, step=step, s=s, name=name: (
                        f"{schedule} step {step} stage {s} {name}: {e}"
                    ),
                )
                worst = max(worst, (p.grad - q.grad).abs().max().item())
        if num_stages - 1 in mine:
            torch.testing.assert_close(
                torch.stack(losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-6
            )
        plans_per_step.append(config_fingerprint(cls, m, num_stages, sched.plan))
    return worst


def disagreeing_plans(rank, world):
    """Rank 0 holds a different plan than the others: agree_on_plan raises on every rank."""
    stage = PipelineStage(
        build_stages(TinyGPTConfig(), world)[rank], rank, world, torch.device("cpu")
    )
    sched = zbpipe.ScheduleZBH1([stage], 4, loss_fn=lm_loss)
    other = plan("ZB2P", world, 4, costs=Costs(f=[1.0] * (world - 1) + [3.0]))
    try:
        agree_on_plan(sched, other if rank == 0 else sched.plan, None)
    except RuntimeError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: disagreeing plans were accepted")


#: the passes' costs (ms) the 2-rank cases' clock gives: the last stage 7 times as heavy (as if
#: it ran 7 blocks against 1), a backward half B and half W
FIXED = {
    "auto": {"F": [1.0, 7.0], "B": [2.0, 14.0], "W": [2.0, 14.0]},
    "zbv": {"F": [1.0, 1.0, 1.0, 7.0], "B": [2.0, 2.0, 2.0, 14.0], "W": [2.0, 2.0, 2.0, 14.0]},
}


def two_rank_cases(rank, world):
    """All 2-rank cases in one process group (starting processes is the slow part)."""
    return {
        "auto": profiled_training(rank, world, "ScheduleZBAuto", 4, 5, fixed=FIXED["auto"]),
        "zbv": profiled_training(rank, world, "ScheduleZBV", 4, 5, fixed=FIXED["zbv"]),
        # memory_limit=2 units: enough for equal stages, not for the measured heavy last chunk
        "zbv_limit": profiled_training(
            rank, world, "ScheduleZBV", 4, 4, extra_last_blocks=6, options={"memory_limit": 2.0}
        ),
        "disagree": disagreeing_plans(rank, world),
    }
