"""Overlapped pairs at run time: torch's ``OVERLAP_F_B`` action, with its two halves interleaved
at the model's communication points (:mod:`zbpipe.schedules.comm_points`).

A pair is the forward F of one stage and the input-gradient pass B of another stage of the same
rank. Its backward half runs as a generator (the stage seam's ``backward_input_steps``): one
segment of B, then it starts the collective of the communication point above the next segment
and yields. The forward half runs as an ordinary forward; at each of its points the forward
starts its own collective, *steps* the backward half once (B waits for its collective, computes
its next segment, starts its next collective, yields), then waits for its own collective::

    B: seg K, start c_K ->  F: compute, start d_1 -> B: wait c_K, seg K-1, start c_K-1 ->
    F: wait d_1, compute, start d_2 -> B: wait c_K-1, ... -> F: ... end -> B: what is left

so each half's collective is in flight while the other half computes. No thread: the backward
half runs only inside the forward half's calls, one step at a time, outside the forward's
torch-function and dispatch modes (selective checkpointing's caching mode, the alias mode of a
cut forward; ``_compat.outside_python_modes``). A point reached while the backward half runs (a
checkpointed region recomputed) is an ordinary collective.

The backward half runs in segments only where its forward cut the graph at the points: the
runner marks those keys (``StageSeam.cut_keys``) when a plan is lowered, for every pair whose
backward is a B, with an engine that can run B in segments (the deferred one). Otherwise, or
without points, or with ``overlap=False``, a pair runs its backward, then its forward: what
torch's own ``ScheduleDualPipeV`` does.

**What the collectives cost** (for ``costs="profile"``): every collective a point starts is
timed where it is waited for (:class:`_Timed`). Outside a pair, the wait goes to the running
action's traced span (``Event.waited``: ``Costs.a2a`` is its median, and F or B its span less
the wait). A pair is traced as one ``F+B`` span (the rank's busy time: its halves share one
thread), and inside it each half piece by piece (``Tracer.pieces``: an ``F`` or ``B`` event per
stretch one half ran without the other; a Chrome trace nests them under the pair). Its halves'
compute is recorded apart for the costs (:attr:`PairRunner.halves`): the backward half's
steps, less the waits inside them, are its B; the rest of the pair, less the forward half's own
waits, its F. A pair whose halves ran in turn
also tells what its collectives took; an interleaved one does not (a wait then shows only what
the other half's compute left of it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _compat as C
from ..engines.segmented import Collective, Exchange, Pending
from ..observe.timeline import Event
from ..planning import Plan
from . import planned_actions
from .comm_points import CommPoint, install, restore


class PairRunner:
    """Runs the overlapped pairs of one :class:`~zbpipe.schedules.runtime.PlannedSchedule`."""

    def __init__(self, sched: Any) -> None:
        self._sched = sched
        self._points: list[CommPoint] = []
        self._patches: list[Any] = []
        self._overlap = False
        self._backward_half: Iterator[None] | None = None
        self._stepping = False
        #: the running pair's clocks: seconds in the backward half's steps, and waited for
        #: collectives outside them (the forward half's) and inside (the backward half's)
        self._in_pair = False
        self._clock = [0.0, 0.0, 0.0]
        #: each pair's halves, compute only, and whether they interleaved (``costs="profile"``
        #: reads and clears it after each step)
        self.halves: list[tuple[Event, bool]] = []
        #: tracing the running pair's pieces: (F's stage, F's microbatch, B's stage, B's
        #: microbatch, where the forward half's current piece began or None outside it)
        self._trace: list[Any] | None = None

    @property
    def overlaps(self) -> bool:
        """Whether pairs interleave their halves (points installed, an engine that segments)."""
        return self._overlap

    def enable(self, points: Sequence[CommPoint], overlap: bool = True) -> None:
        """Interleave pairs at ``points`` (replacing their methods; ``overlap=False``, or no
        points: halves in turn, the points' collectives still timed)."""
        restore(self._patches)
        self._points = list(points)
        self._patches = install(self._points, self.exchange) if self._points else []
        engine = self._sched.seam.engine
        self._overlap = overlap and bool(self._points) and engine.segments_backward
        self.lowered(self._sched.plan)

    def claim(self) -> None:
        """At the start of each step: forget the last step's :attr:`halves`; put this
        schedule's point methods back if another schedule replaced them."""
        self.halves.clear()
        if any(vars(p.target).get(p.name) is not p.replacement for p in self._patches):
            restore(self._patches)
            self._patches = install(self._points, self.exchange)

    def restore(self) -> None:
        """Give the points' methods back to the model (pairs then run their halves in turn)."""
        restore(self._patches)
        self._patches, self._overlap = [], False
        self._sched.seam.cut_keys = ()

    def lowered(self, plan: Plan) -> None:
        """A plan was lowered: cut the forwards of the B's that pairs will run in segments."""
        seam = self._sched.seam
        mine = set(seam.stages)
        seam.cut_keys = (
            {(b.stage, b.microbatch) for _, b in plan.pairs if b.kind == "B" and b.stage in mine}
            if self._overlap
            else set()
        )

    # ------------------------------------------------------------------ the points
    def exchange(self, x: Tensor, collective: Collective) -> Tensor:
        """What a communication point does: start the collective, let the backward half of
        the running pair step meanwhile, wait; cut the graph where the forward is cut."""
        collective = _Timed(collective, self)
        if self._stepping:  # recomputed inside the backward half: an ordinary collective
            return Exchange.apply(x, collective, None)
        meanwhile = self._step if self._backward_half is not None else None
        record = self._sched.seam.recording
        if record is not None:
            return record.cut(x, collective, meanwhile)
        if meanwhile is None:
            return Exchange.apply(x, collective, None)
        with torch.no_grad():
            pending = collective.start(x)
        meanwhile()
        return Exchange.apply(x, collective, pending)

    def _step(self) -> None:
        """One step of the running pair's backward half (its next segment, its next start)."""
        half = self._backward_half
        if half is None:
            return
        self._stepping = True
        trace = self._trace
        began = self._mark()
        if trace is not None and trace[4] is not None:  # the forward half's piece ends here
            self._sched.tracer.piece("F", trace[0], trace[1], trace[4], began)
        t0 = time.perf_counter()
        try:
            with C.outside_python_modes(), torch.enable_grad():
                next(half)
        except StopIteration:
            self._backward_half = None
        finally:
            self._stepping = False
            self._clock[0] += time.perf_counter() - t0
            if trace is not None:
                ended = self._sched.tracer.mark()
                self._sched.tracer.piece("B", trace[2], trace[3], began, ended)
                if trace[4] is not None:
                    trace[4] = ended

    def waited(self, seconds: float) -> None:
        """A point's collective was waited for ``seconds`` (module docstring)."""
        if self._in_pair:
            self._clock[2 if self._stepping else 1] += seconds
        else:
            self._sched.tracer.add_wait(seconds)

    # ------------------------------------------------------------------ the action
    def bind(self, action: Any) -> Any:
        """torch's ``OVERLAP_F_B`` action as one call of the action loop, its halves bound once
        (:mod:`zbpipe.schedules.action_loop`): F of one stage with the B (or BW) of another."""
        sched = self._sched
        first, second = C.sub_actions(action)
        forward = planned_actions.bind_forward(sched, first)
        backward = planned_actions.bind_action_of(sched, second)
        return functools.partial(self._run_bound, first, second, forward, backward)

    def run(self, action: Any, ctx: Any) -> None:
        """Run one ``OVERLAP_F_B`` action (binding it first: for callers outside the loop)."""
        self.bind(action)(ctx)

    def _run_bound(self, first: Any, second: Any, forward: Any, backward: Any, ctx: Any) -> None:
        tracer = self._sched.tracer
        s_b, mb_b = second.stage_index, second.microbatch_index
        with tracer.span("F+B", first.stage_index, first.microbatch_index):
            enabled, tracer.enabled = tracer.enabled, False  # one span for the pair
            if enabled:  # and its halves' pieces
                self._trace = [first.stage_index, first.microbatch_index, s_b, mb_b, None]
            try:
                self._run_halves(first, second, forward, backward, ctx)
            finally:
                tracer.enabled, self._trace = enabled, None

    def _run_halves(self, first: Any, second: Any, forward: Any, backward: Any, ctx: Any) -> None:
        sched = self._sched
        s, mb = second.stage_index, second.microbatch_index
        stage = sched.seam.stages[s]
        fused = second.computation_type != C.BACKWARD_INPUT
        if fused or not stage.has_backward:  # a fused BW, or eval() (forward only): in turn
            began = self._mark()
            backward(ctx)
            between = self._piece("BW" if fused else "B", s, mb, began)
            forward(ctx)
            self._piece("F", first.stage_index, first.microbatch_index, between)
            return
        planned_actions.prepare_backward(sched, stage, mb)
        steps = sched.seam.backward_input_steps(stage, mb, sched._maybe_get_loss(stage, mb))
        self._backward_half = iter(steps)
        self._in_pair, self._clock = True, [0.0, 0.0, 0.0]
        interleaved = (s, mb) in sched.seam.cut_keys
        t0 = time.perf_counter()
        try:
            self._step()  # its last segment, and its first collective started
            if self._trace is not None:
                self._trace[4] = self._mark()
            forward(ctx)  # its points step the backward half
            if self._trace is not None:
                self._piece("F", first.stage_index, first.microbatch_index, self._trace[4])
                self._trace[4] = None
            while self._backward_half is not None:
                self._step()
        finally:
            half, self._backward_half, self._in_pair = self._backward_half, None, False
            if half is not None:  # the forward half failed: the B's hooks, store, graph go now
                half.close()  # type: ignore[attr-defined]
        stepped, waited_f, waited_b = self._clock
        f_compute = time.perf_counter() - t0 - stepped - waited_f
        rank = sched.rank
        self.halves.append(
            (
                Event(rank, "F", first.stage_index, first.microbatch_index, 0.0, f_compute),
                interleaved,
            )
        )
        self.halves.append((Event(rank, "B", s, mb, 0.0, stepped - waited_b), interleaved))

    def _mark(self) -> Any:
        """Now, for a piece of the running pair (None when its pieces are not traced)."""
        return None if self._trace is None else self._sched.tracer.mark()

    def _piece(self, kind: str, stage: int, microbatch: int, began: Any) -> Any:
        """Trace a piece of the running pair's half from ``began`` to now; return now."""
        if self._trace is None:
            return None
        now = self._sched.tracer.mark()
        self._sched.tracer.piece(kind, stage, microbatch, began, now)
        return now


def bind_pair(sched: Any, action: Any) -> Any:
    """The action loop's binder for ``OVERLAP_F_B`` (``PlannedSchedule.action_binders``)."""
    return sched._pairs.bind(action)


class _Timed:
    """A point's collective whose waits are reported to the pair runner (``waited``)."""

    __slots__ = ("_inner", "_runner")

    def __init__(self, inner: Collective, runner: PairRunner) -> None:
        self._inner, self._runner = inner, runner

    def start(self, x: Tensor) -> _TimedPending:
        return _TimedPending(self._inner.start(x), self._runner)

    def start_backward(self, grad: Tensor) -> _TimedPending:
        return _TimedPending(self._inner.start_backward(grad), self._runner)


class _TimedPending:
    __slots__ = ("_inner", "_runner")

    def __init__(self, inner: Pending, runner: PairRunner) -> None:
        self._inner, self._runner = inner, runner

    def wait(self) -> Tensor:
        t0 = time.perf_counter()
        out = self._inner.wait()
        self._runner.waited(time.perf_counter() - t0)
        return out
