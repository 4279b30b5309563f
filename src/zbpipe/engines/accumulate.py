"""How a weight gradient reaches ``.grad``: the one rule both engines' W passes follow.

autograd adds a leaf's gradient in its ``AccumulateGrad`` node
(torch/csrc/autograd/functions/accumulate_grad.h). Both engines compute weight gradients
outside that node (the graph engine's W gets them back from ``autograd.grad``, the deferred W
runs the GEMMs itself), so they add them here, by the same rule, to keep ``.grad`` what a fused
backward leaves: :func:`accumulate`. The deferred engine may instead add inside the GEMM
(:func:`add_product`), and hands weights with post-accumulate hooks back to autograd
(:func:`accumulate_hooked`), which fires them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import _compat as C
from ..memory.saved import storage_ptr


def accumulate(param: Tensor, grad: Tensor, known_storages: set[int] | None = None) -> None:
    """Add ``grad`` to ``param.grad`` as ``AccumulateGrad`` does.

    First gradient: autograd steals the new tensor when nothing else holds it and its strides
    match the parameter's ("layout contract"), else copies it into the parameter's layout.
    Later gradients: added in place.

    ``known_storages=None``: ``grad`` is fresh, a product nothing else references (the deferred
    W's GEMM), so a plain tensor of the parameter's strides is stolen as it is. Otherwise (the
    graph engine's W, whose gradients come from ``autograd.grad`` and may share storage with a
    gradient handed to B or returned by it) a tensor is stolen only when its storage is not in
    ``known_storages`` and it is not a view, because a stolen tensor is later added to in place.
    A stolen storage joins the set: a weight-only node can hand one tensor to several
    parameters (``x @ (w1 + w2)``), and the next one must copy it, or the next microbatch's
    in-place add would hit both gradients.
    """
    current = param.grad
    if current is not None:
        current += grad
        return
    if known_storages is None and type(grad) is Tensor and grad.stride() == param.stride():
        param.grad = grad  # stolen, as autograd steals a fresh tensor of the right layout
        return
    known = set() if known_storages is None else known_storages
    g = grad.detach()
    storage = storage_ptr(g)
    if storage is None or type(g) is not Tensor:
        # A tensor subclass (a DTensor from a tensor-parallel layer): empty_strided would make a
        # plain tensor; clone keeps the subclass, its placements and (dense) strides.
        if storage is None or storage in known or C.is_view(g):
            g = g.clone()
    elif g.stride() != param.stride() or storage in known or C.is_view(g):
        g = torch.empty_strided(
            param.size(), param.stride(), dtype=param.dtype, device=param.device
        ).copy_(g)
    param.grad = g
    if (ptr := storage_ptr(g)) is not None:
        known.add(ptr)


def weight_grad(g2d: Tensor, x2d: Tensor, dtype: torch.dtype | None, out: torch.dtype) -> Tensor:
    """A Linear's weight gradient ``g2d^T @ x2d`` (computed in ``dtype`` under autocast).

    The same GEMM autograd's AddmmBackward runs for a Linear's weight (mm_mat2_backward with a
    transposed weight, then TBackward), so the result is bitwise a fused backward's.
    """
    if dtype is not None:
        return g2d.to(dtype).t().mm(x2d.to(dtype)).to(out)
    return g2d.t().mm(x2d)


#: attribute under which a runtime may offer a weight a buffer for its first gradient (the
#: continuous schedule's stale modes hand back the last step's gradients): the first product is
#: written into it, ``mm(out=)``, instead of into a fresh allocation
GRAD_BUFFER = "_zbpipe_grad_buffer"


def add_product(weight: Tensor, x: Tensor, g: Tensor, dtype: torch.dtype | None) -> Tensor | None:
    """Add ``weight``'s gradient ``g^T @ x`` to its ``.grad``: inside the GEMM where it can,
    else as ``AccumulateGrad`` would. A weight with post-accumulate hooks gets nothing: the
    product is returned, for autograd to add and fire them (:func:`accumulate_hooked`)."""
    grad = weight.grad
    # The common case first, in as few Python steps as it takes (it runs once per Linear per
    # microbatch): a plain .grad of the input's dtype, no autocast, no post-accumulate hooks.
    if (
        type(grad) is Tensor
        and not C.is_dtensor(weight)
        and dtype is None
        and type(x) is Tensor
        and grad.dtype == x.dtype
        and grad.layout == torch.strided
        and not C.post_accumulate_grad_hooks(weight)
    ):
        grad.addmm_(g.t(), x)
        return None
    if C.is_dtensor(weight) and not C.is_dtensor(x):
        return _add_local_product(weight, x, g, dtype)
    if C.has_post_accumulate_grad_hooks(weight):
        return weight_grad(g, x, dtype, weight.dtype)
    if grad is not None and _accumulates_in_gemm(grad, x, dtype):
        grad.addmm_(g.t(), x)
    elif grad is None and (buf := _offered_buffer(weight, x, dtype)) is not None:
        torch.mm(g.t(), x, out=buf)  # the product autograd would steal, in a recycled buffer
        weight.grad = buf
    else:
        accumulate(weight, weight_grad(g, x, dtype, weight.dtype))
    return None


def as_param_grad(weight: Tensor, dw: Tensor) -> Tensor:
    """``dw`` as ``weight``'s gradient: a DTensor weight's product of local operands (queued
    by compiled code, where it is the local shard of the gradient:
    ``compiled_linear.register_dtensor_sharding``) is wrapped with the weight's placements."""
    if not C.is_dtensor(weight) or C.is_dtensor(dw):
        return dw
    return DTensor.from_local(
        dw,
        weight.device_mesh,  # type: ignore[attr-defined]
        weight.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=weight.shape,
        stride=weight.stride(),
    )


def _add_local_product(
    weight: Tensor, x: Tensor, g: Tensor, dtype: torch.dtype | None
) -> Tensor | None:
    """:func:`add_product` for a DTensor ``weight`` and the local operands compiled code queued:
    inside the GEMM, into the local shard of a ``.grad`` placed as the weight, where it can."""
    hooked = C.has_post_accumulate_grad_hooks(weight)
    grad = weight.grad
    if (
        not hooked
        and grad is not None
        and C.is_dtensor(grad)
        and grad.placements == weight.placements  # type: ignore[attr-defined]
        and grad.device_mesh == weight.device_mesh  # type: ignore[attr-defined]
        and _accumulates_in_gemm(local := C.local_tensor(grad), x, dtype)
    ):
        local.addmm_(g.t(), x)
        return None
    dw = as_param_grad(weight, weight_grad(g, x, dtype, weight.dtype))
    if hooked:
        return dw
    accumulate(weight, dw)
    return None


def _offered_buffer(weight: Tensor, x: Tensor, dtype: torch.dtype | None) -> Tensor | None:
    """The buffer offered under :data:`GRAD_BUFFER` (taken: it is used once), if it fits."""
    buf = weight.__dict__.pop(GRAD_BUFFER, None)
    if (
        buf is None
        or dtype is not None
        or type(buf) is not Tensor
        or type(x) is not Tensor
        or buf.dtype != x.dtype
        or buf.shape != weight.shape
        or buf.stride() != weight.stride()
    ):
        return None
    return buf


def _accumulates_in_gemm(grad: Tensor, x: Tensor, dtype: torch.dtype | None) -> bool:
    """Whether a gradient can be added inside the GEMM: a plain ``.grad`` already there in the
    input's dtype, no autocast cast."""
    return (
        type(grad) is Tensor
        and type(x) is Tensor
        and dtype is None
        and grad.dtype == x.dtype
        and grad.layout == torch.strided
    )


def accumulate_hooked(later: list[tuple[Tensor, Tensor]]) -> None:
    """Hand the products of weights with post-accumulate hooks to autograd, which fires them."""
    if later:
        torch.autograd.backward([w for w, _ in later], [dw for _, dw in later])
