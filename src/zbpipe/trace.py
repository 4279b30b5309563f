"""Measured execution timelines of real pipeline steps.

A :class:`Tracer` records the start and end of every compute action a rank runs (F, B, W, BW),
after any receive it waited on, so idle time is what the pipeline left idle. ``gather`` collects
all ranks' records into a :class:`Trace`, whose ``bubble_rate`` uses the simulator's formula
(:func:`zbpipe.plan.metrics.bubble_rate`) and which writes Chrome/Perfetto JSON.

zbpipe's schedules call the tracer themselves. For torch's built-in schedules,
:func:`attach_stage_tracer` wraps a stage's compute methods so the same numbers can be compared.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.distributed as dist

from .plan.metrics import bubble_rate as _bubble_rate
from .timeline import Event, to_chrome


@dataclass
class Tracer:
    """Collects :class:`Event` s of one rank. Cheap: two clock reads and one append per action."""

    rank: int = 0
    enabled: bool = True
    events: list[Event] = field(default_factory=list)

    @contextmanager
    def span(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append(Event(self.rank, kind, stage, microbatch, start, time.perf_counter()))

    def clear(self) -> None:
        self.events.clear()

    def gather(self, group: dist.ProcessGroup | None = None) -> "Trace":
        """Collect every rank's events (a collective: call it on all ranks of ``group``)."""
        if not dist.is_available() or not dist.is_initialized():
            return Trace({self.rank: list(self.events)})
        world = dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (self.rank, self.events), group=group)
        return Trace({rank: list(evs) for rank, evs in gathered})


@dataclass(frozen=True)
class Trace:
    """Events of all ranks for one or more steps."""

    events: dict[int, list[Event]]

    @property
    def bubble_rate(self) -> float:
        """Measured bubble rate (the paper's definition; see :func:`zbpipe.plan.metrics.bubble_rate`)."""
        return _bubble_rate({r: [(e.start, e.end) for e in evs] for r, evs in self.events.items()})

    @property
    def makespan(self) -> float:
        starts = [e.start for evs in self.events.values() for e in evs]
        ends = [e.end for evs in self.events.values() for e in evs]
        return (max(ends) - min(starts)) if starts else 0.0

    def busy(self, kind: str | None = None) -> dict[int, float]:
        """Busy seconds per rank (of one action kind, or all)."""
        return {
            r: sum(e.end - e.start for e in evs if kind is None or e.kind == kind)
            for r, evs in self.events.items()
        }

    def to_chrome(self) -> dict[str, Any]:
        """Chrome/Perfetto trace-event JSON: one complete event (``ph: X``) per compute action."""
        return to_chrome(self.events)

    def write_chrome(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)


def attach_stage_tracer(stage: Any, tracer: Tracer) -> None:
    """Time a torch ``PipelineStage``'s compute methods (for torch's built-in schedules).

    Wraps ``forward_one_chunk`` (F), ``backward_one_chunk`` (BW, or B when split) and
    ``backward_weight_one_chunk`` (W) on this stage object only. zbpipe's own schedules do not
    need this.
    """
    idx = stage.stage_index
    fwd, bwd, bww = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        with tracer.span("F", idx, mb):
            return fwd(mb, *args, **kwargs)

    def backward_one_chunk(mb: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
        with tracer.span("BW" if full_backward else "B", idx, mb):
            return bwd(mb, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        with tracer.span("W", idx, mb):
            return bww(mb, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
