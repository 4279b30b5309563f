"""A stage's output shapes for inputs of given shapes, computed without data: torch's
``FakeTensorMode`` (private: ``torch._subclasses``). Used to size receive buffers per microbatch
when microbatches differ in shape (:mod:`zbpipe.schedules.varlen`).

The module's real parameters are read as constants of the fake computation (no copy); the
inputs are fake tensors of the given shapes. An operator whose output shape depends on the
values of its input (``.item()``, ``nonzero``) raises inside the mode: that stage's output shape
is not a function of its input's shape, and the caller says so.

Compiled code in the module runs eagerly here (``torch.compiler.set_stance("force_eager")``):
tracing it under a fake mode would compile graphs for fake inputs that no real call reuses,
and inductor, given symbolic fake inputs, aborts the process (``Cannot call numel() on tensor
with symbolic sizes/strides``, torch 2.13, a C++ terminate no ``except`` can catch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten


class TensorSpec(NamedTuple):
    """What a receive buffer needs: a shape and a dtype (the device is the stage's)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def output_specs(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    device: torch.device,
) -> tuple[TensorSpec, ...]:
    """The specs of ``module(*args, **kwargs)``'s tensor outputs (flattened, in order).

    ``args`` / ``kwargs`` hold real tensors (read for their shapes only), :class:`TensorSpec`s,
    or other values passed as they are. Exceptions of the module's forward propagate.
    """
    with _eager(), FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():

        def fake(v: Any) -> Any:
            if isinstance(v, TensorSpec):
                return torch.empty(v.shape, dtype=v.dtype, device=device)
            if isinstance(v, torch.Tensor):
                return mode.from_tensor(v)
            return v

        out = module(*(fake(a) for a in args), **{k: fake(v) for k, v in kwargs.items()})
        leaves, _ = tree_flatten(out)
        return tuple(
            TensorSpec(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)
        )


def data_dependent_error(e: BaseException) -> bool:
    """Whether ``e`` says an output's shape (or a value read on the host) depends on data."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException))


class ShapeRule:
    """A stage's output shapes as expressions of its input sizes, from one forward on fake
    tensors with every input size symbolic (torch's ``ShapeEnv``, what ``torch.compile``'s
    dynamic shapes use). :meth:`apply` evaluates them for concrete input shapes in microseconds;
    it gives None where the forward's guards (the size checks its Python made, e.g.
    ``n <= 512``) do not hold for those shapes, and the caller runs a concrete fake forward."""

    def __init__(
        self,
        inputs: tuple[tuple[Any, ...], ...],
        outputs: tuple[tuple[Any, ...], ...],
        dtypes: tuple[torch.dtype, ...],
        guards: tuple[Any, ...],
        ranges: dict[Any, tuple[Any, Any]],
    ) -> None:
        self.inputs, self.outputs, self.dtypes = inputs, outputs, dtypes
        self.guards, self.ranges = guards, ranges

    def apply(self, shapes: tuple[tuple[int, ...], ...]) -> tuple[TensorSpec, ...] | None:
        import sympy  # type: ignore[import-untyped]

        if len(shapes) != len(self.inputs):
            return None
        bound: dict[Any, int] = {}
        for dims, shape in zip(self.inputs, shapes, strict=True):
            if len(dims) != len(shape):
                return None
            for d, v in zip(dims, shape, strict=True):
                if isinstance(d, int):
                    if d != v:
                        return None
                elif bound.setdefault(d, v) != v:
                    return None
        for sym, (lo, hi) in self.ranges.items():
            got = bound.get(sym)
            if got is None or not (lo is None or got >= lo) or not (hi is None or got <= hi):
                return None
        for g in self.guards:
            if sympy.sympify(g).xreplace(bound) is not sympy.true:
                return None
        out = []
        for dims, dtype in zip(self.outputs, self.dtypes, strict=True):
            sizes = [d if isinstance(d, int) else sympy.sympify(d).xreplace(bound) for d in dims]
            if not all(isinstance(s, int) or getattr(s, "is_Integer", False) for s in sizes):
                return None
            out.append(TensorSpec(tuple(int(s) for s in sizes), dtype))
        return tuple(out)


def shape_rule(
    module: torch.nn.Module, args: tuple[Any, ...], device: torch.device
) -> ShapeRule | None:
    """``module``'s :class:`ShapeRule` from one symbolic fake forward on inputs shaped like
    ``args`` (tensors or :class:`TensorSpec`; no keyword inputs), or None where that forward
    fails (a data-dependent shape, an operator without symbolic support)."""
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    env = ShapeEnv(duck_shape=False)  # equal sizes stay separate symbols
    real = [  # made outside the mode: inside it, torch.empty would be a fake of fixed sizes
        torch.empty(a.shape, dtype=a.dtype, device=device) if isinstance(a, TensorSpec) else a
        for a in args
    ]
    try:
        with (
            _eager(),
            FakeTensorMode(allow_non_fake_inputs=True, shape_env=env) as mode,
            torch.no_grad(),
        ):
            fakes, inputs = [], []
            for a in real:
                if not isinstance(a, torch.Tensor):
                    fakes.append(a)
                    continue
                ctx: Any = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * a.dim())
                f = mode.from_tensor(a, symbolic_context=ctx)
                fakes.append(f)
                inputs.append(tuple(_expr(s) for s in f.shape))
            leaves, _ = tree_flatten(module(*fakes))
    except Exception:  # noqa: BLE001 - any failure: the caller runs concrete fake forwards
        return None
    outs = [t for t in leaves if isinstance(t, torch.Tensor)]
    ranges = {sym: (_bound(vr.lower), _bound(vr.upper)) for sym, vr in env.var_to_range.items()}
    return ShapeRule(
        inputs=tuple(inputs),
        outputs=tuple(tuple(_expr(s) for s in t.shape) for t in outs),
        dtypes=tuple(t.dtype for t in outs),
        guards=tuple(g.expr for g in env.guards),
        ranges=ranges,
    )


def _eager() -> Any:
    """Run ``torch.compile``d callables as their eager code (see the module's docstring)."""
    return torch.compiler.set_stance("force_eager")


def _expr(size: Any) -> Any:
    """An int, or the sympy expression of a symbolic size."""
    return size.node.expr if isinstance(size, torch.SymInt) else int(size)


def _bound(v: Any) -> int | None:
    """A range's end as an int, None where it is infinite."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) else None
