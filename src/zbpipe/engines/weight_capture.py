"""How a patched Linear hands its weight GEMM to W: natively, by a hook, or by a Function.

A deferred Linear (:mod:`zbpipe.engines.linear_patch`) must, during a zbpipe B, compute its
input and bias gradients as an ordinary Linear does and queue ``(weight, input,
grad_output)`` in its microbatch's store instead of the weight gradient. Three captures do
that, with bitwise the same gradients (tests/engines/test_weight_capture.py,
tests/engines/test_native_capture.py):

* **the native capture** (:mod:`zbpipe.engines.native`, where it is built: a C++ compiler and
  ``ZBPIPE_NATIVE`` not ``off``): the Function below in C++, its queue on the C++ side, for
  plain tensors outside functorch transforms (autocast, saved-tensor hooks and
  ``create_graph`` included). No Python runs in B.
* **the output hook** (without the native capture, :func:`deferred_linear` picks it wherever
  it can, from a schedule's second step on): the forward is ``F.linear(x, weight.detach(),
  bias)``, so autograd's own C++ nodes compute the input and bias gradients in B and never the
  weight's; a tensor pre-hook on the output's
  ``grad_fn`` (:func:`zbpipe._compat.on_output_grad`, ``register_hook`` without its handle)
  receives the output gradient and queues the GEMM. The input is held by the hook from F to B,
  as autograd would save it (its version is checked as autograd checks a saved tensor's), and
  released as soon as the hook has run.
* **the autograd.Function** :class:`_LinearFunction` (forward and backward in Python), for what
  the hook cannot do as the Function does: autocast (the queued operands take autocast's
  dtype), saved-tensor hooks (activation checkpointing must recompute the input, not find it
  held; zbpipe's memory meter counts saved tensors through them), tensor subclasses (DTensor),
  an input that needs no gradient (the output would carry none to hook), a weight with
  ``register_hook`` hooks.

Why not the Function everywhere: on host-bound shapes (one rank, hidden 64, 4 Llama blocks, 20
Linears a microbatch) the Function costs about 20 us more per Linear call than a plain Linear
inside a step, the hook about 9, the native capture about 1; a ``torch.library`` op with a
registered autograd formula, or the compiled path's Function plus its weight op, cost more
than the Function (a Python autograd formula either way, plus the op's dispatch);
docs/design/backward.md has the table (benchmarks/linear_capture.py).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import (
    any_autocast_enabled,
    autograd_function_apply,
    functorch_transforms_active,
    grad_hook_dict,
    has_grad_hooks,
    on_output_grad,
    saved_tensor_hooks,
    tensor_version,
)
from .accumulate import accumulate_hooked, weight_grad

__all__ = ["WeightGradQueue", "deferred_linear"]

# module globals, read once per Linear call
_grad_enabled = torch.is_grad_enabled
_linear = F.linear
_partial = functools.partial
_Parameter = nn.Parameter


class CaptureState:
    """How one engine's Linears capture: ``native`` (the C++ capture's module, or None) and,
    without it, whether they may take the output hook (``fast``).

    The hook cannot carry second-order gradients through a weight (its forward used a detached
    weight): a backward with ``create_graph=True`` over it, which only a model that takes a
    gradient inside its own forward runs (a gradient penalty), would get a wrong input gradient.
    So the hook waits for a schedule's second step (:meth:`step_begins`), and never comes once
    such a backward was seen: the first step's Linears take the Function, which notes one
    (``create_graph_seen``); a later one over a hooked Linear raises (:func:`_queue_captured`).
    The native capture has none of these limits (it is the Function, in C++). ``source`` (a
    :class:`~zbpipe.engines.native.NativeSource`) is asked for it at each step's start: a
    build in the background is taken up at the first step after it finished.
    """

    __slots__ = ("fast", "create_graph_seen", "native", "_steps", "_source")

    def __init__(self, fast: bool = False, source: Any = None) -> None:
        self.fast = fast
        self.create_graph_seen = False
        self._steps = 0
        self._source = source
        self.native: Any = None if source is None else source.poll()

    def step_begins(self) -> None:
        """A step begins: the native capture if there is one now; else the hook from the
        second step on, unless create_graph was seen."""
        self._steps += 1
        if self.native is None and self._source is not None:
            self.native = self._source.poll()
            if self.native is None:
                self._source.step_begins()  # a build under way: said in the step's log, once
        self.fast = self._steps > 1 and not self.create_graph_seen

    def saw_create_graph(self) -> None:
        self.create_graph_seen = True
        self.fast = False


class WeightGradQueue(Protocol):
    """What a patched Linear asks of the store in its slot
    (:class:`~zbpipe.engines.deferred.WeightGradStore`, which imports this module's users: a
    protocol here, not an import there, keeps the files out of an import circle)."""

    deferring: bool
    #: its engine's capture state: whether the Linears may take the output hook (None: never)
    capture: CaptureState | None
    #: the native capture's queue for this store (``zbpipe.engines.native``), or None
    native: Any

    def put(self, weight: Tensor, x2d: Tensor, g2d: Tensor, dtype: torch.dtype | None) -> None:
        """Queue ``weight``'s gradient GEMM ``g2d.T @ x2d`` for W."""


