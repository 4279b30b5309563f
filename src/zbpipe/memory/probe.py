"""What one microbatch of each stage holds after its F and after its B: the bytes behind
``costs="profile"``'s memory fields.

While a :class:`MemoryProbe` is set on a stage seam, every ``(stage, microbatch)`` gets its own
:class:`KeyBytes` observer: everything held for that microbatch's backward reports to it (the
tensors its forward saves, its output until freed, the deferred engine's queue or the graph
engine's recorded gradients), and it passes every report on to the rank's memory meter, if one
is attached. The probe records the observer's live bytes right after F (``"F"``: what the
forward allocated, output included) and right after B, before the input gradient is handed on
(``"B"``: what waits for W; the input gradient's send is let go of soon after, see
:mod:`zbpipe.schedules.sends`). W frees the rest. A storage counts once per microbatch.
"""

from __future__ import annotations

import statistics
import threading

from .saved import Observer, StorageRefs


class KeyBytes:
    """An observer of one microbatch of one stage: its live bytes, every report passed on."""

    __slots__ = ("live", "_refs", "_parent", "_lock")

    def __init__(self, parent: Observer | None) -> None:
        self.live = 0
        self._refs = StorageRefs()
        self._parent = parent
        self._lock = threading.RLock()  # on_free may come from a finalizer in another thread

    def on_pack(self, storage: int, nbytes: int) -> None:
        if self._parent is not None:
            self._parent.on_pack(storage, nbytes)
        if storage != 0:
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
    """Per stage, the bytes a microbatch held after F and after B, over the probed steps."""

    def __init__(self) -> None:
        self.samples: dict[int, dict[str, list[int]]] = {}

    def record(self, kind: str, stage: int, nbytes: int) -> None:
        self.samples.setdefault(stage, {}).setdefault(kind, []).append(nbytes)

    def medians(self, stages: list[int] | None = None) -> dict[int, dict[str, float]]:
        """``{stage: {"F": bytes, "B": bytes}}``, medians over the recorded microbatches."""
        return {
            s: {k: float(statistics.median(v)) for k, v in sorted(kinds.items())}
            for s, kinds in sorted(self.samples.items())
            if stages is None or s in stages
        }
