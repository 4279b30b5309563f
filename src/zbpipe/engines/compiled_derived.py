"""The derived GEMMs of :mod:`zbpipe.engines.derived_ops` inside ``torch.compile``\\ d code.

dynamo traces :class:`_CompiledDerivedGemm` whole (``fullgraph=True`` holds): its forward is
the model's GEMM on the derived operand, its backward computes the input gradient as ordinary
ops and hands the weight gradient to one opaque op, ``zbpipe::derived_weight_grad(x,
grad_output, offs, weight, spec)`` (``spec``: the kind and the steps, as a string). The op reads
the weight's route when it runs (:mod:`zbpipe.engines.compiled_routes`): during a zbpipe B of
the weight's stage it queues ``(x, grad_output)`` for W and returns a placeholder, which the
weight's ``AccumulateGrad`` pre-hook drops; anywhere else it returns the gradient.

A weight used by several GEMMs in one forward (a Hugging Face-style loop, ``F.linear(x,
w[e])`` per expert) would hand that hook the *sum* of its placeholders, which the compiled
backward adds before the hook runs: the hook could not tell it from a real gradient, B would
add zeros into ``.grad`` and W would add the products one at a time (not the fused sum's bits).
So every GEMM on a selected slice reaches its weight through one gate per weight and forward
(:class:`_CompiledGate`, an alias): the compiled backward sums the slices' placeholders into
the gate's gradient, and the gate's op, ``zbpipe::derived_weight_gate(summed, weight)``, turns
that sum into one placeholder during a zbpipe B (else it passes the sum on, copied: an op
returns no alias of its input).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat as C
from .compiled_routes import route_and_weight, route_parameter
from .derived_ops import Derivation, DerivedProduct, Step, _gemm, _input_grad, parse_spec, spec_of
from .expert_grads import WeightProduct

__all__ = [
    "DERIVED_OP",
    "DERIVED_OP_KEPT",
    "compiled_gemm",
    "gate",
    "route_compiled_experts",
]


def _derived_weight_grad(
    x: Tensor, grad_out: Tensor, offs: Tensor | None, weight: Tensor, spec: str, kept: bool = False
) -> Tensor:
    """The compiled op's kernel: the gradient of ``weight``, or queued for W during a zbpipe B
    of its stage (:func:`_weight_grad` routes it)."""
    kind, eq, first, steps = parse_spec(spec)
    if offs is not None:  # (a few bytes; the kept twin keeps x and grad_out only)
        offs = offs.clone()
    product = _Bound(DerivedProduct(kind, steps, offs, eq, first), weight)
    return _weight_grad(x, grad_out, weight, product, kept)


def _weight_grad(
    x: Tensor, grad_out: Tensor, weight: Tensor, product: WeightProduct, kept: bool
) -> Tensor:
    operand = weight
    route, weight = route_and_weight(weight)
    store = None if route is None else route.store()
    if (
        route is None
        or store is None
        or weight.grad_fn is not None
        or C.has_grad_hooks(weight)
        or torch.is_grad_enabled()
    ):
        return product.compute(x, grad_out).to(operand.dtype)
    if store.keeps(weight) and not kept:
        x, grad_out = x.clone(), grad_out.clone()
    store.put(weight, x, grad_out, product)
    placeholder: Tensor = route.make_placeholder(operand, store)
    return placeholder


def _derived_weight_gate(summed: Tensor, weight: Tensor) -> Tensor:
    """The gate op's kernel: one placeholder for ``weight`` where the derived ops of this B
    queued its products (``summed`` is then a sum of placeholders), else ``summed``, copied."""
    route, _ = route_and_weight(weight)
    store = None if route is None else route.store()
    made = None if route is None else route.placeholder
    if route is None or store is None or made is None or made[1] is not store:
        return summed.clone()
    placeholder: Tensor = route.make_placeholder(weight, store)
    return placeholder


class _Bound(WeightProduct):
    """A :class:`DerivedProduct` with its weight, for callers that ask ``compute(x, g)``."""

    __slots__ = ("inner", "param")

    def __init__(self, inner: DerivedProduct, weight: Tensor) -> None:
        self.inner, self.param = inner, weight

    def compute(self, x: Tensor, g: Tensor) -> Tensor:
        return self.inner.local_grad(self.param, x, g)

    def grad(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor:
        return self.inner.grad(weight, x, g)

    def add(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor | None:
        return self.inner.add(weight, x, g)


def _current(name: str, default: Any) -> Any:
    """``name`` of this module as imported now: a re-import must not leave an op on a stale
    copy (as in :mod:`~zbpipe.engines.compiled_linear`)."""
    return getattr(sys.modules.get(__name__), name, default)


def _dispatch(x: Tensor, g: Tensor, offs: Tensor | None, w: Tensor, spec: str) -> Tensor:
    result: Tensor = _current("_derived_weight_grad", _derived_weight_grad)(x, g, offs, w, spec)
    return result


def _dispatch_kept(x: Tensor, g: Tensor, offs: Tensor | None, w: Tensor, spec: str) -> Tensor:
    fn = _current("_derived_weight_grad", _derived_weight_grad)
    result: Tensor = fn(x, g, offs, w, spec, True)
    return result


def _dispatch_gate(summed: Tensor, weight: Tensor) -> Tensor:
    result: Tensor = _current("_derived_weight_gate", _derived_weight_gate)(summed, weight)
    return result


def _fake(x: Tensor, g: Tensor, offs: Tensor | None, w: Tensor, spec: str) -> Tensor:
    return torch.empty_like(w)


def _fake_gate(summed: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(weight)


_GRAD_ARGS = "Tensor x, Tensor grad_out, Tensor? offs, Tensor weight, str spec"
#: (name, schema arguments, kernel, fake) of each op
_OPS = (
    ("derived_weight_grad", _GRAD_ARGS, _dispatch, _fake),
    ("derived_weight_grad_kept", _GRAD_ARGS, _dispatch_kept, _fake),
    ("derived_weight_gate", "Tensor summed, Tensor weight", _dispatch_gate, _fake_gate),
)


def _register() -> tuple[Any, ...]:
    try:
        return tuple(getattr(torch.ops.zbpipe, name).default for name, *_ in _OPS)
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("zbpipe", "FRAGMENT")  # type: ignore[no-untyped-call]
    for name, args, kernel, fake in _OPS:
        lib.define(  # type: ignore[no-untyped-call]
            f"{name}({args}) -> Tensor", tags=(torch.Tag.cudagraph_unsafe,)
        )
        lib.impl(name, kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"zbpipe::{name}", fake, lib=lib)
    _dispatch.__dict__["library"] = lib
    return tuple(getattr(torch.ops.zbpipe, name).default for name, *_ in _OPS)


DERIVED_OP, DERIVED_OP_KEPT, GATE_OP = _register()


class _CompiledGate(torch.autograd.Function):
    """An alias of ``leaf`` that every per-slice GEMM on it in one forward takes as its weight
    edge: its backward gets their gradients summed (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, leaf: Tensor) -> Tensor:
        ctx.save_for_backward(leaf)
        return leaf.view_as(leaf)

    @staticmethod
    def backward(ctx: Any, summed: Tensor) -> Tensor:
        (leaf,) = ctx.saved_tensors
        out: Tensor = GATE_OP(summed, leaf)
        return out


