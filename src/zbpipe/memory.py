"""Measure the activation memory a pipeline stage keeps for backward.

:class:`SavedActivationMeter` counts the bytes of tensors autograd saves during forwards and stops
counting them when they are released (by zbpipe's split backward, see :mod:`zbpipe.saved`) or when
the graph that saved them is freed (a fused backward), so ``peak_bytes`` is the peak of live saved
activations on a rank: what a schedule's memory budget is about. Parameters (and views of them) are
not activations and are not counted; a storage saved several times counts once.

Attach it with ``sched.attach_meter(meter)`` for zbpipe schedules, or ``meter.attach(stage)`` for
torch's built-in schedules.
"""

from __future__ import annotations

from typing import Any

from .patching import Patch, patch
from .saved import SavedTensors, param_storages


class SavedActivationMeter:
    """Live and peak bytes of saved activations (an observer of :class:`zbpipe.saved.Holder`)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, int] = {}  # storage pointer -> holders alive

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def on_pack(self, storage: int, nbytes: int) -> None:
        if storage == 0:
            return
        n = self._refs.get(storage, 0)
        if n == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[storage] = n + 1

    def on_free(self, storage: int, nbytes: int) -> None:
        if storage == 0 or storage not in self._refs:
            return
        self._refs[storage] -= 1
        if self._refs[storage] == 0:
            del self._refs[storage]
            self.live_bytes -= nbytes

    def attach(self, stage: Any) -> Patch:
        """Count what a torch ``PipelineStage``'s forwards save (for torch's built-in schedules).

        Wraps this stage object's ``forward_one_chunk`` (``.undo()`` the result to detach).
        zbpipe schedules: use
        ``sched.attach_meter(meter)`` instead (their forwards already hold saved tensors).
        """
        params = param_storages(stage.submod.parameters())
        forward = stage.forward_one_chunk

        def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            with SavedTensors(observer=self, skip=params).hooks():
                return forward(*args, **kwargs)

        return patch(stage, "forward_one_chunk", forward_one_chunk)
