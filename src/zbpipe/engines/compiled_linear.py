"""The deferred engine's Linears inside ``torch.compile``d code: the split survives compilation.

A compiled region is one autograd node: its backward returns every input's and every
parameter's gradient at once, so an ordinary Linear inside it computes its weight GEMM in B.
Inside compiled code a patched Linear therefore runs :class:`CompiledLinear`, an
``autograd.Function`` that dynamo traces whole (no graph break under ``fullgraph=True``): its
forward is ``F.linear`` and its backward computes the input and bias gradients as plain ops
inductor sees and optimizes, and hands the weight GEMM to one opaque custom op,
``zbpipe::linear_weight_grad(input, grad_output, weight)``.

That op reads the routing of ``weight`` at run time, not at trace time, so the compiled graph is
the same for every microbatch, every step and outside zbpipe (no guard on the store, no
recompile). When the weight's stage is in a zbpipe B, the op queues ``(weight, input,
grad_output)`` in the store as the eager Linear does and returns a *placeholder*; anywhere else
(plain training, a fused backward, ``torch.autograd.grad``) it returns the GEMM's result, so
the module is an ordinary Linear. The compiled backward hands the placeholder to the weight's
``AccumulateGrad`` node, where a pre-hook installed by :func:`route_compiled_linears` drops it
(autograd then adds nothing) when it arrives untouched. If the compiled graph summed it with
another contribution (the weight used twice in the region, or tied to a module outside it),
the placeholder was zeros and the sum reaches ``.grad`` unchanged and correct: a weight's first
placeholder is always zeros, and only a weight whose placeholder arrived alone gets cheaper
uninitialized ones after that. One that then arrives summed (a different graph) raises.

What W reads must still hold what B saw. Inductor reuses a buffer for a later kernel (or writes
into it in place) once its last reader has run, and the op is such a reader. Inductor-compiled
code therefore calls the op's twin ``zbpipe::linear_weight_grad_kept`` instead: a lowering,
registered when the first compiled Linear is routed, marks the operands' buffers as never
reused and emits that twin, which queues them as they are. Any other caller of the op (a graph
compiled before that registration, or by another backend) gets the copy it queues: inductor's
rows x (in + out) elements read and written again, against the GEMM's rows x in x out
multiply-adds, which is a few percent of B on a CPU at hidden 256 and more where a device's
arithmetic outpaces its memory. Both ops are tagged ``cudagraph_unsafe``: a CUDA graph would
replay the GEMM's buffers but never the queuing.

The routes live in a process-wide table keyed weakly by parameter: a ``torch.library`` op is
process-wide itself, and it receives the parameter, not the module or the schedule. A DTensor
weight reaches the op through its sharding rule (:func:`register_dtensor_sharding`) as its
local shard, found by identity; FSDP2's unsharded parameter, which FSDP2 puts on the Linear
around forward and backward in place of the sharded one routing saw, gets a route of its own
when the op first meets it (the routes: :mod:`zbpipe.engines.compiled_routes`).
docs/design/backward.md says why this and not a partition of the compiled backward graph.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _compat as C
from .accumulate import weight_grad
from .compiled_routes import LinearRoute, route_and_weight, route_leaves, route_of, route_parameter

logger = logging.getLogger(__name__)

__all__ = [
    "CompiledLinear",
    "LinearRoute",
    "compiled_linear",
    "route_compiled_linears",
    "route_leaves",
    "route_of",
]


def linear_weight_grad(x: Tensor, grad_out: Tensor, weight: Tensor, kept: bool = False) -> Tensor:
    """``grad_out^T @ x`` (2-D operands), or, during a zbpipe B of the weight's stage, queue it
    for W and return a placeholder that the weight's ``AccumulateGrad`` pre-hook drops.

    ``kept``: the caller never reuses or overwrites ``x`` and ``grad_out`` (the twin op that
    inductor-compiled code calls), so they are queued without a copy.
    """
    dtype = _gemm_dtype(grad_out, x, weight)
    operand = weight  # a DTensor parameter's local shard: the placeholder has its shape
    route, weight = route_and_weight(weight)
    store = None if route is None else route.store()
    if route is None or store is None or not _deferrable(weight) or torch.is_grad_enabled():
        return weight_grad(grad_out, x, dtype, weight.dtype)
    if store.keeps(weight) and not kept:
        x, grad_out = operand_copy(x), operand_copy(grad_out)
    # W adds the product into the parameter's .grad (a DTensor parameter's: with its placements)
    store.put(weight, x, grad_out, dtype)
    return route.make_placeholder(operand, store)


def _gemm_dtype(grad_out: Tensor, x: Tensor, weight: Tensor) -> torch.dtype | None:
    """The dtype the weight GEMM runs in: None where the operands and the weight agree, else
    the gradient's (autocast)."""
    return None if grad_out.dtype == x.dtype == weight.dtype else grad_out.dtype


