"""Measure the activation memory a pipeline stage keeps for backward.

:class:`SavedActivationMeter` counts the bytes of every tensor held for a backward pass, from the
moment it is held until it is let go:

* tensors autograd saves during forwards, until zbpipe's split backward releases them (see
  :mod:`zbpipe.memory.saved`) or autograd frees them (a fused backward, a graph dropped);
* the deferred engine's queue: each queued weight GEMM's input and output gradient, B to W;
* the graph engine's recorded gradients: what arrived at every boundary in B, kept until W;
* what a stage hands on: its output (every stage but the last) from its forward, and its input
  gradient from its B, until the storage is freed: torch's stage keeps an output until B, a
  send keeps its tensor until it completes (:mod:`zbpipe.schedules.sends`; torch's own runtime keeps
  every send of a step until the step ends), a local next or previous stage (V placement)
  until it is done with it.

Parameters (and views of them) are not activations and are not counted; a storage held several
times counts once. Measuring changes nothing: the meter keeps storage pointers and sizes, never a
tensor, and zbpipe's holders keep detached aliases, weakly (a tensor dies when it would unwatched).
Not counted: what torch's stage receives into (buffers it allocates once and reuses every step)
until something above holds it. torch's own schedules (``meter.attach``) are watched the same
way: saved tensors, outputs and input gradients; their runtime's own bookkeeping (the deferred
queue, recorded gradients) is zbpipe's only.

Steps are measured separately, so a leak cannot pass for a high peak::

    meter.begin_step()
    sched.step(...)
    s = meter.end_step()   # StepMemory: s.peak_bytes, s.retained_bytes, s.carried_bytes

``peak_bytes`` is the peak of live bytes *saved during this step*: what a schedule's memory budget
is about. Bytes still alive from earlier steps are ``carried_bytes``, not part of the peak; the
bytes this step saved and never freed are ``retained_bytes`` (a schedule that frees everything has
0; a leak shows up as retained bytes every step, not as a growing peak).

Attach it with ``sched.attach_meter(meter)`` for zbpipe schedules, or ``meter.attach(stage)`` for
torch's built-in schedules (and ``loss_fn=meter.watch_loss(loss_fn)``: torch computes the loss
outside the stage's forward).

Observer interface (anything that holds tensors for backward can report them): call
``on_pack(storage, nbytes)`` when a tensor starts being held and ``on_free(storage, nbytes)`` when
it stops, with ``storage`` the storage's data pointer (0: not counted) and ``nbytes`` its size.
Calls must pair up per holder; several holders of one storage count it once. ``on_free`` may come
from a finalizer, in whatever thread drops the last reference: the meter takes a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _compat as C
from ..patching import Patch, patch
from .saved import (
    SavedTensors,
    StorageRefs,
    count_all_until_freed,
    input_storages,
    param_storages,
)


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    """Saved-activation bytes of one step, from :meth:`SavedActivationMeter.end_step`."""

    peak_bytes: int
    """Peak of live bytes saved during this step (earlier steps' leftovers excluded)."""
    retained_bytes: int
    """Bytes saved during this step still alive at its end: the per-step growth (0 = no leak)."""
    carried_bytes: int
    """Bytes alive when the step began (earlier steps' retained bytes still alive)."""


class SavedActivationMeter:
    """Live and per-step peak bytes of what is held for backward (the module docstring lists it).

    An observer of :class:`zbpipe.memory.saved.Holder`: saved tensors, the deferred engine's queue,
    the graph engine's recorded gradients, and (:func:`zbpipe.memory.saved.count_all_until_freed`)
    outputs and input gradients handed on.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a collection inside on_pack may free
        self.live_bytes = 0
        """Every live saved byte this meter counted, whichever step saved it."""
        self._refs = StorageRefs()  # storage pointer -> holders alive
        self._born: dict[int, int] = {}  # storage pointer -> the step that first held it
        self._step = 0  # steps begun; 0 = before the first begin_step (counts as a step)
        self._step_live = 0  # live bytes first held in the current step
        self._step_peak = 0
        self._carried = 0

    @property
    def peak_bytes(self) -> int:
        """Peak live bytes saved since :meth:`begin_step` (since construction before any)."""
        return self._step_peak

    def begin_step(self) -> None:
        """Start a step: from now on the peak counts only tensors saved in this step."""
        self._step += 1
        self._step_live = 0
        self._step_peak = 0
        self._carried = self.live_bytes

    def end_step(self) -> StepMemory:
        """This step's peak, what it left alive, and what it inherited (call after ``gc.collect()``
        if graphs may sit in reference cycles)."""
        return StepMemory(
            peak_bytes=self._step_peak,
            retained_bytes=self._step_live,
            carried_bytes=self._carried,
        )

    def reset_peak(self) -> None:
        """Same as :meth:`begin_step` (the older name, kept for existing callers)."""
        self.begin_step()

    def on_pack(self, storage: int, nbytes: int) -> None:
        if storage == 0:
            return
        with self._lock:
            if self._refs.add(storage):
                self.live_bytes += nbytes
                self._born[storage] = self._step
                self._step_live += nbytes
                self._step_peak = max(self._step_peak, self._step_live)

    def on_free(self, storage: int, nbytes: int) -> None:
        with self._lock:
            if storage != 0 and self._refs.remove(storage):
                self.live_bytes -= nbytes
                if self._born.pop(storage) == self._step:
                    self._step_live -= nbytes

    def watch_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn``, counting what it saves for backward (for torch's schedules, which compute
        the loss outside the stage's forward; zbpipe's count their loss already)::

            sched = Schedule1F1B(stage, m, loss_fn=meter.watch_loss(loss_fn))
        """

        def counted(*args: Any, **kwargs: Any) -> Any:
            # the target (everything after the output) is a slice of the caller's targets
            with SavedTensors(observer=self, given=input_storages((args[1:], kwargs))).hooks():
                return loss_fn(*args, **kwargs)

        return counted

    def attach(self, stage: Any) -> list[Patch]:
        """Count what a torch ``PipelineStage`` holds for backward, for torch's own schedules:
        what its forwards save, its outputs (not the last stage's) and its input gradients, each
        until freed, as zbpipe's schedules count them (a saved slice of the caller's batch, the
        first stage's input or, through :meth:`watch_loss`, a target, counts as its own bytes).

        Wraps this stage object's ``forward_one_chunk`` and ``backward_one_chunk``
        (:func:`zbpipe.patching.undo_all` the result to detach). zbpipe schedules: use
        ``sched.attach_meter(meter)`` instead.
        """
        params = param_storages(stage.submod.parameters())
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            # (chunk id, args, kwargs, ...): the first stage's are slices of the caller's batch
            given = input_storages((args[1:], kwargs)) if stage.is_first else None
            with SavedTensors(observer=self, skip=params, given=given).hooks():
                output = forward(*args, **kwargs)
            if not stage.is_last:
                count_all_until_freed(output, self)
            return output

        def backward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            out = backward(mb, *args, **kwargs)
            if not stage.is_first:
                count_all_until_freed(C.input_grad_cache(stage).get(mb, ()), self)
            return out

        return [
            patch(stage, "forward_one_chunk", forward_one_chunk),
            patch(stage, "backward_one_chunk", backward_one_chunk),
        ]
