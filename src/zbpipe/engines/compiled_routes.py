"""Where a compiled Linear's deferred weight GEMM goes: the routes of zbpipe's compiled split.

The op of :mod:`zbpipe.engines.compiled_linear` receives tensors, not modules, and is
process-wide, so it finds a weight's stage through a process-wide table keyed weakly by
parameter (:func:`route_of`). This module holds that table and every way a weight reaches the
op that is not the routed parameter itself:

* an alias made by saved-tensor hooks (the memory probe and meter, ``save_on_cpu``): found by
  its address and checked to share the parameter's ``AccumulateGrad`` node (:func:`_same_leaf`),
  among every routed tensor on that memory;
* a DTensor parameter's local shard (AOTAutograd flattens the subclass): found by identity;
* a stand-in: another Parameter put on a routed Linear later (FSDP2's unsharded one), routed
  when first met, one per Linear (:data:`_STAND_INS`);
* a weight version's leaf (the continuous stale modes): routed by :func:`route_leaves` when
  its leaf set is made.

Each route's ``AccumulateGrad`` pre-hook holds the route that made its placeholders
(:func:`_new_route`), so a placeholder in flight is dropped even if the route was replaced.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import _compat as C

__all__ = ["LinearRoute", "route_and_weight", "route_leaves", "route_of", "route_parameter"]


class LinearRoute:
    """Where the weight GEMM of one compiled Linear's weight goes at run time.

    ``module``: the patched Linear (weakly), whose ``_zbpipe_slot`` names the store of a B in
    progress (a second schedule on the same modules re-points it). ``placeholder``: what the op
    returned in place of the gradient, until the weight's ``AccumulateGrad`` pre-hook sees it
    (during that B: one left by a B that raised is not taken for the next backward's).
    ``alone``: None until a placeholder reached the hook; then whether it arrived untouched
    (True: later placeholders need no zeros).
    """

    __slots__ = ("alone", "module", "placeholder", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        #: (the placeholder, the store whose B made it)
        self.placeholder: tuple[Tensor, Any] | None = None
        self.alone: bool | None = None

    def store(self) -> Any:
        """The deferring store of the B in progress on this Linear's stage, else None."""
        module = self.module()
        slot = None if module is None else module.__dict__.get("_zbpipe_slot")
        store = None if slot is None else slot.store
        return store if store is not None and store.deferring else None

    def make_placeholder(self, weight: Tensor, store: Any) -> Tensor:
        holder = torch.empty_like(weight) if self.alone else torch.zeros_like(weight)
        self.placeholder = (holder, store)
        return holder

    def on_accumulate(self, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...] | None:
        """The ``AccumulateGrad`` pre-hook: drop an untouched placeholder (W adds the gradient)."""
        made, self.placeholder = self.placeholder, None
        if made is None or not made[1].deferring:
            return None  # an ordinary gradient (or a placeholder left by a B that failed)
        holder, got = made[0], grads[0]
        if got is not None and C.is_dtensor(got):  # a DTensor weight's: the local shard's
            got = C.local_tensor(got)
        if got is holder:
            self.alone = True
            return (None,)
        if self.alone:
            raise RuntimeError(
                "zbpipe: a compiled Linear's deferred weight gradient was summed with another "
                "gradient in a compiled graph that did not do so before (was the block "
                "recompiled with the weight used elsewhere?); build the schedule again"
            )
        # Zeros summed with what else reached the weight: correct as it stands. Keep zeros.
        self.alone = False
        return None


_ROUTES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> LinearRoute
# A DTensor parameter reaches compiled code as its local shard (AOTAutograd flattens it), so the
# op receives that plain tensor: local shard -> weak reference to the DTensor parameter. Found by
# identity only: the shard needs no gradient, so autograd hands a compiled backward the saved
# shard itself, saved-tensor hooks or not; another tensor on its memory is another leaf's (a
# weight version's, ``param.detach().requires_grad_()``), and its gradient is computed in B.
_PARAM_OF_LOCAL: WeakIdKeyDictionary = WeakIdKeyDictionary()


def route_of(weight: Tensor) -> LinearRoute | None:
    """The route of a compiled Linear's ``weight`` (None: not routed, its GEMM runs in B)."""
    route: LinearRoute | None = _ROUTES.get(weight)  # type: ignore[no-untyped-call]
    return route


# Saved-tensor hooks around a compiled region's forward (zbpipe's memory probe and meter,
# torch's save_on_cpu) make autograd hand the compiled backward a new tensor object for each
# saved weight: it shares the parameter's memory but is not the parameter, so the lookup by
# identity misses (and W must add into the parameter's .grad, not the alias's). Such an alias is
# found by its address: (data pointer, shape) -> the routed parameter, rebuilt when a lookup
# misses (parameters swapped or moved since), not again for an address known to be unrouted
# until routes change; and it must share the parameter's AccumulateGrad node (_same_leaf).
Address = tuple[int, tuple[int, ...]]
_BY_ADDRESS: dict[Address, weakref.ref[Tensor]] = {}
_UNROUTED: set[Address] = set()


def _address(t: Tensor) -> Address:
    return t.data_ptr(), tuple(t.shape)


def route_and_weight(weight: Tensor) -> tuple[LinearRoute | None, Tensor]:
    """The route of ``weight`` and the routed parameter itself (``weight``, or the parameter an
    alias made by saved-tensor hooks shares its memory with); ``(None, weight)`` if unrouted."""
    route = route_of(weight)
    if route is not None:
        return route, weight
    if isinstance(weight, nn.Parameter):
        return _route_current_weight(weight), weight
    ref = _PARAM_OF_LOCAL.get(weight)  # type: ignore[no-untyped-call]
    if ref is not None and (param := ref()) is not None:  # a DTensor parameter's local shard
        return route_of(param), param
    if not weight.requires_grad:  # a DTensor's local shard, else no alias of a routed leaf
        if (param := _current_dtensor_of(weight)) is not None:  # FSDP2's unsharded, over TP
            return _route_current_weight(param), param
        return None, weight
    key = _address(weight)
    if key in _UNROUTED:
        return None, weight
    for rebuilt in (False, True):
        ref = _BY_ADDRESS.get(key)
        param = None if ref is None else ref()
        if param is not None and _address(param) == key:
            route = route_of(param) or _route_current_weight(param)
            if route is None:
                break
            # a routed parameter's memory: its alias, or another leaf's on the same memory
            if _same_leaf(weight, param):
                return route, param
            return _route_of_alias_among_others(weight, key)
        if not rebuilt:
            _BY_ADDRESS.clear()
            routes = list(_ROUTES.items())  # type: ignore[no-untyped-call]
            for p, _ in routes:  # DTensors: by identity (above)
                if not C.is_dtensor(p):
                    _BY_ADDRESS[_address(p)] = weakref.ref(p)
            for _, r in routes:  # the Linear's weight now (FSDP2's unsharded one), if not routed
                module = r.module()
                now = None if module is None else C.own_parameter(module, "weight")
                if isinstance(now, nn.Parameter) and not C.is_dtensor(now):
                    _BY_ADDRESS.setdefault(_address(now), weakref.ref(now))
    _UNROUTED.add(key)
    return None, weight


def _route_of_alias_among_others(alias: Tensor, key: Address) -> tuple[LinearRoute | None, Tensor]:
    """The route of the tensor ``alias`` is an alias of, among every routed one on its memory
    ``key`` (several leaves can share it: a weight version's leaf sets of two mini-batches, or
    stash's leaves on the master), which the address table then names; unrouted if none."""
    for routed in list(_ROUTES.keys()):  # type: ignore[no-untyped-call]
        if _address(routed) == key and _same_leaf(alias, routed):
            _BY_ADDRESS[key] = weakref.ref(routed)
            return route_of(routed), routed
    return None, alias


#: Parameters found to be no routed Linear's current weight, until routes change
_NOT_CURRENT: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: Linear -> (the parameter routed in its routed weight's stead, that parameter's AccumulateGrad
#: node with the pre-hook): one stand-in per Linear. The node is kept here, keyed weakly by the
#: module (the node holds the parameter, not the module): in the stand-in's own route it would
#: keep its key in the weak table alive forever, and in the routed parameter's route it died
#: with that route when a second schedule routed the Linear again, while the stand-in's route
#: lived on and its placeholders reached ``.grad`` unhooked.
_STAND_INS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[Tensor], Any]] = (
    weakref.WeakKeyDictionary()
)


