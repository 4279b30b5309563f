"""How W adds a weight gradient that is not a Linear's ``g.T @ x``: the experts' products.

An expert weight ``w`` of shape ``(E, N, K)`` is ``E`` Linears at once, multiplied in the
model's own code (``torch._grouped_mm`` over rows sorted by expert, a per-expert ``F.linear``,
a ``bmm`` or an einsum): :class:`WeightProduct` is how W turns a queued ``(x, grad_output)``
into its gradient and adds it (:class:`~zbpipe.engines.derived_ops.DerivedProduct` computes
each of those products, in the compute dtype, bf16 under torchtitan's casts).

They follow the rule of :mod:`zbpipe.engines.accumulate` (``AccumulateGrad``'s), and compute
the same bits as autograd's fused backward: the GEMM in the compute dtype, then the cast to the
parameter's dtype, then the add. A product in another dtype than ``.grad`` is converted and
added a slice of experts at a time through one small buffer (:func:`_add_converted`: a
mixed-dtype ``add_`` would convert element by element, and a whole-size fp32 temporary costs an
allocation the size of the weight on every W).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["WeightProduct"]

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
        """The gradient in the weight's dtype and layout."""
        raise NotImplementedError

    def add(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor | None:
        """Accumulate the gradient as ``AccumulateGrad`` would (None), or return it for autograd
        to add where the weight has post-accumulate hooks."""
        raise NotImplementedError


def _add_converted(grad: Tensor, dw: Tensor) -> None:
    """``grad += dw.to(grad.dtype)``, a slice of experts at a time through one buffer."""
    per = max(1, _SLICE_ELEMENTS // max(1, dw[0].numel()))
    buf: Tensor | None = None
    for start in range(0, dw.shape[0], per):
        part = dw[start : start + per]
        if buf is None or buf.shape != part.shape:
            buf = torch.empty(part.shape, dtype=grad.dtype, device=grad.device)
        grad[start : start + per].add_(buf.copy_(part))
