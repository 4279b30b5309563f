"""Measured execution timelines of real pipeline steps.

A :class:`Tracer` records the start and end of every compute action a rank runs (F, B, W, BW),
after any receive it waited on, so idle time is what the pipeline left idle. ``gather`` collects
all ranks' records into a :class:`Trace`, whose ``bubble_rate`` uses the simulator's formula
(:func:`zbpipe.planning.metrics.bubble_rate`) and which writes Chrome/Perfetto JSON.

zbpipe's schedules call the tracer themselves. For torch's built-in schedules,
:func:`attach_stage_tracer` wraps a stage's compute methods so the same numbers can be compared.
"""

from __future__ import annotations

import functools
import json
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..patching import Patch, patch
from ..planning.metrics import bubble_rate as _bubble_rate
from .timeline import Event, to_chrome


class Tracer:
    """Collects :class:`Event` s of one rank. Cheap: two clock reads and one append of a plain
    tuple per action; the :class:`Event` s are built when :attr:`events` is read.

    On a CUDA device the host clock would time kernel *launches*, not the work, so there the
    tracer records a pair of CUDA events per action instead and converts them to seconds when
    ``events`` is read (one synchronisation then, none during the step). The timeline is
    anchored at the host time of the rank's first recorded action: the bubble rate only uses
    per-rank spans, so it is exact; cross-rank alignment in a Chrome trace is approximate.
    (Written for GPUs; this project's CI machines have none, so that path has not been run.)
    """

    def __init__(self, rank: int = 0, enabled: bool = True, device: Any = None) -> None:
        self.rank = rank
        self.enabled = enabled
        self._cuda = device is not None and torch.device(device).type == "cuda"
        self._events: list[Event] = []
        #: host spans not yet read, as Event's fields (rank first), in order
        self._raw: list[tuple[int, str, int, int, float, float, float]] = []
        self._span_type: type[_Span] = _CudaSpan if self._cuda else _HostSpan
        self._pending: list[tuple[str, int, int, Any, Any, float]] = []
        self._anchor: tuple[Any, float] | None = None  # (first CUDA start event, host time then)
        self._waited = 0.0  # the open span's waits for its own collectives (add_wait)
        #: overlapped pairs' halves, piece by piece (:meth:`piece`); CUDA: unresolved events
        self._pieces: list[Event] = []
        self._pending_pieces: list[tuple[str, int, int, Any, Any]] = []

    @property
    def events(self) -> list[Event]:
        if self._raw:
            self._resolve_host()
        if self._pending or self._pending_pieces:
            self._resolve_cuda()
        return self._events

    @property
    def pieces(self) -> list[Event]:
        """The halves of overlapped pairs, one event per stretch a half ran without the other
        (an ``F`` or ``B`` of its own stage and microbatch). Each lies inside its pair's ``F+B``
        event in :attr:`events`, which alone counts as the rank's busy time: the halves take
        turns on one thread, so the pieces of one pair never overlap each other."""
        if self._pending or self._pending_pieces:
            self._resolve_cuda()
        return self._pieces

    def mark(self) -> Any:
        """A point in time for :meth:`piece`: the host clock, or a recorded CUDA event."""
        if not self._cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def piece(self, kind: str, stage: int, microbatch: int, start: Any, end: Any) -> None:
        """One stretch of an overlapped pair's half, between two :meth:`mark` s (kept while
        the tracer was enabled when the pair began: the pair runner disables it inside)."""
        if self._cuda:
            self._pending_pieces.append((kind, stage, microbatch, start, end))
        else:
            self._pieces.append(Event(self.rank, kind, stage, microbatch, start, end))

    def span(self, kind: str, stage: int, microbatch: int) -> AbstractContextManager[None]:
        """Time the ``with`` body as one action (recorded even when the body raises).

        A plain object with ``__enter__``/``__exit__``, not a generator: it runs around every
        compute action, where a generator-based context manager's few microseconds of host time
        are paid per microbatch (docs/results/host-time.md); disabled, it is a shared no-op.
        """
        if not self.enabled:
            return _NO_SPAN
        return self._span_type(self, kind, stage, microbatch)

    def add_wait(self, seconds: float) -> None:
        """The open span's action waited ``seconds`` for its own collectives (recorded in its
        event's ``waited``; the communication points call this)."""
        self._waited += seconds

    def _resolve_host(self) -> None:
        self._events.extend(map(_AS_EVENT, self._raw))  # no Python call per event
        self._raw.clear()

    def _resolve_cuda(self) -> None:
        torch.cuda.synchronize()
        ref, host = self._anchor
        for kind, stage, mb, s, e, waited in self._pending:
            t0 = host + ref.elapsed_time(s) / 1e3
            end = t0 + s.elapsed_time(e) / 1e3
            self._events.append(Event(self.rank, kind, stage, mb, t0, end, waited))
        self._pending.clear()
        for kind, stage, mb, s, e in self._pending_pieces:
            t0 = host + ref.elapsed_time(s) / 1e3
            self._pieces.append(Event(self.rank, kind, stage, mb, t0, t0 + s.elapsed_time(e) / 1e3))
        self._pending_pieces.clear()

    def clear(self) -> None:
        self._events.clear()
        self._raw.clear()
        self._pending.clear()
        self._pieces.clear()
        self._pending_pieces.clear()
        self._anchor = None

    def gather(self, group: dist.ProcessGroup | None = None) -> Trace:
        """Collect every rank's events (a collective: call it on all ranks of ``group``)."""
        if not dist.is_available() or not dist.is_initialized():
            return Trace({self.rank: list(self.events)}, {self.rank: list(self.pieces)})
        world = dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (self.rank, self.events, self.pieces), group=group)
        return Trace(
            {rank: list(evs) for rank, evs, _ in gathered},
            {rank: list(pcs) for rank, _, pcs in gathered},
        )