def operand_copy(t: Tensor) -> Tensor:
    """A copy of one queued operand, for a caller that may reuse its buffer once the op has
    read it (the module docstring says which callers do)."""
    return t.clone()


def _linear_weight_grad_fake(x: Tensor, grad_out: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(weight)


def _dispatch(x: Tensor, grad_out: Tensor, weight: Tensor, kept: bool = False) -> Tensor:
    """The ops' kernel: :func:`linear_weight_grad` of this module as imported now.

    An op is registered once per process, but this module can be imported again (reloaded, or
    forgotten and re-imported as the torchtitan tests do between runs): the kernel registered
    first then reaches the routes of the module imported last, never a stale copy's.
    """
    current = sys.modules.get(__name__)
    fn = getattr(current, "linear_weight_grad", linear_weight_grad)
    result: Tensor = fn(x, grad_out, weight, kept)
    return result


def _dispatch_kept(x: Tensor, grad_out: Tensor, weight: Tensor) -> Tensor:
    return _dispatch(x, grad_out, weight, kept=True)


_NAMES = ("linear_weight_grad", "linear_weight_grad_kept")


def _register_ops() -> tuple[Any, Any]:
    """``zbpipe::linear_weight_grad`` and its twin ``_kept``, registered on the first import of
    this module only.

    Defined with the low-level registration API, not ``torch.library.custom_op``: the op runs
    once per Linear in every B, and custom_op's Python wrappers (its autograd layer, its run-time
    aliasing check) cost about 10 us a call against about 2 us here. The ops are only ever called
    inside a backward, so they need no autograd formula of their own. The kernel keeps its
    ``Library`` alive (a ``Library`` that is garbage-collected takes its ops with it).
    """
    try:  # an earlier import registered them
        return tuple(getattr(torch.ops.zbpipe, name).default for name in _NAMES)
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("zbpipe", "FRAGMENT")  # type: ignore[no-untyped-call]
    for name, kernel in zip(_NAMES, (_dispatch, _dispatch_kept), strict=True):
        lib.define(  # type: ignore[no-untyped-call]  # torch's Library is untyped
            f"{name}(Tensor x, Tensor grad_out, Tensor weight) -> Tensor",
            tags=(torch.Tag.cudagraph_unsafe,),
        )
        lib.impl(name, kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"zbpipe::{name}", _linear_weight_grad_fake, lib=lib)
    _dispatch.__dict__["library"] = lib
    return tuple(getattr(torch.ops.zbpipe, name).default for name in _NAMES)


_OP, _OP_KEPT = _register_ops()


def _deferrable(weight: Tensor) -> bool:
    # as linear_patch._deferrable: a leaf without register_hook hooks
    return weight.grad_fn is None and not C.has_grad_hooks(weight)


class CompiledLinear(torch.autograd.Function):
    """``F.linear`` whose weight GEMM is one opaque op (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        out = F.linear(x, weight, bias)
        # Under autocast the output (and the gradient) has the autocast dtype: save the input
        # at that size, as autocast's own Linear does, and compute the backward in it.
        ctx.save_for_backward(x if out.dtype == x.dtype else x.to(out.dtype), weight)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = grad_out.matmul(weight.to(grad_out.dtype)).to(ctx.x_dtype)
        if need_w:
            x2d = x.reshape(-1, x.shape[-1])
            if C.is_dtensor(weight) and not (C.is_dtensor(x2d) and rows_whole(x2d)):
                # each rank's product would be a partial sum: DTensor's own ops, in B
                grad_w = weight_grad(g2d, x2d, _gemm_dtype(g2d, x2d, weight), weight.dtype)
            else:
                grad_w = _OP(x2d, g2d, weight)
        if need_b:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b


#: per mesh dimension, (input, grad_output, weight) placements of the op's 2-D operands under
#: which each rank's local product grad_output^T @ input IS its local shard of the weight
#: gradient, placed as the weight: all replicated; a column-wise split Linear (its weight's
#: rows split as grad_output's columns); a row-wise one (its weight's columns as the input's)
_LOCAL_PRODUCT_PLACEMENTS = (
    ("R", "R", "R"),
    ("R", "S1", "S0"),
    ("S1", "R", "S1"),
)


def rows_whole(x2d: Tensor) -> bool:
    """Whether every rank holds all rows of a DTensor Linear's 2-D input (each mesh dimension
    replicates it or splits its columns), as :data:`_LOCAL_PRODUCT_PLACEMENTS` need. Rows split
    over ranks (data parallelism by DTensor) make each rank's product a partial sum: the
    weight's gradient is then that sum reduced, which W cannot add later on its own.

    Read at trace time from the input the forward saved, whose placements dynamo knows (it
    guesses the incoming gradient's from the forward's output: a row-wise Linear's output is
    Partial where the gradient arrives Replicate, so the op's sharding rule, applied when
    AOTAutograd traces with the real placements, decides the rest)."""
    placements = x2d.placements  # type: ignore[attr-defined]
    # methods, not type(p): torch 2.11's dynamo folds ``type(p) is Replicate`` to False here
    return all(p.is_replicate() or (p.is_shard() and p.dim % 2 == 1) for p in placements)


def register_dtensor_sharding() -> None:
    """The ops' DTensor sharding rule: on each mesh dimension one of
    :data:`_LOCAL_PRODUCT_PLACEMENTS`, the result placed as the weight. DTensor picks the one
    that redistributes least (none, for the placements of replicated and tensor-parallel
    Linears) and hands the op the local shards, then wraps its result (the placeholder too)
    with the chosen weight placement. Where it has to redistribute the weight itself, the op
    receives a new tensor, not the parameter's local shard, which no route knows: it computes
    the gradient in B, correctly placed. Registered on import (again on a re-import: it
    replaces the rule, the same one)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    make = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}

    def strategies(*operands: Any) -> list[tuple[list[Any], list[Any]]]:
        return [([make[w]], [make[x], make[g], make[w]]) for x, g, w in _LOCAL_PRODUCT_PLACEMENTS]

    register_sharding([_OP, _OP_KEPT])(strategies)