def _drop_stand_in(module: nn.Module) -> None:
    """Forget ``module``'s stand-in parameter (routed again, with a fresh hook, when next met)."""
    held = _STAND_INS.pop(module, None)
    stand_in = None if held is None else held[0]()
    if stand_in is not None:
        _ROUTES.pop(stand_in, None)  # type: ignore[no-untyped-call]


def _route_current_weight(weight: Tensor) -> LinearRoute | None:
    """The route for ``weight`` if it is a routed Linear's weight *now*, though another parameter
    was routed: FSDP2 registers on the module the sharded DTensor parameter (the one routing
    saw, at a stage's first step) between its forward and backward, and its unsharded plain
    parameter around them (the object compiled code saves and hands the op; FSDP2 keeps it
    across reshards; a DTensor over tensor parallelism, :func:`_current_dtensor_of`). The
    weight gets a route of its own, its ``AccumulateGrad`` node the
    pre-hook (registered here, during the backward, before autograd reaches that node): the
    store is handed ``weight``, and W adds into its ``.grad``, which FSDP2 reduces into the
    sharded parameter's after the last W, as for an eager Linear. One scan of the routes per
    parameter: a parameter that is no routed Linear's weight is remembered as such. (An alias
    of it made by saved-tensor hooks is found by its address, :func:`route_and_weight`.)"""
    if weight in _NOT_CURRENT or not isinstance(weight, nn.Parameter):
        return None  # (a weight version's leaf is routed by route_leaves, or not at all)
    for routed, route in list(_ROUTES.items()):  # type: ignore[no-untyped-call]
        module = route.module()
        if module is None or routed is weight or C.own_parameter(module, "weight") is not weight:
            continue
        _drop_stand_in(module)
        new, node = _new_route(weight, module)
        _UNROUTED.clear()
        _STAND_INS[module] = (weakref.ref(weight), node)
        return new
    _NOT_CURRENT[weight] = True
    return None