_NO_SPAN = nullcontext()
#: a tuple of Event's fields -> the Event, in C (NamedTuple's own constructors run Python)
_AS_EVENT = functools.partial(tuple.__new__, Event)


class _Span:
    """One action of ``tracer``: what it is (kind, stage, microbatch); subclasses time it."""

    __slots__ = ("_tracer", "_kind", "_at_stage", "_mb")

    def __init__(self, tracer: Tracer, kind: str, stage: int, microbatch: int) -> None:
        self._tracer, self._kind, self._at_stage, self._mb = tracer, kind, stage, microbatch


class _HostSpan(_Span):
    """One action timed by the host clock (CPU devices)."""

    __slots__ = ("_start",)

    def __enter__(self) -> None:
        self._tracer._waited = 0.0
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        t = self._tracer
        # a plain tuple: the Event is built when Tracer.events is read (a NamedTuple's Python
        # __new__ per action was most of the span's cost)
        t._raw.append((t.rank, self._kind, self._at_stage, self._mb, self._start, end, t._waited))


class _CudaSpan(_Span):
    """One action timed by a pair of CUDA events (resolved when ``Tracer.events`` is read)."""

    __slots__ = ("_start", "_end")

    def __enter__(self) -> None:
        t = self._tracer
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._start.record()
        t._waited = 0.0
        if t._anchor is None:
            t._anchor = (self._start, time.perf_counter())

    def __exit__(self, *exc: object) -> None:
        self._end.record()
        t = self._tracer
        t._pending.append((self._kind, self._at_stage, self._mb, self._start, self._end, t._waited))


@dataclass(frozen=True)
class Trace:
    """Events of all ranks for one or more steps; ``pieces``: the halves of overlapped pairs,
    inside their pairs' ``F+B`` events (:attr:`Tracer.pieces`; busy time counts the pairs)."""

    events: dict[int, list[Event]]
    pieces: dict[int, list[Event]] = field(default_factory=dict)

    @property
    def bubble_rate(self) -> float:
        """Measured bubble rate (:func:`zbpipe.planning.metrics.bubble_rate`)."""
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
        """Chrome/Perfetto trace-event JSON: one complete event (``ph: X``) per compute action,
        and inside each overlapped pair's ``F+B`` its halves' pieces (nested slices)."""
        return to_chrome(self.events, pieces=self.pieces)

    def write_chrome(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)


def attach_stage_tracer(stage: Any, tracer: Tracer) -> list[Patch]:
    """Time a torch ``PipelineStage``'s compute methods (for torch's built-in schedules).

    Wraps ``forward_one_chunk`` (F), ``backward_one_chunk`` (BW, or B when split) and
    ``backward_weight_one_chunk`` (W) on this stage object only; ``undo_all`` of the returned
    patches removes the timing. zbpipe's own schedules do not need this.
    """
    idx = stage.stage_index
    fwd, bwd, bww = (
        stage.forward_one_chunk,
        stage.backward_one_chunk,
        stage.backward_weight_one_chunk,
    )

    def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        with tracer.span("F", idx, mb):
            return fwd(mb, *args, **kwargs)

    def backward_one_chunk(mb: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
        with tracer.span("BW" if full_backward else "B", idx, mb):
            return bwd(mb, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        with tracer.span("W", idx, mb):
            return bww(mb, *args, **kwargs)

    return [
        patch(stage, "forward_one_chunk", forward_one_chunk),
        patch(stage, "backward_one_chunk", backward_one_chunk),
        patch(stage, "backward_weight_one_chunk", backward_weight_one_chunk),
    ]
