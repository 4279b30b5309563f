"""A memory meter that shares nothing with zbpipe's: every storage any op creates during a step.

A ``TorchDispatchMode`` sees each op's outputs, wherever they come from (autograd's saved
tensors, the engines' queues and recorded gradients, sends, temporaries) and follows each new
storage until it is freed (a finalizer on the storage object, which torch keeps alive as long
as the storage). Storages still alive when the step ends (``.grad``, losses, outputs kept for the
caller) are left out, so what remains is what the step allocated and gave back: activations and
everything held for backward. ``mark()`` after each pipeline action samples the live total
there, so :meth:`step_peaks` gives the peak held between actions (what a plan's memory model
describes) and the peak over every op (the transients inside an action too).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageMeter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._events: list[tuple[int, int | None]] = []  # (+/- bytes, storage); (0, None) a mark
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()

    def _free(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if self._live.pop(ptr, None) is not None:
                self._events.append((-nbytes, ptr))

    def mark(self) -> None:
        with self._lock:
            self._events.append((0, None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            with self._lock:
                if ptr == 0 or ptr in self._live:
                    continue
                self._live[ptr] = storage.nbytes()
                self._events.append((storage.nbytes(), ptr))
            weakref.finalize(storage, self._free, ptr, storage.nbytes())
        return out

    def step_peaks(self) -> tuple[int, int]:
        """``(peak at action ends, peak over every op)`` of the step this meter watched."""
        alive = set(self._live)
        live = held = every = 0
        for delta, ptr in self._events:
            if ptr is None:
                held = max(held, live)
            elif ptr not in alive:
                live += delta
                every = max(every, live)
        return held, every


def mark_after(obj: Any, names: Iterable[str], meter_box: list[Any]) -> None:
    """After each call of ``obj``'s methods ``names``, mark the meter in ``meter_box[0]``."""
    for name in names:
        fn = getattr(obj, name)

        def marked(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            result = _fn(*args, **kwargs)
            if meter_box[0] is not None:
                meter_box[0].mark()
            return result

        setattr(obj, name, marked)


#: what marks an action's end: torch's stage methods, zbpipe's stage seam
TORCH_ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
SEAM_ACTIONS = ("hand_forward", "backward_input", "backward_weight", "full_backward")
