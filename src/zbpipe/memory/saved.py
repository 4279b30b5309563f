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
statistics, ...) stays until W: exactly the memory ``Costs.mem_w`` models. So do the inputs of
a non-reentrant checkpointed region, whichever node's unpack made B recompute it: W's backward
calls ask for them again (``zbpipe._compat.asked_by_checkpoint``), though they replay B's
recompute rather than run it (:func:`watch_recomputes`).

Observers (``on_pack`` / ``on_free``) let :mod:`zbpipe.memory` count bytes.

Nothing here may change when a tensor dies, or a memory meter would measure itself:

* a holder keeps a *detached alias* of the tensor (same storage and version counter, no
  ``grad_fn``). Holding the tensor itself made a reference cycle through autograd's C++ graph,
  which Python's garbage collector cannot see: holder -> tensor -> its ``grad_fn`` -> ... -> the
  node that saved it -> the holder (every node's saved-tensor hooks also keep the pack hook, hence
  the :class:`SavedTensors` and its holders). Unless zbpipe released every holder, the graph was
  never freed: torch's split-backward schedules watched by the meter "leaked" every graph;
* :class:`SavedTensors` keeps only weak references to its holders, so a holder (and its tensor)
  dies when autograd drops it (a fused backward frees each node's saved tensors as it runs), not
  when zbpipe gets round to :meth:`SavedTensors.release_all`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .. import _compat as C

_state = threading.local()  # which kind of node is unpacking right now (set by B's prehooks)

ACTIVATION = "activation"
KEEP = "keep"


class Observer(Protocol):
    """Told when a saved tensor's storage gains or loses a holder (for byte counting)."""

    def on_pack(self, storage: int, nbytes: int) -> None: ...
    def on_free(self, storage: int, nbytes: int) -> None: ...


class StorageRefs:
    """How many holders each storage has, for observers that count a storage's bytes once: from
    its first holder (:meth:`add` returns True) to its last (:meth:`remove` returns True)."""

    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n: dict[int, int] = {}

    def add(self, storage: int) -> bool:
        n = self._n.get(storage, 0)
        self._n[storage] = n + 1
        return n == 0

    def remove(self, storage: int) -> bool:
        """False for a storage with no holder (already gone, or never counted)."""
        n = self._n.get(storage, 0)
        if n > 1:
            self._n[storage] = n - 1
        elif n == 1:
            del self._n[storage]
        return n == 1


class Holder:
    """One tensor held for backward, told to ``observer`` until released or collected.

    ``hold=True`` (a saved tensor): keeps a detached alias of it for the unpack; ``release()``
    drops it and a later unpack raises a clear error. ``hold=False``: only counts a tensor
    someone else holds (the deferred engine's queue, the graph engine's recorded gradients)
    until ``release()`` or until the holder itself is collected.
    """

    __slots__ = ("tensor", "nbytes", "storage", "unpacked_as", "_finalizer", "__weakref__")

    def __init__(
        self,
        tensor: torch.Tensor,
        observer: Observer | None,
        *,
        hold: bool = True,
        counted: tuple[int, int] | None = None,
    ) -> None:
        # The alias, not the tensor: see the module docstring (no cycle through the graph).
        self.tensor: torch.Tensor | None = tensor.detach() if hold else None
        #: (key, bytes) the observer is told: the tensor's storage, unless ``counted`` says
        self.storage, self.nbytes = counted or storage_and_bytes(tensor)
        self.unpacked_as: str | None = None
        self._finalizer = None
        if observer is not None:
            observer.on_pack(self.storage, self.nbytes)
            # The graph may die before anyone calls release() (a fused backward frees as it goes).
            self._finalizer = weakref.finalize(self, observer.on_free, self.storage, self.nbytes)

    def release(self) -> None:
        self.tensor = None
        if self._finalizer is not None:
            self._finalizer()  # tell the observer now, and only once


def count_until_freed(t: torch.Tensor, observer: Observer) -> None:
    """Tell ``observer`` about ``t``'s storage now and again when that storage is freed.

    For tensors zbpipe hands to someone else, a pending send: torch's runtime keeps each send's
    work, and with it the tensor (for an activation, a detached alias of it), until the end of
    the step. The storage, not the tensor object, is what the alias shares; torch keeps a
    storage's Python object alive as long as the storage, so its finalizer fires when the memory
    goes. A storage that outlives the send (an input passed through unchanged) counts as long.
    """
    try:
        storage = _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if ptr:
        observer.on_pack(ptr, nbytes)
        weakref.finalize(storage, observer.on_free, ptr, nbytes)


def count_all_until_freed(values: Any, observer: Observer) -> None:
    """:func:`count_until_freed` for ``values``: a tensor, or a tuple or list whose tensors count
    (anything else in it is skipped)."""
    for t in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(t, torch.Tensor):
            count_until_freed(t, observer)


def slice_counted(t: torch.Tensor, given: list[tuple[int, int]]) -> tuple[int, int] | None:
    """``(key, bytes)`` to count ``t`` by when it lies in one of the caller's slices ``given``
    (``(start address, bytes)`` of each, on ``t``'s storage): that slice's, whatever part of it
    ``t`` views, so every tensor saved from one slice counts under one key with one size (a
    storage's data pointer is never a key here: the key is negative). None: in none of them."""
    try:
        ptr = _local(t).data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    for start, nbytes in given:
        if start <= ptr < start + nbytes:
            return ~start, nbytes
    return None


def storage_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    """``(data pointer, bytes)`` of ``t``'s storage (a DTensor's: its local shard's); ``(0, 0)``
    for a tensor subclass without one (an observer does not count it)."""
    try:
        storage = _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0, 0
    return storage.data_ptr(), storage.nbytes()


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


def input_storages(values: Any) -> dict[int, list[tuple[int, int]]]:
    """The tensors in ``values`` (tuples, lists and dicts walked) by storage pointer, as
    ``(start address, bytes)``: the first stage's microbatch inputs and the last stage's
    targets, slices of the caller's batches. Counting a saved view's storage would charge every
    microbatch the whole batch; it counts as its slice instead (:func:`slice_counted`), as a
    received input counts on a later stage (:class:`SavedTensors`)."""
    found: dict[int, list[tuple[int, int]]] = {}
    _walk_given(values, found)
    return found


def _walk_given(values: Any, found: dict[int, list[tuple[int, int]]]) -> None:
    if isinstance(values, torch.Tensor):
        ptr = storage_ptr(values)
        if ptr is not None:
            local = _local(values)
            found.setdefault(ptr, []).append(
                (local.data_ptr(), local.numel() * local.element_size())
            )
        return
    items = values.values() if isinstance(values, dict) else values
    if isinstance(items, (tuple, list, type({}.values()))):
        for v in items:
            _walk_given(v, found)


class SliceCounting:
    """An observer that counts a storage of the caller's batch as this microbatch's slice of it.

    The first stage's input (the last stage's target) is a slice of a batch the caller holds
    for the whole step. :class:`SavedTensors` counts a saved view of it as the slice; anything
    else that reports such a view by its storage (the deferred engine's queue keeps the first
    Linear's input until W) would charge the microbatch the whole batch, and under a key the
    saved view does not share, twice. Wrapped in this, every report on a ``given`` storage
    comes out as the slice's key and bytes (:func:`slice_counted`'s), so it counts once.
    """

    __slots__ = ("_parent", "_slices")

    def __init__(self, parent: Observer, given: dict[int, list[tuple[int, int]]]) -> None:
        self._parent = parent
        self._slices = {ptr: (~slices[0][0], slices[0][1]) for ptr, slices in given.items()}

    def on_pack(self, storage: int, nbytes: int) -> None:
        self._parent.on_pack(*self._slices.get(storage, (storage, nbytes)))

    def on_free(self, storage: int, nbytes: int) -> None:
        self._parent.on_free(*self._slices.get(storage, (storage, nbytes)))


class SavedTensors:
    """The saved tensors of one (stage, microbatch) forward."""

    def __init__(
        self,
        observer: Observer | None = None,
        skip: set[int] | None = None,
        given: dict[int, list[tuple[int, int]]] | None = None,
    ) -> None:
        # Weak: autograd owns the holders (the graph's saved-tensor slots); this only finds them.
        self._holders: list[weakref.ref[Holder]] = []
        self.observer = observer
        """Told about every tensor held for this microbatch's backward (B adds its own)."""
        self._skip = skip or set()  # storages never worth holding (the stage's parameters)
        #: the caller's slices by storage (:func:`input_storages`): saved views count as those
        self._given = given or {}

    @property
    def holders(self) -> list[Holder]:
        """The holders the graph still has (a freed node's are gone)."""
        return [h for ref in self._holders if (h := ref()) is not None]

    def hooks(self) -> AbstractContextManager[Any]:
        """Around the forward: autograd's saved-tensor hooks into this object's holders and,
        with an observer, what selective activation checkpointing caches (its policy's saved
        outputs bypass saved-tensor hooks: :func:`zbpipe._compat.selective_checkpoint_cached`)
        told to the observer until the storage is freed (the backward's recompute takes it
        from the cache; W may hold it after)."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        observer = self.observer
        if observer is None:
            return hooks
        return _together(
            hooks, C.selective_checkpoint_cached(lambda t: count_until_freed(t, observer))
        )

    def _pack(self, t: torch.Tensor) -> Any:
        ptr = storage_ptr(t)
        if ptr in self._skip:
            return t  # a parameter (or a view of one): releasing it would free nothing
        given = None if ptr is None else self._given.get(ptr)
        h = Holder(t, self.observer, counted=None if given is None else slice_counted(t, given))
        self._holders.append(weakref.ref(h))
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
        self._holders.clear()


@contextlib.contextmanager
def _together(*scopes: AbstractContextManager[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(scope)
        yield


def _unpack(packed: Any) -> torch.Tensor:
    seen = getattr(_state, "recompute", None)
    if seen is not None and (region := C.checkpoint_frame(sys._getframe(1))) is not None:
        seen(region)  # a checkpointed region recomputes now: see watch_recomputes
    if not isinstance(packed, Holder):
        return packed
    if packed.tensor is None:
        raise RuntimeError(
            "zbpipe: autograd asked for a saved tensor that was already released after the "
            "input-gradient pass B (or after W). This is a zbpipe bug unless you ran a second "
            "backward through a pipeline stage's graph; please report it with the stage's model"
        )
    kind = getattr(_state, "kind", None)
    if kind is not None and packed.unpacked_as != KEEP:
        if kind == ACTIVATION and C.asked_by_checkpoint(sys._getframe(1)):
            # A checkpointed region's input, unpacked by its recompute, not by the node B is
            # running: W's own backward call recomputes the region again and needs it.
            kind = KEEP
        packed.unpacked_as = kind
    return packed.tensor


def mark_unpacking(kind: str | None) -> None:
    """Tag unpacks that follow as ``ACTIVATION`` or ``KEEP`` (B's prehooks call this per node)."""
    _state.kind = kind


@contextlib.contextmanager
def watch_recomputes(seen: Any) -> Iterator[None]:
    """While open (on this thread), ``seen(region)`` for each non-reentrant checkpointed region
    that starts a recompute by asking for its inputs, which this microbatch's holders keep
    (``zbpipe._compat.checkpoint_frame``; once per input: ``seen`` dedups). The graph engine's
    B records those recomputes for W to replay (:mod:`zbpipe.engines.graph_recompute`)."""
    previous = getattr(_state, "recompute", None)
    _state.recompute = seen
    try:
        yield
    finally:
        _state.recompute = previous
