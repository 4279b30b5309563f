"""Experts a model writes as batched matmuls or einsums over a 3-D parameter, deferred.

Some models hold their experts as 3-D parameters and multiply them in their own ``forward``:
``torch.bmm(x, self.gate_up_proj)`` over tokens padded to a capacity per expert (HF's Llama 4
and GPT-OSS experts), ``x @ self.w``, ``torch.einsum("ecd,edf->ecf", x, self.w)``. zbpipe cannot
rewrite that code, so it intercepts the calls: a patched module (:func:`patch_batched`, a class
swap as for Linears) runs its own ``forward`` inside :class:`_ExpertMatmuls`, a
``TorchFunctionMode`` that sees every torch call the forward makes and replaces those whose
operand *is* one of the module's own 3-D parameters (a matmul or bmm of two 3-D tensors, a
two-operand einsum) by :class:`_EinsumWeight`, whose backward computes the input gradient in B
and queues the weight's for W (:class:`EinsumProduct`). Every other call passes through
unchanged, so a parameter used another way (transposed first, a three-operand einsum, a
broadcast) gets its gradient in B, as autograd computes it.

The mode is scoped to that one module's ``forward``, which is why only modules whose children
own no parameters are patched (a block owning a 3-D parameter would put every op of its
children through Python): in eager it is entered only during a zbpipe F or B (outside, the
module runs untouched); under ``torch.compile`` dynamo traces through it (``fullgraph=True``
holds) into the same ops, the weight gradient one opaque op routed at run time
(:mod:`zbpipe.engines.compiled_experts`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .. import _compat as C
from .compiled_experts import compiled_einsum_weight, gradient_equations, split_equation
from .expert_grads import EinsumProduct

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


def _match(func: Any, args: tuple[Any, ...], weights: dict[int, Tensor]) -> Any:
    """``(equation, x, weight, weight_first)`` if this call multiplies a tracked weight."""
    if func in _MATMULS:
        if len(args) != 2 or not all(isinstance(a, Tensor) and a.dim() == 3 for a in args):
            return None
        a, b = args
        if id(b) in weights and a.shape[0] == b.shape[0]:
            return _BMM, a, b, False
        if id(a) in weights and a.shape[0] == b.shape[0]:
            return _BMM, b, a, True
        return None
    if func is torch.einsum and args and isinstance(args[0], str):
        ops = args[1] if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
        if len(ops) != 2 or split_equation(args[0]) is None:
            return None
        a, b = ops
        if isinstance(b, Tensor) and id(b) in weights:
            return args[0], a, b, False
        if isinstance(a, Tensor) and id(a) in weights:
            return args[0], b, a, True
    return None


class _EinsumWeight(torch.autograd.Function):
    """``torch.einsum(eq, x, weight)`` (or ``(weight, x)``), the weight gradient queued during
    a zbpipe B."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, eq: str, weight_first: bool, store: Any
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.state = (store, weight, eq, weight_first)
        return torch.einsum(eq, weight, x) if weight_first else torch.einsum(eq, x, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        store, leaf, eq, weight_first = ctx.state
        eq_x, eq_w = gradient_equations(eq, weight_first)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.einsum(eq_x, grad_out, weight) if need_x else None
        grad_w = None
        if need_w:
            product = EinsumProduct(eq_w)
            deferrable = leaf.grad_fn is None and not C.has_grad_hooks(leaf)
            if deferrable and store.deferring and not torch.is_grad_enabled():
                store.put(leaf, x, grad_out, product)
            else:
                grad_w = product.compute(x, grad_out)
        return grad_x, grad_w, None, None, None


class _ExpertMatmuls(TorchFunctionMode):
    """Within one expert module's forward: its 3-D weights' matmuls and einsums deferred."""

    def __init__(self, weights: dict[int, Tensor], store: Any, compiling: bool) -> None:
        super().__init__()
        self.weights, self.store, self.compiling = weights, store, compiling

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if not kwargs and (func in _MATMULS or func is torch.einsum):
            found = _match(func, args, self.weights)
            if found is not None:
                eq, x, weight, weight_first = found
                if self.compiling:
                    return compiled_einsum_weight(x, weight, eq, weight_first)
                return _EinsumWeight.apply(x, weight, eq, weight_first, self.store)  # type: ignore[no-untyped-call]
        return func(*args, **(kwargs or {}))


def deferred_matmuls(module: nn.Module, store: Any, compiling: bool) -> _ExpertMatmuls:
    """The mode for one call of ``module``'s forward."""
    weights = {
        id(p): p for name in batched_weights(module) if (p := getattr(module, name)) is not None
    }
    return _ExpertMatmuls(weights, store, compiling)
