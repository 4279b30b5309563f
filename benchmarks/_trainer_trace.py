"""Where a Trainer step's time goes, per rank (benchmarks/trainer.py ``--trace``): the run
server's hooks module (:mod:`zbpipe.testing.torchtitan_runs`, ``"hooks": "_trainer_trace"``).

Installed in each rank before torchtitan's entry runs, it times, with the wall clock and with
the thread's CPU clock (``time.thread_time``: what the rank computed, whatever else the machine
ran meanwhile, so it still says something on a loaded machine):

* every ``schedule.step()`` call (torch's ``PipelineScheduleSingle`` / ``PipelineScheduleMulti``
  and everything built on them, zbpipe's included): the pipeline's part of a training step;
* every compute call of a torch ``PipelineStage`` (``forward_one_chunk`` F,
  ``backward_one_chunk`` BW or B, ``backward_weight_one_chunk`` W): what torch's schedules run;
* every action a zbpipe schedule times itself (its tracer's spans, :mod:`zbpipe.observe.trace`:
  F, B, W, BW, after their receives), which also cover the deferred engine's W.

After the run each rank writes ``$TRAINER_TRACE_OUT/rank{RANK}.json``: per step its
``step()`` span and its compute spans ``(kind, stage, microbatch, wall start, wall end, CPU
seconds)``. benchmarks/trainer.py turns them into busy and idle time per rank. The timing adds
four clock reads per action, the same for every schedule.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any


def install() -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

    steps: list[dict[str, Any]] = []
    spans: list[tuple[str, int, int, float, float, float]] = []
    zb_spans: list[tuple[str, int, int, float, float, float]] = []
    depth = [0]
    clock, cpu = time.perf_counter, time.thread_time

    def timed_stage(name: str, kind: Callable[[dict[str, Any]], str]) -> None:
        original = getattr(PipelineStage, name)

        @functools.wraps(original)
        def wrapper(self: Any, mb: int, *args: Any, **kwargs: Any) -> Any:
            t0, c0 = clock(), cpu()
            try:
                return original(self, mb, *args, **kwargs)
            finally:
                spans.append((kind(kwargs), self.stage_index, mb, t0, clock(), cpu() - c0))

        setattr(PipelineStage, name, wrapper)

    timed_stage("forward_one_chunk", lambda kw: "F")
    timed_stage("backward_one_chunk", lambda kw: "BW" if kw.get("full_backward", True) else "B")
    timed_stage("backward_weight_one_chunk", lambda kw: "W")

    def timed_step(cls: type) -> None:
        original = cls.step

        @functools.wraps(original)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            t0, c0 = clock(), cpu()
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    steps.append(
                        {
                            "step": [t0, clock(), cpu() - c0],
                            "stage_spans": [s for s in spans if s[3] >= t0],
                            "zbpipe_events": [s for s in zb_spans if s[3] >= t0],
                        }
                    )
                    spans.clear()
                    zb_spans.clear()

        cls.step = step

    timed_step(PipelineScheduleSingle)
    timed_step(PipelineScheduleMulti)

    def after() -> None:
        out = os.environ.get("TRAINER_TRACE_OUT")
        if out:
            path = os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json")
            with open(path, "w") as f:
                json.dump(steps, f)

    try:  # zbpipe's runtime overrides step(); its tracer times each action
        from zbpipe.observe.trace import Tracer
        from zbpipe.schedules.runtime import PlannedSchedule
    except ImportError:
        return after
    timed_step(PlannedSchedule)
    original_span = Tracer.span

    class _Timed:
        def __init__(self, inner: Any, kind: str, stage: int, mb: int) -> None:
            self.inner, self.key = inner, (kind, stage, mb)

        def __enter__(self) -> None:
            self.inner.__enter__()
            self.t0, self.c0 = clock(), cpu()

        def __exit__(self, *exc: Any) -> Any:
            zb_spans.append((*self.key, self.t0, clock(), cpu() - self.c0))
            return self.inner.__exit__(*exc)

    def span(self: Any, kind: str, stage: int, microbatch: int) -> Any:
        return _Timed(original_span(self, kind, stage, microbatch), kind, stage, microbatch)

    Tracer.span = span

    return after
