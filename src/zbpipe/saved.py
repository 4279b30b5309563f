"""Own the tensors autograd saves during a forward, so the split backward can free them early.

A fused backward frees each node's saved tensors as it runs (``retain_graph=False``). The split
backward cannot: B runs with ``retain_graph=True`` because W re-enters the graph later. Left alone,
every tensor a microbatch's forward saved would then live until W, and longer while anything
still references the graph (a pending send of the stage output, a loss kept for the user).

:class:`SavedTensors` is installed with ``torch.autograd.graph.saved_tensors_hooks`` around one
microbatch's forward: every saved tensor is stored in a :class:`Holder`. During B, zbpipe marks
which node unpacks each holder (``phase``); afterwards the holders unpacked only by activation
nodes (GELU's input, attention probabilities, ...) are released, because W never runs those
nodes. After W everything is released. What W needs (the inputs of weight matmuls, LayerNorm
statistics, ...) stays until W: exactly the memory ``Costs.mem_w`` models.

Observers (``on_pack(holder)`` / ``on_release(holder)``) let :mod:`zbpipe.memory` count bytes.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch

_state = threading.local()  # which kind of node is unpacking right now (set by B's prehooks)

ACTIVATION = "activation"
KEEP = "keep"


class Observer(Protocol):
    """Told when a saved tensor's storage gains or loses a holder (for byte counting)."""

    def on_pack(self, storage: int, nbytes: int) -> None: ...
    def on_free(self, storage: int, nbytes: int) -> None: ...


class Holder:
    """One saved tensor. ``release()`` drops it; a later unpack raises a clear error."""

    __slots__ = (
        "tensor",
        "nbytes",
        "storage",
        "unpacked_as",
        "_observer",
        "_finalizer",
        "__weakref__",
    )

    def __init__(self, tensor: torch.Tensor, observer: Observer | None) -> None:
        self.tensor: torch.Tensor | None = tensor
        local = _local(tensor)  # a DTensor's bytes are its local shard's
        try:
            storage = local.untyped_storage()
            self.storage, self.nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            self.storage, self.nbytes = 0, 0
        self.unpacked_as: str | None = None
        self._observer = observer
        self._finalizer = None
        if observer is not None:
            observer.on_pack(self.storage, self.nbytes)
            # The graph may die before anyone calls release() (a fused backward frees as it goes).
            self._finalizer = weakref.finalize(self, observer.on_free, self.storage, self.nbytes)

    def release(self) -> None:
        if self.tensor is not None:
            self.tensor = None
            if self._finalizer is not None:
                self._finalizer()  # tell the observer now, and only once


def _local(t: torch.Tensor) -> torch.Tensor:
    if type(t) is torch.Tensor:
        return t
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def storage_ptr(t: torch.Tensor) -> int | None:
    """The data pointer of ``t``'s storage; ``None`` when it has none we can name.

    A wrapper tensor subclass has no storage of its own (a DTensor raises "invalid python
    storage"); for a DTensor this is its local shard's storage.
    """
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            with torch.no_grad():
                return storage_ptr(t.to_local())
        return None


def param_storages(params: Any) -> set[int]:
    """Storage pointers of parameters (saved tensors sharing them are weights, not activations)."""
    return {ptr for p in params if (ptr := storage_ptr(p)) is not None}


class SavedTensors:
    """The saved tensors of one (stage, microbatch) forward."""

    def __init__(self, observer: Observer | None = None, skip: set[int] | None = None) -> None:
        self.holders: list[Holder] = []
        self._observer = observer
        self._skip = skip or set()  # storages never worth holding (the stage's parameters)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if storage_ptr(t) in self._skip:
            return t  # a parameter (or a view of one): releasing it would free nothing
        h = Holder(t, self._observer)
        self.holders.append(h)
        return h

    def release_activation_only(self) -> int:
        """Release holders unpacked during B only by activation nodes; return bytes released."""
        freed = 0
        for h in self.holders:
            if h.unpacked_as == ACTIVATION and h.tensor is not None:
                freed += h.nbytes
                h.release()
        return freed

    def release_all(self) -> None:
        for h in self.holders:
            h.release()
        self.holders.clear()


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, Holder):
        return packed
    if packed.tensor is None:
        raise RuntimeError(
            "zbpipe: autograd asked for a saved tensor that was already released after the input-gradient "
            "pass B (or after W). This is a zbpipe bug unless you ran a second backward through a pipeline "
            "stage's graph; please report it with the stage's model"
        )
    kind = getattr(_state, "kind", None)
    if kind is not None and packed.unpacked_as != KEEP:
        packed.unpacked_as = kind
    return packed.tensor


def mark_unpacking(kind: str | None) -> None:
    """Tag unpacks that follow as ``ACTIVATION`` or ``KEEP`` (B's prehooks call this per node)."""
    _state.kind = kind
