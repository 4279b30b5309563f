"""The fused backward of one stage, returning its input gradients.

The deferred engine's B is this pass (its Linears queue their weight GEMMs on the way), and it is
the reference the graph engine's B + W must equal. Both engines read a stage's outputs and their
gradients the same way: :func:`valid_outputs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def backward_full(
    outputs: Sequence[Any], output_grads: Sequence[Tensor | None] | None, inputs: Sequence[Any]
) -> tuple[Tensor | None, ...]:
    """BW, the fused reference: ``torch.autograd.backward`` (parameters accumulate as usual).

    Returns the gradients of ``inputs``; an input's own ``.grad`` is left as it was.
    """
    outs, grads = valid_outputs(outputs, output_grads)
    result: list[Tensor | None] = [None] * len(inputs)
    saved: dict[int, Tensor | None] = {}
    captured: dict[int, Tensor] = {}
    handles = []
    for i, x in enumerate(inputs):
        if not (isinstance(x, Tensor) and x.requires_grad):
            continue
        if x.grad_fn is None:  # a leaf: read what autograd accumulates, then restore .grad
            saved[i], x.grad = x.grad, None
        else:  # a non-leaf: observe the gradient on its way to the earlier graph

            def hook(gr: Tensor, i: int = i) -> None:
                captured[i] = gr if i not in captured else captured[i] + gr

            handles.append(x.register_hook(hook))  # type: ignore[no-untyped-call]
    try:
        if outs:
            torch.autograd.backward(outs, grads)
    finally:
        for h in handles:
            h.remove()
        for i, old in saved.items():
            result[i], inputs[i].grad = inputs[i].grad, old
    for i, gr in captured.items():
        result[i] = gr
    return tuple(result)


def valid_outputs(
    outputs: Sequence[Any], output_grads: Sequence[Tensor | None] | None
) -> tuple[list[Tensor], list[Tensor]]:
    """Outputs that carry a gradient, with their gradients (ones when ``output_grads`` is None)."""
    if output_grads is not None and len(output_grads) != len(outputs):
        raise ValueError(
            f"output_grads has {len(output_grads)} entries for {len(outputs)} outputs: pass one "
            "gradient (or None) per output, or output_grads=None for a scalar loss"
        )
    outs, grads = [], []
    for i, t in enumerate(outputs):
        if not isinstance(t, Tensor) or not t.requires_grad:
            continue
        if output_grads is None:
            grads.append(torch.ones_like(t))
        elif (grad := output_grads[i]) is None:  # an unused output: no gradient flows from it
            continue
        else:
            grads.append(grad)
        outs.append(t)
    return outs, grads
