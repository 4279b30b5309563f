"""One recompute per checkpointed region and microbatch under the graph engine.

Non-reentrant ``torch.utils.checkpoint`` recomputes a region once per backward *call* (per
graph task), at the first unpack of one of its saved tensors. The graph engine's B is one call
and its W one or more further calls through the same nodes (a boundary node runs in both), so
without help every region B and W both reach ran its forward again in each W call, and a
selectively checkpointed one raised (its cache hands each saved output to one call only).

B records, per region it recomputes, the tensors the recompute hands to checkpoint's
recomputation hook, in order; W's calls then replay those to the hook instead of running the
region's forward (``zbpipe._compat.recording_recompute`` / ``replaying_recompute``). Torch's
``GraphExecGroup`` (one recompute over several calls) does not fit: it lets each saved tensor
be unpacked once over all the calls, and a boundary node unpacks its saved tensors in B and W.

The price: between B and W the microbatch keeps the region's recomputed saved tensors (all of
them: which ones W's nodes will unpack is not known from here), where it kept only the region's
inputs. They are told to the microbatch's memory observer. Regions are found through the
inputs this microbatch's :class:`~zbpipe.memory.saved.SavedTensors` holds; a region nested in
another checkpointed region, or one B does not reach, recomputes per call as before.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import Tensor

from .. import _compat as C
from ..memory.saved import Holder, SavedTensors, storage_ptr, watch_recomputes

__all__ = ["RecomputeReplay"]


class RecomputeReplay:
    """B's recomputes of one (stage, microbatch), handed to its W."""

    def __init__(self, saved: SavedTensors | None, skip: set[int]) -> None:
        self._saved = saved
        self._skip = skip  # the parameters' storages: nothing to count
        # region -> (its recompute_fn, what B's recompute saved)
        self._regions: dict[int, tuple[Any, Any, list[Tensor]]] = {}
        self._held: list[Holder] = []

    def recording(self) -> AbstractContextManager[None]:
        """Around B's backward call: record the recomputes it starts."""
        if self._saved is None:
            return nullcontext()
        return watch_recomputes(self._seen)

    def _seen(self, region: Any) -> None:
        if id(region) in self._regions:
            return
        store: list[Tensor] = []
        original = C.swap_recompute(region, lambda *args: None)
        C.swap_recompute(region, C.recording_recompute(original, store))
        self._regions[id(region)] = (region, original, store)

    def replay(self) -> None:
        """After B: every recorded region's later recomputes replay what B's saved."""
        observer = self._saved.observer if self._saved is not None else None
        for region, _, store in self._regions.values():
            C.swap_recompute(region, C.replaying_recompute(store))
            if observer is not None:
                counted = [t for t in store if storage_ptr(t) not in self._skip]
                self._held += [Holder(t, observer, hold=False) for t in counted]

    @property
    def regions(self) -> int:
        """How many regions B recorded (for tests and logs)."""
        return len(self._regions)

    def release(self) -> None:
        """After W: the regions run their own recompute again, the recorded tensors go."""
        for region, original, store in self._regions.values():
            C.swap_recompute(region, original)
            store.clear()
        self._regions.clear()
        for h in self._held:
            h.release()
        self._held = []
