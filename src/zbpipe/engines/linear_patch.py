"""The deferred engine's Linears: ``nn.Linear`` modules whose weight GEMM can wait for W.

A Linear is patched by swapping its class for a subclass whose ``forward`` reads a
:class:`StoreSlot` shared by the stage. The runtime fills the slot only around a zbpipe F or B
of a microbatch whose backward runs through the deferred engine; everywhere else (a plain
``loss.backward()``, ``eval()``, torch's own schedules, a stage's first fused BW) the slot is
empty and the module is an ordinary Linear. Patching the module, not every op, keeps the cost
to one Python check per Linear call.

During B, a patched Linear computes its input gradient (and its bias gradient, a cheap sum) and
queues ``(weight, input, grad_output)`` in the slot's
:class:`~zbpipe.engines.deferred.WeightGradStore` instead of the weight gradient; W runs the GEMM.
How it captures them (a hook on its output's gradient, or an ``autograd.Function``) is
:mod:`zbpipe.engines.weight_capture`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import (
    is_compiled,
    is_plain_or_dtensor,
    own_parameter,
    post_accumulate_grad_hooks,
)
from .compiled_linear import compiled_linear
from .weight_capture import WeightGradQueue, deferred_linear

logger = logging.getLogger(__name__)

__all__ = [
    "DeferredLinear",
    "SlotHolding",
    "StoreSlot",
    "patch_linears",
    "patched_linears",
    "post_accumulate_hooks_parked",
    "unpatch_linears",
    "weight_census",
]


class StoreSlot:
    """Which weight-gradient store (:class:`WeightGradQueue`) a stage's patched Linears use right
    now (None: none)."""

    __slots__ = ("store",)

    def __init__(self) -> None:
        self.store: WeightGradQueue | None = None


class SlotHolding:
    """``with``: the stage's slot holds ``store``; empty again afterwards, whatever happened.

    A plain object, not a generator: it runs around every F and B of a deferred key.
    """

    __slots__ = ("_slot", "_store")

    def __init__(self, slot: StoreSlot, store: WeightGradQueue) -> None:
        self._slot, self._store = slot, store

    def __enter__(self) -> None:
        self._slot.store = self._store

    def __exit__(self, *exc: object) -> None:
        self._slot.store = None


class DeferredLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient W can compute later (see the module docstring).

    Made by :func:`patch_linears` (which swaps the class of existing modules; parameters,
    hooks and state dict are untouched); identical to ``nn.Linear`` while its slot is empty.
    """

    _zbpipe_slot: StoreSlot

    def forward(self, input: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            # Traced once for every microbatch and outside zbpipe alike: the weight GEMM's
            # routing is decided at run time by an opaque op (zbpipe.engines.compiled_linear).
            # A DTensor weight (tensor parallelism's) too: the op has a sharding rule; other
            # tensor subclasses compute their weight gradient in B.
            if self.weight.is_complex() or not is_plain_or_dtensor(self.weight):
                return F.linear(input, self.weight, self.bias)
            return compiled_linear(input, self.weight, self.bias)
        store = self._zbpipe_slot.store
        weight = self.weight  # once: a module attribute lookup costs as much as a check
        # Complex weights: autograd's gradients take conjugates, which this engine's GEMMs do not.
        if store is None or weight.is_complex():
            return F.linear(input, weight, self.bias)
        return deferred_linear(input, weight, self.bias, store)


@functools.cache
def _deferred_class(cls: type) -> type:
    """``DeferredLinear`` for ``nn.Linear``; for another subclass that keeps Linear's forward
    (FSDP2's ``FSDPLinear``, say), a subclass of it with the deferred forward."""
    if cls is nn.Linear:
        return DeferredLinear
    return type(f"Deferred{cls.__name__}", (cls,), {"forward": DeferredLinear.forward})


def _patchable(module: nn.Module) -> bool:
    if "_zbpipe_unpatched" in module.__dict__:  # patched already
        return True
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _linears(module: nn.Module) -> list[nn.Module]:
    """Patchable Linears of ``module``, inside compiled subtrees too: there they run
    :class:`~zbpipe.engines.compiled_linear.CompiledLinear`, whose weight GEMM the deferred
    engine routes to W (:func:`~zbpipe.engines.compiled_linear.route_compiled_linears`).
    """
    if _patchable(module):
        return [module]
    return [lin for child in module.children() for lin in _linears(child)]


def patch_linears(module: nn.Module, slot: StoreSlot) -> int:
    """Make every patchable Linear under ``module`` a deferred one reading ``slot``.

    Patches ``nn.Linear`` and subclasses that keep its ``forward``, compiled ones included (a
    block compiled before has its forward traced again at its next call: one compile).
    Patching again (a second schedule on the same modules) points the Linears at the new slot.
    Returns the number of Linears patched.
    """
    found = _linears(module)
    for lin in found:
        if "_zbpipe_unpatched" not in lin.__dict__:
            cls: type = type(lin)
            lin._zbpipe_unpatched = cls  # type: ignore[assignment]
            lin.__class__ = _deferred_class(cls)
            if "forward" in lin.__dict__:
                rebind_instance_forward(lin)
        lin._zbpipe_slot = slot  # type: ignore[assignment]
    return len(found)


def rebind_instance_forward(lin: nn.Module) -> None:
    """Make a Linear's instance-level ``forward`` run the deferred one.

    An instance attribute hides the class's ``forward``, so the class swap alone changes
    nothing: torchtitan's ``Module.parallelize()`` stores such a closure, which redistributes
    the inputs, calls the Linear's bound ``forward`` it captured (or a ``local_map`` partial
    holding it), and redistributes the outputs. The closures reachable from it (their cells,
    ``__wrapped__``, a partial's function) are searched for that bound ``nn.Linear.forward`` of
    this Linear, in a cell or in a partial's arguments, and each is pointed at the deferred
    ``forward`` (:func:`unpatch_linears` puts the old contents back; they are kept outside the
    module, which stays copyable). Where none is found the Linear computes its weight gradient
    in B, correctly but without the split: logged once per class.
    """
    deferred = types.MethodType(type(lin).forward, lin)
    changed = []
    for cell, old in _cells_reaching_bound_forward(lin.__dict__["forward"], lin):
        if isinstance(old, functools.partial):
            args = tuple(deferred if _is_bound_forward(a, lin) else a for a in old.args)
            cell.cell_contents = functools.partial(old.func, *args, **old.keywords)
        else:
            cell.cell_contents = deferred
        changed.append((cell, old))
    if changed:
        _REBOUND[lin] = changed
        return
    name = type(lin).__mro__[1].__name__
    if name not in _WARNED:
        _WARNED.add(name)
        logger.warning(
            "zbpipe: a %s has an instance-level forward that does not reach nn.Linear.forward "
            "through a bound method zbpipe can see; its weight gradient is computed in B "
            "(correct, but W has nothing of it to fill the bubble with)",
            name,
        )


#: Linear -> [(closure cell, what it held before rebind_instance_forward)]
_REBOUND: weakref.WeakKeyDictionary[nn.Module, list[tuple[Any, Any]]] = weakref.WeakKeyDictionary()
_WARNED: set[str] = set()


def _is_bound_forward(obj: Any, lin: nn.Module) -> bool:
    return (
        isinstance(obj, types.MethodType)
        and obj.__self__ is lin
        and obj.__func__ is nn.Linear.forward
    )


def _cells_reaching_bound_forward(fn: Any, lin: nn.Module, depth: int = 4) -> list[Any]:
    """``(cell, contents)`` of the closure cells under ``fn`` holding ``lin``'s bound
    ``nn.Linear.forward``, or a partial with it among its arguments."""
    found, seen, todo = [], set(), [(fn, 0)]
    while todo:
        f, level = todo.pop()
        if id(f) in seen or level > depth:
            continue
        seen.add(id(f))
        inner = [getattr(f, "__wrapped__", None), getattr(f, "func", None)]
        todo += [(g, level + 1) for g in inner if g is not None]
        for cell in getattr(f, "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _is_bound_forward(held, lin) or (
                isinstance(held, functools.partial)
                and any(_is_bound_forward(a, lin) for a in held.args)
            ):
                found.append((cell, held))
            elif isinstance(held, types.FunctionType | functools.partial):
                todo.append((held, level + 1))
    return found


def patched_linears(module: nn.Module) -> list[nn.Module]:
    """The Linears under ``module`` that :func:`patch_linears` patched."""
    return [sub for sub in module.modules() if "_zbpipe_unpatched" in sub.__dict__]


@contextlib.contextmanager
def post_accumulate_hooks_parked(linears: Sequence[nn.Module]) -> Iterator[frozenset[int]]:
    """Around B: hold back the ``register_post_accumulate_grad_hook`` hooks of ``linears``' weights.

    Autograd runs a leaf's ``AccumulateGrad``, and with it the leaf's post-accumulate hooks, even
    when the gradient reaching it is None, which is what B hands a weight whose GEMM it queued:
    the hooks would fire in B on a ``.grad`` W has not written yet, then again in W. Parked, they
    fire once, in W, after the accumulation (a weight that also gets a part of its gradient in
    B, tied to an embedding say, fires in W too: after its last accumulation). Yields the ids
    of the weights whose hooks it parked (a store must queue those: see ``immediate``).
    """
    parked: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    ids = set()
    for lin in linears:
        weight = own_parameter(lin, "weight")  # None under a parametrization: not deferred
        hooks = post_accumulate_grad_hooks(weight)
        if hooks:  # the dict autograd's C++ hook reads at call time: emptied in place
            parked.append((hooks, dict(hooks)))
            ids.add(id(weight))
            hooks.clear()
    try:
        yield frozenset(ids)
    finally:
        for hooks, saved in parked:
            hooks.update(saved)


def unpatch_linears(module: nn.Module) -> int:
    """Give every Linear :func:`patch_linears` patched under ``module`` its class back."""
    n = 0
    for sub in module.modules():
        original = sub.__dict__.pop("_zbpipe_unpatched", None)
        if original is not None:
            sub.__class__ = original
            for cell, held in _REBOUND.pop(sub, ()):
                cell.cell_contents = held
            sub.__dict__.pop("_zbpipe_slot", None)
            n += 1
    return n


def weight_census(module: nn.Module) -> tuple[int, int]:
    """(elements of patchable Linear weights, elements of other matrix-like weights).

    "Other" counts parameters with two or more dimensions outside patchable Linears and outside
    ``nn.Embedding`` (an embedding's gradient is a scatter of rows, not a GEMM): the weight
    work the deferred engine leaves in B. ``split="auto"`` compares the two.
    """
    in_linears = {id(p) for lin in _linears(module) for p in lin.parameters()}
    # The graph engine refuses compiled regions and the deferred one defers their Linears: a
    # compiled region's other weights count as neither kind, so they do not push auto towards
    # the engine that refuses them.
    compiled = {
        id(p)
        for m in module.modules()
        if is_compiled(m)
        for p in m.parameters()
        if id(p) not in in_linears
    }
    in_embeddings = {
        id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    linear = other = 0
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if id(p) in compiled:
            continue
        if id(p) in in_linears:
            linear += p.numel() if p.dim() >= 2 else 0
        elif p.dim() >= 2 and id(p) not in in_embeddings:
            other += p.numel()
    return linear, other