def _current_dtensor_of(local: Tensor) -> Tensor | None:
    """The DTensor parameter that a routed Linear holds now and whose local shard is ``local``
    (FSDP2's unsharded parameter over tensor parallelism is a DTensor: its local shard is what
    compiled code hands the op), else None. A DTensor parameter's shard needs no gradient, and
    neither does anything else the op could get as a weight but a frozen one (whose gradient
    nothing asks for): only such tensors are looked up, each scan remembered as for
    :func:`_route_current_weight`."""
    if local in _NOT_CURRENT:
        return None
    for route in list(_ROUTES.values()):  # type: ignore[no-untyped-call]
        module = route.module()
        now: Tensor | None = None if module is None else C.own_parameter(module, "weight")
        if now is not None and C.is_dtensor(now) and C.local_tensor(now) is local:
            _PARAM_OF_LOCAL[local] = weakref.ref(now)
            return now
    _NOT_CURRENT[local] = True
    return None


def _same_leaf(alias: Tensor, param: Tensor) -> bool:
    """Whether ``alias`` is autograd's unpacked copy of the saved ``param``: it keeps the
    parameter's ``AccumulateGrad`` node, where a tensor that merely shares the memory (a weight
    version's leaf, ``param.detach().requires_grad_()``) has its own and its own ``.grad``."""
    if not alias.requires_grad:
        return False
    with torch.enable_grad():
        return bool(C.grad_accumulator(alias) is C.grad_accumulator(param))


def route_parameter(lin: nn.Module, weight: Tensor) -> Any:
    """Route ``weight``, the patched Linear ``lin``'s, to its stage's store; returns its
    ``AccumulateGrad`` node, which carries the pre-hook (the caller keeps it alive: autograd
    holds a leaf's node weakly and would make a new one, without hooks)."""
    # A fresh route: whether placeholders arrive alone is learnt again (one zeros placeholder).
    # A second schedule on the same modules adds a second hook: harmless, each hook drops only
    # the placeholders of its own route and lets anything else through.
    _, node = _new_route(weight, lin)
    _drop_stand_in(lin)
    _UNROUTED.clear()
    _NOT_CURRENT.clear()
    if C.is_dtensor(weight):
        _PARAM_OF_LOCAL[C.local_tensor(weight)] = weakref.ref(weight)
    return node


def route_leaves(params: list[Tensor], leaves: list[Tensor]) -> list[Any]:
    """Route each of ``leaves`` as its parameter in ``params`` (aligned) is routed: leaf aliases
    a continuous stale mode puts in a module's parameter slots (its weight versions,
    zbpipe.continuous.versions). A compiled Linear then queues the GEMM for W, which adds it into
    the leaf's ``.grad``, as with the parameter itself.

    Returns the leaves' ``AccumulateGrad`` nodes, which carry the pre-hooks: the caller keeps
    them while it keeps the leaves (:func:`route_compiled_linears` says why).
    """
    nodes = []
    for param, leaf in zip(params, leaves, strict=True):
        route = route_of(param)
        module = None if route is None else route.module()
        if module is None or not leaf.requires_grad:
            continue
        leaf_route, node = _new_route(leaf, module)
        # the same compiled graph: whether its placeholders arrive alone is known already (no
        # zeros placeholder per leaf set once it is)
        leaf_route.alone = route.alone  # type: ignore[union-attr]
        nodes.append(node)
    if nodes:
        _UNROUTED.clear()  # a recycled version buffer's address may have been seen unrouted
    return nodes


def _new_route(weight: Tensor, module: nn.Module) -> tuple[LinearRoute, Any]:
    """A route for ``weight`` (``module``'s Linear's) in the table, and its ``AccumulateGrad``
    node with the route's pre-hook. The hook is the route's own bound method: it drops only the
    placeholders that route made, even after the weight's route is replaced (a second schedule,
    a stand-in dropped), and lets anything else through to the node's next hook."""
    route = _ROUTES[weight] = LinearRoute(module)
    with torch.enable_grad():  # (a stand-in is met during a backward)
        node = C.grad_accumulator(weight)
    node.register_prehook(route.on_accumulate)
    return route, node
