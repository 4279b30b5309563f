"""The weight gradients of MoE experts held as 3-D parameters, computed and accumulated.

An expert weight ``w`` of shape ``(E, N, K)`` is ``E`` Linears at once: torchtitan's
``GroupedExperts`` computes ``out = x @ w[e].T`` for the rows ``x`` routed to expert ``e`` with
one grouped GEMM (``torch._grouped_mm``, the rows sorted by expert and cut at ``offs``), and a
model that pads every expert to a capacity writes ``out = torch.bmm(x, w)`` over ``(E, C, K)``
rows. Either way the weight gradient is one product per expert, the shape of ``w``, whatever
the number of rows: :class:`GroupedProduct` computes it from the
``(x, grad_output)`` that B queued, in the weight's own layout, and add it to ``.grad``
(:class:`EinsumProduct` for a bmm or an einsum).

They follow the rule of :mod:`zbpipe.engines.accumulate` (``AccumulateGrad``'s), and compute
the same bits as autograd's fused backward: the GEMM in the compute dtype (bf16 under
torchtitan's casts), then the cast to the parameter's dtype, then the add. What differs is how:
autograd's backward of ``w.bfloat16().transpose(-2, -1)`` casts a transposed product into a
freshly allocated fp32 tensor and adds that strided tensor into ``.grad``; here the product is
computed already in the weight's layout and, when ``.grad`` exists, converted and added a slice
at a time through one small buffer (a mixed-dtype ``add_`` would convert element by element,
and a whole-size fp32 temporary costs an allocation the size of the weight on every W).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _compat as C
from .accumulate import accumulate, as_param_grad

__all__ = ["EinsumProduct", "GroupedProduct", "WeightProduct"]

#: elements converted and added at once when the product's dtype is not the weight's
_SLICE_ELEMENTS = 1 << 20


class WeightProduct:
    """How W computes one queued weight gradient that is not a Linear's ``g.T @ x``.

    A store entry holds ``(weight, x, g, product, holders)``: :meth:`grad` gives the gradient
    in the weight's dtype and layout (a DTensor weight's placements added), :meth:`add`
    accumulates it as ``AccumulateGrad`` would and returns None, or returns it for autograd to
    add when the weight has post-accumulate hooks
    (:func:`~zbpipe.engines.accumulate.accumulate_hooked`).
    """

    __slots__ = ()

    def compute(self, x: Tensor, g: Tensor) -> Tensor:
        """The product in the compute dtype, in the weight's (local) shape."""
        raise NotImplementedError

    def grad(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor:
        dw = self.compute(x, g)
        if dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
        return as_param_grad(weight, dw)

    def add(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor | None:
        if C.has_post_accumulate_grad_hooks(weight):
            return self.grad(weight, x, g)
        grad = weight.grad
        if grad is None or C.is_dtensor(weight) or type(grad) is not Tensor:
            accumulate(weight, self.grad(weight, x, g))
            return None
        dw = self.compute(x, g)
        if dw.dtype == grad.dtype:
            grad.add_(dw)
        else:
            _add_converted(grad, dw)
        return None


class GroupedProduct(WeightProduct):
    """``dw[e] = g[rows_e].T @ x[rows_e]``, rows cut at ``offs``: the gradient of
    ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` with respect to ``w`` (an empty
    group gives zeros, as autograd's)."""

    __slots__ = ("offs",)

    def __init__(self, offs: Tensor) -> None:
        self.offs = offs

    def compute(self, x: Tensor, g: Tensor) -> Tensor:
        return C.grouped_mm(g.t(), x, self.offs)


def _add_converted(grad: Tensor, dw: Tensor) -> None:
    """``grad += dw.to(grad.dtype)``, a slice of experts at a time through one buffer."""
    per = max(1, _SLICE_ELEMENTS // max(1, dw[0].numel()))
    buf: Tensor | None = None
    for start in range(0, dw.shape[0], per):
        part = dw[start : start + per]
        if buf is None or buf.shape != part.shape:
            buf = torch.empty(part.shape, dtype=grad.dtype, device=grad.device)
        grad[start : start + per].add_(buf.copy_(part))


class EinsumProduct(WeightProduct):
    """``dw = torch.einsum(equation, x, g)``: the weight gradient of a two-operand einsum (a
    bmm is ``"bij,bik->bjk"``, the same product as autograd's ``x.transpose(1, 2).bmm(g)``)."""

    __slots__ = ("equation",)

    def __init__(self, equation: str) -> None:
        self.equation = equation

    def compute(self, x: Tensor, g: Tensor) -> Tensor:
        return torch.einsum(self.equation, x, g)
