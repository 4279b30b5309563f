"""The mode an expert module's ``forward`` runs in: the GEMMs on its 3-D weights, deferred.

A module that owns 3-D parameters (and whose children own none: :func:`batched_modules`) is
patched by :mod:`zbpipe.engines.expert_patch` to run its own ``forward``, whatever it is,
inside :class:`_ExpertMatmuls`, a ``TorchFunctionMode`` scoped to that one call. The mode
records every tensor derived from one of those parameters through casts, transposes and
integer selects (a :class:`~zbpipe.engines.derived_ops.Derivation`; for a DTensor parameter,
starting at the alias its ``to_local()`` returns, eager) and replaces each ``torch._grouped_mm``,
``F.linear`` (no bias), bmm, 3-D matmul or two-operand einsum whose weight operand is such a
tensor by a GEMM whose weight gradient waits for W (:mod:`zbpipe.engines.derived_ops` eager,
:mod:`zbpipe.engines.compiled_derived` inside ``torch.compile``). Every other call passes
through unchanged: a parameter used another way (a broadcast, a three-operand einsum, through
``full_tensor()``) gets its gradient in B, as autograd computes it.

Eager, the mode is entered only during a zbpipe F or B (outside, the module runs untouched);
under ``torch.compile`` dynamo traces through it (``fullgraph=True`` holds), so compiled code
has one graph for zbpipe and everyone else, its weight gradients opaque ops routed at run time.
Scoping the mode to modules without parameter-holding children keeps every other op of the
stage out of Python.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .. import _compat as C
from .compiled_derived import compiled_gemm, gate
from .derived_ops import Derivation, derived_gemm, split_equation

#: the grouped GEMM as the mode sees it; dynamo hands it to the mode inside compiled code too
_GROUPED_MM = C.grouped_mm_function()
C.route_through_function_modes(_GROUPED_MM)

__all__ = ["batched_modules", "batched_weights", "deferred_matmuls"]

_MATMULS = frozenset((torch.bmm, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.bmm))
_BMM = "bij,bjk->bik"


def batched_weights(module: nn.Module) -> list[str]:
    """Names of ``module``'s own parameters that are 3-D or more (the experts' weights)."""
    return [
        name
        for name, p in C.own_parameters(module).items()
        if p is not None and p.dim() >= 3 and p.requires_grad
    ]


def batched_modules(module: nn.Module) -> list[nn.Module]:
    """Modules under ``module`` that own a 3-D parameter, come from outside ``torch.nn`` (a
    convolution's weight is 3-D too) and whose children own no parameters."""
    found = []
    for m in module.modules():
        if type(m).__module__.startswith("torch.nn") or not batched_weights(m):
            continue
        if any(True for child in m.children() for _ in child.parameters()):
            continue
        found.append(m)
    return found


_CASTS = {
    Tensor.bfloat16: "bfloat16",
    Tensor.half: "float16",
    Tensor.float: "float32",
    Tensor.double: "float64",
}
_TRANSPOSES = frozenset((Tensor.transpose, torch.transpose, Tensor.swapaxes, torch.swapaxes))
_SELECTS = frozenset((Tensor.select, torch.select))
_DERIVING = frozenset((*_CASTS, *_TRANSPOSES, *_SELECTS, Tensor.to, Tensor.t, Tensor.__getitem__))


def _index(i: Any, compiling: bool) -> int | None:
    if isinstance(i, int) and not isinstance(i, bool):
        return i
    if not compiling and isinstance(i, Tensor) and i.dim() == 0 and not i.is_floating_point():
        return int(i)  # a 0-d index tensor (an expert loop over torch.where's experts)
    return None


def _step(func: Any, args: tuple[Any, ...], kwargs: Any, src: Tensor, compiling: bool) -> Any:
    """The :data:`~zbpipe.engines.derived_ops.Step` this call takes from ``src``, or None."""
    n = src.dim()
    if func in _CASTS:
        return ("cast", _CASTS[func]) if len(args) == 1 and not kwargs else None
    if func is Tensor.to:
        dtype = args[1] if len(args) == 2 and not kwargs else (kwargs or {}).get("dtype")
        if len(args) + len(kwargs or {}) != 2 or not isinstance(dtype, torch.dtype):
            return None
        return ("cast", str(dtype).removeprefix("torch.")) if dtype.is_floating_point else None
    if kwargs:
        return None
    if func in _TRANSPOSES and len(args) == 3:
        a, b = (d % n for d in args[1:])
        return ("t", min(a, b), max(a, b)) if a != b else None
    if func is Tensor.t and n == 2:
        return ("t", 0, 1)
    if func is Tensor.__getitem__ and len(args) == 2 and n >= 1:
        i = _index(args[1], compiling)
        return None if i is None else ("select", 0, i % src.shape[0])
    if func in _SELECTS and len(args) == 3 and isinstance(args[1], int):
        i = _index(args[2], compiling)
        return None if i is None else ("select", args[1] % n, i % src.shape[args[1] % n])
    return None


class _ExpertMatmuls(TorchFunctionMode):
    """Within one expert module's forward: the GEMMs on its 3-D weights, or on tensors derived
    from them, deferred (see the module docstring)."""

    def __init__(
        self,
        weights: dict[int, Tensor],
        shards: list[tuple[Tensor, Tensor]],
        store: Any,
        compiling: bool,
    ) -> None:
        super().__init__()
        self.weights, self.store, self.compiling = weights, store, compiling
        #: (local shard, DTensor parameter) of the weights that are DTensors
        self.shards = shards
        #: tensors derived from the weights in this call, with how (eager: by id; compiled:
        #: a list searched by identity, which dynamo traces)
        self.by_id: dict[int, tuple[Tensor, Derivation]] = {}
        self.derived: list[tuple[Tensor, Derivation]] = []
        #: compiled: (weight edge, its gate) of the weights GEMMs took slices of in this call
        self.gates: list[tuple[Tensor, Tensor]] = []

    def derivation(self, t: Any) -> Derivation | None:
        if not isinstance(t, Tensor):
            return None
        if not self.compiling:
            w = self.weights.get(id(t))
            if w is not None and w is t:
                return Derivation(w)
            found = self.by_id.get(id(t))
            return found[1] if found is not None and found[0] is t else None
        # compiled: identity only (an id() of an input would guard the graph on that object)
        for w in self.weights.values():
            if w is t:
                return Derivation(w)
        for local, w in self.shards:  # the shard itself: what compiled code has of a DTensor
            if local is t:
                return Derivation(w, (), local)
        for d, how in self.derived:
            if d is t:
                return how
        return None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is Tensor.view_as and len(args) == 2 and not kwargs:
            return self._alias(func, args)
        if func in _DERIVING:
            out = func(*args, **(kwargs or {}))
            how = self.derivation(args[0]) if args else None
            step = None if how is None else _step(func, args, kwargs, args[0], self.compiling)
            if how is not None and step is not None and isinstance(out, Tensor):
                if self.compiling:
                    self.derived.append((out, how.then(step)))
                else:
                    self.by_id[id(out)] = (out, how.then(step))
            return out
        found = self._gemm(func, args, kwargs or {})
        if found is not None:
            return found
        return func(*args, **(kwargs or {}))

    def _alias(self, func: Any, args: tuple[Any, ...]) -> Any:
        """``local.view_as(local)`` of a DTensor weight's shard: how ``DTensor.to_local()``
        makes the alias it returns (``_ToTorchTensor.forward``, in the torches zbpipe supports; the
        ``TorchFunctionMode`` sees that call, not ``to_local`` itself, a Python method of the
        subclass). The alias is the weight, its local shape: recorded as derived from it."""
        out = func(*args)
        for local, w in self.shards:
            if local is args[0] and isinstance(out, Tensor) and out.shape == local.shape:
                # eager: the alias, which autograd links to the DTensor; compiled: the shard
                how = Derivation(w, (), local if self.compiling else out)
                if self.compiling:
                    self.derived.append((out, how))
                else:
                    self.by_id[id(out)] = (out, how)
        return out

    def _gemm(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The deferred GEMM for this call if it multiplies a derived weight, else None."""
        if func is _GROUPED_MM:
            offs = kwargs.get("offs")
            extra = {k: v for k, v in kwargs.items() if k != "offs" and v is not None}
            if len(args) != 2 or offs is None or extra:
                return None
            x, w = args
            how = self.derivation(w)
            if how is None or w.dim() != 3 or x.dim() != 2:
                return None
            return self._deferred("grouped", x, w, how, offs)
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if len(args) < 2 or bias is not None or set(kwargs) - {"bias"}:
                return None
            how = self.derivation(args[1])
            if how is None or args[1].dim() != 2:
                return None
            return self._deferred("linear", args[0], args[1], how, None)
        if kwargs or not (func in _MATMULS or func is torch.einsum):
            return None
        match = self._match(func, args)
        if match is None:
            return None
        eq, x, w, how, first = match
        return self._deferred("einsum", x, w, how, None, eq, first)

    def _deferred(
        self,
        kind: str,
        x: Tensor,
        w: Tensor,
        how: Derivation,
        offs: Tensor | None,
        eq: str = "",
        first: bool = False,
    ) -> Tensor:
        if not self.compiling:
            return derived_gemm(kind, x, w, how, offs, self.store, eq, first)
        gated = None
        if how.steps and how.steps[0][0] == "select":  # one slice of several, maybe
            gated = next((g for src, g in self.gates if src is how.source), None)
            if gated is None:
                gated = gate(how.source)
                self.gates.append((how.source, gated))
        return compiled_gemm(kind, x, w, how, offs, gated, eq, first)

    def _match(self, func: Any, args: tuple[Any, ...]) -> Any:
        """``(equation, x, weight, derivation, weight_first)`` if this matmul, bmm or einsum
        multiplies a derived weight."""
        if func in _MATMULS:
            if len(args) != 2 or not all(isinstance(a, Tensor) and a.dim() == 3 for a in args):
                return None
            a, b = args
            if a.shape[0] != b.shape[0]:
                return None
            if (how := self.derivation(b)) is not None:
                return _BMM, a, b, how, False
            if (how := self.derivation(a)) is not None:
                return _BMM, b, a, how, True
            return None
        if args and isinstance(args[0], str):
            ops = args[1] if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
            if len(ops) != 2 or split_equation(args[0]) is None:
                return None
            a, b = ops
            if (how := self.derivation(b)) is not None:
                return args[0], a, b, how, False
            if (how := self.derivation(a)) is not None:
                return args[0], b, a, how, True
        return None


def deferred_matmuls(module: nn.Module, store: Any, compiling: bool) -> _ExpertMatmuls:
    """The mode for one call of ``module``'s forward."""
    weights = {
        id(p): p for name in batched_weights(module) if (p := getattr(module, name)) is not None
    }
    shards = [(C.local_tensor(p), p) for p in weights.values() if C.is_dtensor(p)]
    return _ExpertMatmuls(weights, shards, store, compiling)