def gate(leaf: Tensor) -> Tensor:
    """The gate of ``leaf`` for one forward (the caller makes one per weight and forward)."""
    out: Tensor = _CompiledGate.apply(leaf)  # type: ignore[no-untyped-call]
    return out


class _CompiledDerivedGemm(torch.autograd.Function):
    """Traced by dynamo: the GEMM on the derived operand (``operand`` None: ``edge`` itself,
    which dynamo will not take twice), its weight gradient, for ``edge``, the opaque op on
    ``leaf`` (None: ``edge`` is the leaf; else ``edge`` is its gate)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        edge: Tensor,
        operand: Tensor | None,
        offs: Tensor | None,
        spec: str,
        parsed: tuple[str, str, bool, tuple[Step, ...]],
        leaf: Tensor | None,
    ) -> Tensor:
        kind, eq, first, _ = parsed
        w = edge if operand is None else operand
        ctx.save_for_backward(x, w, offs, edge if leaf is None else leaf)
        ctx.spec, ctx.parsed = spec, parsed
        return _gemm(kind, eq, first, x, w, offs)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, operand, offs, leaf = ctx.saved_tensors
        kind, eq, first, _ = ctx.parsed
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = _input_grad(kind, eq, first, grad_out, operand, offs) if need_x else None
        grad_w = DERIVED_OP(x, grad_out, offs, leaf, ctx.spec) if need_w else None
        return grad_x, grad_w, None, None, None, None, None


def compiled_gemm(
    kind: str,
    x: Tensor,
    operand: Tensor,
    how: Derivation,
    offs: Tensor | None,
    gated: Tensor | None,
    eq: str = "",
    weight_first: bool = False,
) -> Tensor:
    """Inside compiled code: the GEMM ``kind`` of ``x`` and ``operand`` (derived from a
    parameter as ``how`` says) whose weight gradient waits for W; ``gated``: the weight's gate
    (:func:`gate`), through which the gradient then flows."""
    spec = spec_of(kind, how.steps, eq, weight_first)
    parsed = (kind, eq, weight_first, how.steps)
    derived = operand if how.steps else None
    edge, leaf = (how.source, None) if gated is None else (gated, how.source)
    out: Tensor = _CompiledDerivedGemm.apply(x, edge, derived, offs, spec, parsed, leaf)  # type: ignore[no-untyped-call]
    return out


def route_compiled_experts(
    module: nn.Module, experts: list[nn.Module], names: Callable[[nn.Module], Sequence[str]]
) -> list[Any]:
    """Route the weights ``names(expert)`` of those ``experts`` that sit inside a compiled
    subtree of ``module`` to their stage's store; returns the ``AccumulateGrad`` nodes that
    carry the pre-hooks (the caller keeps them alive, as for Linears)."""
    inside = {id(e) for m in module.modules() if C.is_compiled(m) for e in m.modules()}
    if any(id(e) in inside for e in experts):  # inductor keeps x and grad_out for W
        C.lower_with_operands_kept(DERIVED_OP, DERIVED_OP_KEPT, kept=2)
    nodes = []
    for e in experts:
        if id(e) not in inside:
            continue
        for name in names(e):
            weight = C.own_parameter(e, name)
            if weight is not None and weight.requires_grad:
                nodes.append(route_parameter(e, weight))
    return nodes
