"""The deferred engine's store: the weight-gradient GEMMs one (stage, microbatch)'s B queued.

:class:`WeightGradStore` is what a patched Linear (:mod:`zbpipe.engines.weight_capture`), an
expert module (:mod:`zbpipe.engines.expert_patch`) or compiled code
(:mod:`zbpipe.engines.compiled_linear`) finds in its stage's slot during a zbpipe F and B, and
what W runs (:mod:`zbpipe.engines.deferred` opens one per key). Where the native capture runs
(:mod:`zbpipe.engines.native`), the Linears' entries wait in its C++ queue instead, which W
runs first: the common case added there, the rest handed back here in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _compat as C
from ..memory.saved import Holder, Observer
from .accumulate import accumulate, accumulate_hooked, add_product, as_param_grad, weight_grad
from .expert_grads import WeightProduct
from .weight_capture import CaptureState

__all__ = ["Product", "WeightGradStore"]


class WeightGradStore:
    """The weight-gradient GEMMs queued by one (stage, microbatch)'s B; :meth:`run` them once.

    ``deferring`` is True only while zbpipe's B runs: a patched Linear's backward queues its
    GEMM then, and computes it on the spot at any other time (a fused backward, a second
    backward with ``create_graph=True``). ``observer`` (a :class:`zbpipe.memory`
    meter) is told the bytes the queue keeps alive until W.

    ``exact=False`` (the default) lets a GEMM whose weight already has a gradient accumulate
    into it in the same call (``grad.addmm_(g^T, x)``, as Megatron's gradient-accumulation
    fusion does): no temporary the size of the weight, no second pass over ``.grad``. The sum is
    the same up to rounding (the GEMM adds ``.grad`` inside its blocked inner loop).
    ``exact=True`` computes each product apart and adds it the way ``AccumulateGrad`` does, so
    the bits equal a fused backward's (``ScheduleZBH1(exact=True)`` asks for this).
    """

    __slots__ = (
        "_deferring",
        "exact",
        "immediate",
        "parked",
        "capture",
        "native",
        "_entries",
        "_observer",
    )

    def __init__(self, observer: Observer | None = None, *, exact: bool = False) -> None:
        self._deferring = False
        #: may its Linears take the output hook (zbpipe.engines.weight_capture; None: never)
        self.capture: CaptureState | None = None
        #: the native capture's queue (zbpipe.engines.native: its Linears' entries, on the C++
        #: side, run first in W), or None
        self.native: Any = None
        #: True: accumulate as a fused backward does, bit for bit (see :meth:`run`)
        self.exact = exact
        #: True (a fused BW, W right after B): each GEMM is computed and accumulated at once, in
        #: B, instead of being queued: nothing is held, the operands are still hot, and
        #: ``.grad`` sees each microbatch as a fused backward's would (FSDP2's post-backward
        #: upcasts each). Not for the weights in :attr:`parked`
        self.immediate = False
        #: ids of the weights whose post-accumulate hooks B parked: always queued, so W fires them
        self.parked: frozenset[int] = frozenset()
        # (weight, x2d, g2d, dtype or WeightProduct, holders for the observer), each set to None
        # once computed
        self._entries: list[Any] | None = []
        self._observer = observer

    @property
    def deferring(self) -> bool:
        return self._deferring

    @deferring.setter
    def deferring(self, value: bool) -> None:
        self._deferring = value
        if self.native is not None:
            self.native.deferring = value

    @property
    def done(self) -> bool:
        return self._entries is None

    @property
    def num_gemms(self) -> int:
        """GEMMs :meth:`run` will compute (one per Linear call of the microbatch)."""
        return len(self._entries or ()) + (0 if self.native is None else len(self.native))

    def put(self, weight: Tensor, x2d: Tensor, g2d: Tensor, dtype: Product) -> None:
        """Queue ``weight``'s gradient ``g2d^T @ x2d`` (in ``dtype`` under autocast), or, for
        a :class:`~zbpipe.engines.expert_grads.WeightProduct` (MoE experts' 3-D weights), the
        product it names."""
        entries = self._entries
        if entries is None:
            raise RuntimeError("zbpipe: a weight gradient was queued after its W ran")
        if self.immediate and not self.exact and id(weight) not in self.parked:  # not keeps()
            dw = _add_product(weight, x2d, g2d, dtype)
            if dw is not None:  # post-accumulate hooks B did not park: autograd fires them
                accumulate_hooked([(weight, dw)])
            return
        held = None
        if self._observer is not None:
            held = (
                Holder(x2d, self._observer, hold=False),
                Holder(g2d, self._observer, hold=False),
            )
        entries.append((weight, x2d, g2d, dtype, held))

    def keeps(self, weight: Tensor) -> bool:
        """Whether :meth:`put` keeps its operands for W (else it computes the GEMM at once)."""
        return not self.immediate or self.exact or id(weight) in self.parked

    def run(self) -> None:
        """W: compute every queued GEMM and accumulate the results into the weights' ``.grad``."""
        entries = self._entries
        if entries is None:
            raise RuntimeError(
                "zbpipe: WeightGradStore.run() was called twice: the weight pass of a microbatch "
                "runs once"
            )
        self._entries = None  # an exception below still leaves nothing queued
        if self.native is not None:  # its common case added in C++, the rest in order, first
            entries[:0] = [(*e, None) for e in self.native.run()]
        if not self.exact:
            _run_accumulating(entries)
            return
        # A weight's products are summed in queue order (a Linear applied twice: summed first,
        # as autograd's input buffer sums the two before AccumulateGrad) and accumulated as soon
        # as its last product is in; each entry's activations are dropped right after its GEMM.
        # So W holds at most one pending sum per weight used twice, not a copy of every gradient.
        left: dict[int, int] = {}
        for weight, *_ in entries:
            left[id(weight)] = left.get(id(weight), 0) + 1
        partial: dict[int, Tensor] = {}
        later = []
        with torch.no_grad():
            for i, (weight, x, g, dtype, held) in enumerate(entries):
                entries[i] = None
                dw = _product(weight, x, g, dtype)
                del x, g
                if held is not None:
                    for h in held:
                        h.release()
                key = id(weight)
                if key in partial:
                    dw = partial.pop(key) + dw
                left[key] -= 1
                if left[key]:
                    partial[key] = dw
                # A leaf without post-accumulate hooks takes its sum as AccumulateGrad would
                # (stolen when it has the weight's layout, else copied; later sums add in place):
                # same bits, and no copy, which handing the engine a tensor Python still
                # references would force. Weights with hooks go through autograd itself.
                elif not C.has_post_accumulate_grad_hooks(weight):
                    accumulate(weight, dw)
                else:
                    later.append((weight, dw))
        accumulate_hooked(later)

    def release(self) -> None:
        """Drop whatever is still queued (a failed step) without computing it."""
        for *_, held in self._entries or ():
            for h in held or ():
                h.release()
        self._entries = None
        if self.native is not None:
            self.native.clear()


def _run_accumulating(entries: list[Any]) -> None:
    """W with each GEMM accumulating into ``.grad`` where it can (``WeightGradStore.exact=False``).

    A weight used twice takes its products one at a time (the first one stolen, the next added
    by the GEMM itself): the same sum as autograd's, in another order.
    """
    later = []
    with torch.no_grad():
        for i, (weight, x, g, dtype, held) in enumerate(entries):
            entries[i] = None
            dw = _add_product(weight, x, g, dtype)
            if dw is not None:
                later.append((weight, dw))
            del x, g
            if held is not None:
                for h in held:
                    h.release()
    accumulate_hooked(later)


#: what an entry's GEMM is: a Linear's ``g^T @ x`` in this dtype (None: the operands'), or an
#: expert weight's product
Product = torch.dtype | None | WeightProduct


def _add_product(weight: Tensor, x: Tensor, g: Tensor, spec: Product) -> Tensor | None:
    if isinstance(spec, WeightProduct):
        return spec.add(weight, x, g)
    return add_product(weight, x, g, spec)


def _product(weight: Tensor, x: Tensor, g: Tensor, spec: Product) -> Tensor:
    if isinstance(spec, WeightProduct):
        return spec.grad(weight, x, g)
    return as_param_grad(weight, weight_grad(g, x, spec, weight.dtype))
