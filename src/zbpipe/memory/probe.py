"""What one microbatch of each stage holds after its F and after its B: the bytes behind
``costs="profile"``'s memory fields.

While a :class:`MemoryProbe` is set on a stage seam, every ``(stage, microbatch)`` gets its own
:class:`KeyBytes` observer: everything held for that microbatch's backward reports to it (the
tensors its forward saves, its output until freed, the deferred engine's queue or the graph
engine's recorded gradients), and it passes every report on to the rank's memory meter, if one
is attached. What the microbatch did not allocate (its inputs: :class:`KeyBytes`) is passed on
but not counted as its own. The probe records the observer's
live bytes right after F (``"F"``: what the forward allocated, output included) and right after
B, before the input gradient is handed on (``"B"``: what waits for W; the input gradient's send
is let go of soon after, see :mod:`zbpipe.schedules.sends`). W frees the rest. A storage counts
once per microbatch.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Container, Iterable
from typing import Any

import torch

from .. import _compat as C
from .saved import Observer, StorageRefs, input_storages, storage_and_bytes


class KeyBytes:
    """An observer of one microbatch of one stage: its live bytes, every report passed on.

    ``not_own``: storage keys the microbatch holds but did not allocate, left out of
    :attr:`live` (still passed on): its inputs (:func:`inputs_of`). A stage's input is a slice
    of the caller's batch (held for the whole step), torch's receive buffer (one per microbatch,
    allocated at the first step and reused by every step) or a local previous stage's output
    (counted there, as its output). No order of the actions changes what those hold, so
    counting them charged every microbatch in flight an input more than it holds (a tenth of a
    checkpointed stage's bytes).
    """

    __slots__ = ("live", "not_own", "_refs", "_parent", "_lock")

    def __init__(self, parent: Observer | None, not_own: Iterable[int] = ()) -> None:
        self.live = 0
        self.not_own = set(not_own)
        self._refs = StorageRefs()
        self._parent = parent
        self._lock = threading.RLock()  # on_free may come from a finalizer in another thread

    def on_pack(self, storage: int, nbytes: int) -> None:
        if self._parent is not None:
            self._parent.on_pack(storage, nbytes)
        if storage != 0 and storage not in self.not_own:
            with self._lock:
                if self._refs.add(storage):
                    self.live += nbytes

    def on_free(self, storage: int, nbytes: int) -> None:
        if self._parent is not None:
            self._parent.on_free(storage, nbytes)
        with self._lock:
            if self._refs.remove(storage):
                self.live -= nbytes


class MemoryProbe:
    """Per stage, the bytes a microbatch held after F and after B, over the probed steps.

    ``microbatches``: which microbatches of a step are watched (default: the first). Every
    microbatch of a step has the same shapes, so one says what each holds; watching costs each
    watched forward a holder per saved tensor (about 0.4 ms per forward of the issue 37 MLP on
    one CPU core), which a step need not pay for every microbatch.
    """

    def __init__(self, microbatches: Container[int] = (0,)) -> None:
        self.samples: dict[int, dict[str, list[int]]] = {}
        self.microbatches = microbatches

    def watches(self, mb: int) -> bool:
        return mb in self.microbatches

    def record(self, kind: str, stage: int, nbytes: int) -> None:
        self.samples.setdefault(stage, {}).setdefault(kind, []).append(nbytes)

    def medians(self, stages: list[int] | None = None) -> dict[int, dict[str, float]]:
        """``{stage: {"F": bytes, "B": bytes}}``, medians over the recorded microbatches."""
        return {
            s: {k: float(statistics.median(v)) for k, v in sorted(kinds.items())}
            for s, kinds in sorted(self.samples.items())
            if stages is None or s in stages
        }


def inputs_of(stage: Any, mb: int, given: Any) -> set[int]:
    """The keys :class:`KeyBytes` of ``(stage, mb)`` does not count as the microbatch's own: the
    caller's slices ``given`` (a saved view of one counts under its slice's key:
    :func:`~zbpipe.memory.saved.slice_counted`) and what a later stage received or was handed
    by a local previous stage. A received output gradient that W keeps (the last Linear's, when
    nothing lies between it and the stage output) is still counted: eager, W holds torch's
    receive buffer itself, but a compiled stage's backward hands W a copy, and a plan must be
    the same for both."""
    keys = {~start for slices in input_storages(given).values() for start, _ in slices}
    if not stage.is_first:
        keys |= storages_of(C.received_activation_buffers(stage, mb))
    return keys


def storages_of(values: Iterable[Any]) -> set[int]:
    """The storage keys of the tensors in ``values`` (as :class:`~zbpipe.memory.saved.Holder`
    reports them)."""
    return {storage_and_bytes(t)[0] for t in values if isinstance(t, torch.Tensor)}
