"""The deferred engine's MoE experts inside ``torch.compile``\\ d code: the split survives.

The experts' counterpart of :mod:`zbpipe.engines.compiled_linear`, built the same way (its
docstring says why a traced ``autograd.Function`` with an opaque weight-gradient op, not a
partition of the compiled backward graph): :class:`CompiledGroupedLinear` is traced whole by
dynamo (``fullgraph=True`` holds); its forward casts the parameter and runs
``torch._grouped_mm`` as torchtitan does, its backward computes the input gradient as ordinary
ops and hands the weight gradient to one opaque op,
``zbpipe::grouped_weight_grad(x, grad_output, offs, weight)``. The op reads the weight's route
when it runs: during a zbpipe B of the weight's stage it queues ``(x, grad_output, offs)`` for W
and returns a placeholder, which the weight's ``AccumulateGrad`` pre-hook drops; anywhere else
it returns the gradient (in the parameter's dtype: the cast back sits inside the op, so the
parameter receives the op's own output, which is what lets the hook recognise it).

The tokens each expert gets differ between microbatches, but they only change the *values* of
``offs``, a tensor of one entry per expert: the compiled graph is the same for every microbatch,
step and caller (no recompile, no guard on the routing). The op is registered with its twin
``_kept`` for inductor, which keeps the three operands' buffers for W instead of reusing them
(``_compat.lower_with_operands_kept``); any other caller gets copies queued.

:class:`CompiledEinsumWeight` and ``zbpipe::einsum_weight_grad(x, grad_output, weight,
equation)`` do the same for an expert weight a model multiplies itself, with ``torch.bmm`` or a
two-operand ``torch.einsum`` (:mod:`zbpipe.engines.expert_matmuls` puts them there).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat as C
from .compiled_routes import route_and_weight, route_parameter
from .expert_grads import EinsumProduct, GroupedProduct, WeightProduct

__all__ = [
    "CompiledEinsumWeight",
    "CompiledGroupedLinear",
    "compiled_einsum_weight",
    "compiled_grouped_linear",
    "gradient_equations",
    "route_compiled_experts",
    "split_equation",
]


def grouped_weight_grad(
    x: Tensor, grad_out: Tensor, offs: Tensor, weight: Tensor, kept: bool = False
) -> Tensor:
    """The gradient of ``weight`` (in its dtype), or, during a zbpipe B of its stage, queue it
    for W and return a placeholder (``kept``: the operands are queued without a copy)."""
    if not kept:
        offs = offs.clone()
    return _weight_grad(x, grad_out, weight, GroupedProduct(offs), kept)


def einsum_weight_grad(
    x: Tensor, grad_out: Tensor, weight: Tensor, equation: str, kept: bool = False
) -> Tensor:
    """As :func:`grouped_weight_grad`, for an einsum's (or a bmm's) weight."""
    return _weight_grad(x, grad_out, weight, EinsumProduct(equation), kept)


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


def _fake(x: Tensor, grad_out: Tensor, offs: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(weight)


def _einsum_fake(x: Tensor, grad_out: Tensor, weight: Tensor, equation: str) -> Tensor:
    return torch.empty_like(weight)


def _dispatch(
    x: Tensor, grad_out: Tensor, offs: Tensor, weight: Tensor, kept: bool = False
) -> Tensor:
    """The ops' kernel: :func:`grouped_weight_grad` of this module as imported now (as in
    :mod:`~zbpipe.engines.compiled_linear`: a re-import must not leave the op on a stale copy)."""
    current = sys.modules.get(__name__)
    fn = getattr(current, "grouped_weight_grad", grouped_weight_grad)
    result: Tensor = fn(x, grad_out, offs, weight, kept)
    return result


def _dispatch_kept(x: Tensor, grad_out: Tensor, offs: Tensor, weight: Tensor) -> Tensor:
    return _dispatch(x, grad_out, offs, weight, kept=True)


def _einsum_dispatch(
    x: Tensor, grad_out: Tensor, weight: Tensor, equation: str, kept: bool = False
) -> Tensor:
    current = sys.modules.get(__name__)
    fn = getattr(current, "einsum_weight_grad", einsum_weight_grad)
    result: Tensor = fn(x, grad_out, weight, equation, kept)
    return result


def _einsum_dispatch_kept(x: Tensor, grad_out: Tensor, weight: Tensor, equation: str) -> Tensor:
    return _einsum_dispatch(x, grad_out, weight, equation, kept=True)


#: (name, schema arguments, kernel, fake) of each op
_OPS = (
    ("grouped_weight_grad", "Tensor offs, Tensor weight", _dispatch, _fake),
    ("grouped_weight_grad_kept", "Tensor offs, Tensor weight", _dispatch_kept, _fake),
    ("einsum_weight_grad", "Tensor weight, str equation", _einsum_dispatch, _einsum_fake),
    ("einsum_weight_grad_kept", "Tensor weight, str equation", _einsum_dispatch_kept, _einsum_fake),
)


def _register_ops() -> tuple[Any, ...]:
    """The ops, once per process (the low-level API, as for the Linear's op: no autograd layer,
    called inside a backward only)."""
    try:
        return tuple(getattr(torch.ops.zbpipe, name).default for name, *_ in _OPS)
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("zbpipe", "FRAGMENT")  # type: ignore[no-untyped-call]
    for name, args, kernel, fake in _OPS:
        lib.define(  # type: ignore[no-untyped-call]  # torch's Library is untyped
            f"{name}(Tensor x, Tensor grad_out, {args}) -> Tensor",
            tags=(torch.Tag.cudagraph_unsafe,),
        )
        lib.impl(name, kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"zbpipe::{name}", fake, lib=lib)
    _dispatch.__dict__["library"] = lib
    return tuple(getattr(torch.ops.zbpipe, name).default for name, *_ in _OPS)


_OP, _OP_KEPT, _EINSUM_OP, _EINSUM_OP_KEPT = _register_ops()


class CompiledGroupedLinear(torch.autograd.Function):
    """``torch._grouped_mm(x, weight.bfloat16().transpose(-2, -1), offs=offs)`` whose weight
    gradient is the opaque op (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
        cast = weight.to(torch.bfloat16)
        ctx.save_for_backward(x, cast, offs, weight)
        return C.grouped_mm(x, cast.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, cast, offs, weight = ctx.saved_tensors
        need_x, need_w, _ = ctx.needs_input_grad
        grad_x = C.grouped_mm(grad_out, cast, offs) if need_x else None
        grad_w = _OP(x, grad_out, offs, weight) if need_w else None
        return grad_x, grad_w, None


class CompiledEinsumWeight(torch.autograd.Function):
    """``torch.einsum(eq, x, weight)`` (``weight_first``: ``(weight, x)``) whose weight
    gradient is the opaque einsum op (:mod:`zbpipe.engines.expert_matmuls` makes these)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eq: str, weight_first: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eq, ctx.weight_first = eq, weight_first
        return torch.einsum(eq, weight, x) if weight_first else torch.einsum(eq, x, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        eq_x, eq_w = gradient_equations(ctx.eq, ctx.weight_first)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.einsum(eq_x, grad_out, weight) if need_x else None
        grad_w = _EINSUM_OP(x, grad_out, weight, eq_w) if need_w else None
        return grad_x, grad_w, None, None


def compiled_einsum_weight(x: Tensor, weight: Tensor, eq: str, weight_first: bool) -> Tensor:
    out: Tensor = CompiledEinsumWeight.apply(x, weight, eq, weight_first)  # type: ignore[no-untyped-call]
    return out


def split_equation(eq: str) -> tuple[str, str, str] | None:
    """``(a, b, out)`` of a two-operand einsum whose gradients are einsums again: explicit
    output, no ellipsis, no index repeated within an operand, every index of each operand found
    in the other one or in the output."""
    m = re.fullmatch(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]*)", eq.replace(" ", ""))
    if m is None:
        return None
    a, b, out = m.groups()
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return None
    if not (set(a) <= set(b) | set(out) and set(b) <= set(a) | set(out)):
        return None
    return a, b, out


def gradient_equations(eq: str, weight_first: bool) -> tuple[str, str]:
    """(the input gradient's equation over ``(grad, weight)``, the weight gradient's over
    ``(x, grad)``) of a two-operand einsum :func:`split_equation` accepts."""
    parts = split_equation(eq)
    if parts is None:
        raise ValueError(f"zbpipe: einsum {eq!r} has no einsum gradients")
    a, b, out = parts
    x_sub, w_sub = (b, a) if weight_first else (a, b)
    return f"{out},{w_sub}->{x_sub}", f"{x_sub},{out}->{w_sub}"


def compiled_grouped_linear(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """What a patched expert module runs inside compiled code, per grouped GEMM."""
    out: Tensor = CompiledGroupedLinear.apply(x, weight, offs)  # type: ignore[no-untyped-call]
    return out


def route_compiled_experts(
    module: nn.Module, experts: list[nn.Module], names: Callable[[nn.Module], Sequence[str]]
) -> list[Any]:
    """Route the weights ``names(expert)`` of those ``experts`` that sit inside a compiled
    subtree of ``module`` to their stage's store; returns the ``AccumulateGrad`` nodes that
    carry the pre-hooks (the caller keeps them alive, as for Linears)."""
    inside = {id(e) for m in module.modules() if C.is_compiled(m) for e in m.modules()}
    if any(id(e) in inside for e in experts):
        C.lower_with_operands_kept(_OP, _OP_KEPT, kept=3)
        C.lower_with_operands_kept(_EINSUM_OP, _EINSUM_OP_KEPT, kept=2)
    nodes = []
    for e in experts:
        if id(e) not in inside:
            continue
        for name in names(e):
            weight = C.own_parameter(e, name)
            if weight is not None and weight.requires_grad:
                nodes.append(route_parameter(e, weight))
    return nodes