register_dtensor_sharding()


def compiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """What a patched Linear runs inside compiled code."""
    out: Tensor = CompiledLinear.apply(x, weight, bias)  # type: ignore[no-untyped-call]
    return out


def route_compiled_linears(module: nn.Module, linears: list[nn.Module]) -> list[Any]:
    """Route the weight GEMMs of those ``linears`` that sit inside a compiled subtree of
    ``module`` (``torch.compile(m)`` or in-place ``m.compile()``) through their stage's store.

    Returns the weights' ``AccumulateGrad`` nodes, which carry the pre-hooks: the caller keeps
    them alive (autograd holds a leaf's node weakly and would make a new one, without hooks).
    A Linear compiled after this call computes its weight gradient in B, correctly.
    """
    inside = {id(lin) for m in module.modules() if C.is_compiled(m) for lin in m.modules()}
    if any(id(lin) in inside for lin in linears):
        C.lower_with_operands_kept(_OP, _OP_KEPT)
    nodes = []
    for lin in linears:
        weight = C.own_parameter(lin, "weight")
        if id(lin) not in inside or weight is None or not weight.requires_grad:
            continue
        nodes.append(route_parameter(lin, weight))
    logger.debug("zbpipe: %d compiled Linears defer their W", len(nodes))
    return nodes