def _deferrable(weight: Tensor) -> bool:
    """Whether W may compute ``weight``'s gradient. Not: a weight computed in the forward (a
    parametrization such as weight_norm: B's autograd pass walks its small graph and frees it,
    so W could not reach the parameters behind it); a weight with ``register_hook`` hooks
    (autograd calls them with the gradient B computes, which a deferred GEMM would leave None).
    Complex Linears never get here: ``DeferredLinear`` runs them as plain ``F.linear``."""
    return weight.grad_fn is None and not has_grad_hooks(weight)


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` whose weight gradient waits in a ``WeightGradStore`` during B: the general
    capture (autocast, checkpointing, tensor subclasses; :func:`deferred_linear` says when).

    Runs once per Linear call in F and in B, so it is written for speed: one context attribute,
    no reshape of 2-D tensors (docs/design/backward.md has the per-call costs).
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradQueue
    ) -> Tensor:
        device = x.device.type
        # Autocast casts inside F.linear; the backward (which autograd runs without autocast)
        # must compute in the same dtype, then cast back as autocast's _to_copy backward would.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        x_dtype = x.dtype
        if dtype is not None and x_dtype != dtype and x.is_floating_point():
            x = x.to(dtype)  # saved (and held until W) at the size autocast's own Linear saves
        ctx.save_for_backward(x, weight)
        # (store, the weight W accumulates into, whether W may compute it, autocast dtype,
        # input dtype, bias dtype). The weight is kept apart from the saved one: non-reentrant
        # activation checkpointing hands B a detached copy from its recompute in place of each
        # saved tensor. Some weights get their gradient in B, like a fused backward's
        # (:func:`_deferrable`).
        ctx.state = (
            store,
            weight,
            _deferrable(weight),
            dtype,
            x_dtype,
            None if bias is None else bias.dtype,
        )
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        store, leaf_weight, deferrable, dtype, x_dtype, bias_dtype = ctx.state
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        g2d = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = grad_out.matmul(weight if dtype is None else weight.to(dtype))
            if grad_x.dtype != x_dtype:
                grad_x = grad_x.to(x_dtype)
        if need_b:
            grad_b = g2d.sum(0)
            if grad_b.dtype != bias_dtype:
                grad_b = grad_b.to(bias_dtype)
        if need_w:
            x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if deferrable and store.deferring and not torch.is_grad_enabled():
                store.put(leaf_weight, x2d, g2d, dtype)  # W computes it
            else:  # a fused backward, or create_graph=True: an ordinary Linear
                if torch.is_grad_enabled() and store.capture is not None:
                    store.capture.saw_create_graph()  # no output hook for these Linears
                grad_w = weight_grad(g2d, x2d, dtype, weight.dtype)
        return grad_x, grad_w, grad_b, None


#: ``_LinearFunction.apply`` entering torch's C++ directly (``_compat.autograd_function_apply``):
#: called once per Linear in every F of a deferred microbatch
_apply_linear = autograd_function_apply(_LinearFunction)


def deferred_linear(input: Tensor, weight: Tensor, bias: Tensor | None, store: Any) -> Tensor:
    """``F.linear(input, weight, bias)`` whose weight GEMM goes to ``store`` in a zbpipe B.

    The native capture where it is built (plain tensors, no weight hook, no functorch), else
    the output hook where it does what the Function does (the module docstring), else the
    Function. Checked per call (a few C calls): autocast, checkpointing and grad mode can
    change between the Linears of one forward.
    """
    native = store.native
    if (
        native is not None
        and type(weight) is _Parameter  # not a DTensor or another tensor subclass
        and type(input) is Tensor
        and not grad_hook_dict(weight)  # the Function computes such a weight's gradient in B
        and not functorch_transforms_active()
    ):
        out: Tensor = native.linear(input, weight, bias)
        return out
    capture = store.capture
    if (
        capture is not None
        and capture.fast
        and type(weight) is _Parameter  # not a DTensor or another tensor subclass
        and type(input) is Tensor
        and weight.requires_grad
        and input.requires_grad
        and _grad_enabled()
        and not grad_hook_dict(weight)
        and not any_autocast_enabled()
        and saved_tensor_hooks() is None
        and not functorch_transforms_active()
    ):
        out = _linear(input, weight.detach(), bias)
        held = [weight, input, tensor_version(input)]
        on_output_grad(out, _partial(_queue_captured, store, held))
        return out
    applied: Tensor = _apply_linear(input, weight, bias, store)
    return applied


def _queue_captured(store: Any, held: list[Any], grad: Tensor) -> None:
    """The output hook: queue ``weight``'s GEMM for W (in a zbpipe B) with the output gradient.

    ``held``: [weight, input, the input's version in F], emptied here so the input is not kept
    by a graph node that outlives B (a stage output held for the user keeps its ``grad_fn``).
    """
    weight, x, version = held
    held.clear()
    if tensor_version(x) != version:
        raise RuntimeError(
            "zbpipe: the input of a deferred nn.Linear was modified by an in-place operation "
            f"after the Linear used it (version {version}, now {tensor_version(x)}), so its "
            "weight gradient would be wrong: make the in-place operation out-of-place (as "
            "autograd asks of a tensor it saved)"
        )
    g2d = grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if _grad_enabled():  # create_graph=True: the input gradient lacks the weight's part
        if store.capture is not None:
            store.capture.saw_create_graph()
        raise RuntimeError(
            "zbpipe: a backward with create_graph=True (a gradient taken inside the model's "
            "forward, such as a gradient penalty) ran over a deferred nn.Linear that took the "
            "deferred engine's fast capture, which carries no second-order gradient through its "
            "weight. From the next forward on this schedule's Linears use the general capture, "
            "which does: run the step again (a schedule's first step always uses the general "
            "capture, so a model that does this in every step never gets here), or build the "
            "schedule with split='graph'"
        )
    if store.deferring:
        store.put(weight, x2d, g2d, None)  # W computes it
    else:
        # Not zbpipe's B (a graph built in a zbpipe F, backwarded elsewhere): the gradient now,
        # added by autograd (its hooks fire), as an ordinary Linear's would be.
        accumulate_hooked([(weight, weight_grad(g2d, x2d, None, weight.dtype))])
