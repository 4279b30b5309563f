"""Measure the activation memory a pipeline stage keeps for backward.

:class:`SavedActivationMeter` counts the bytes of tensors autograd saves during a stage's
forwards (through ``torch.autograd.graph.saved_tensors_hooks``) and releases them when the
graph that saved them is freed, so ``peak_bytes`` is the peak of live saved activations on
that rank: what the schedule's memory budget is about. Parameters (and views of them) are not
activations and are not counted; a storage saved twice counts once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class _Saved:
    """What autograd stores instead of the tensor; releasing it releases the count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationMeter:
    """Live and peak bytes of saved activations for the stages it is attached to."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._param_ptrs: set[int] = set()

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
            return t
        if ptr in self._param_ptrs or ptr == 0:
            return t
        entry = self._refs.get(ptr)
        if entry is None:
            entry = self._refs[ptr] = [0, t.untyped_storage().nbytes()]
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        holder = _Saved(t)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        entry = self._refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[ptr]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def attach(self, stage: Any) -> None:
        """Count what ``stage``'s forwards save (wraps this stage object's ``forward_one_chunk``)."""
        self._param_ptrs |= {p.untyped_storage().data_ptr() for p in stage.submod.parameters()}
        forward = stage.forward_one_chunk

        def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return forward(*args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
