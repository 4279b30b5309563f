"""The deferred engine: the split backward that costs what a fused backward costs.

The Zero Bubble authors' Megatron code, Megatron-DeepSpeed's ZB-H1, DeepSeek's DualPipe and
TransformerEngine's delayed wgrad all split the backward the same way, and so does this engine:

* **B** is one ordinary autograd pass over the stage (``torch.autograd.backward``, freeing the
  graph as it goes). Every patched ``nn.Linear`` on the way (:mod:`zbpipe.engines.linear_patch`)
  computes its input gradient (and its bias gradient, a cheap sum) and, instead of the weight
  gradient, queues ``(weight, input, grad_output)`` in the :class:`WeightGradStore` of that
  (stage, microbatch). Everything else (norms, embeddings, custom ``autograd.Function``\\ s,
  other modules' weights, and a Linear whose weight is computed in the forward, a
  parametrization such as ``weight_norm``) gets its gradient in B, as in a fused backward.
* **W** runs the queued GEMMs ``grad_output^T @ input`` with no autograd graph and adds the
  results to ``.grad`` as a fused backward would (:mod:`zbpipe.engines.accumulate`: layout
  contract, DTensor placements; weights with ``register_post_accumulate_grad_hook`` hooks go
  through autograd itself, which fires them), a Linear applied twice summing its two products
  first as autograd's input buffer does.

The weight-gradient GEMMs are most of a transformer's weight-gradient work, and computing them
in W needs no second walk of the graph: B + W costs one fused backward plus one engine call.
:class:`DeferredEngine` is what the stage seam calls: it patches the stages' Linears, opens a
store per (stage, microbatch) around F and hands it to the Linears during B.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from .. import _compat as C
from ..memory.saved import Holder, Observer, SavedTensors
from .accumulate import accumulate, accumulate_hooked, add_product, as_param_grad, weight_grad
from .compiled_linear import route_compiled_linears
from .expert_grads import WeightProduct
from .expert_patch import StageExperts
from .fused import backward_full
from .linear_patch import StoreSlot, patch_linears, patched_linears, post_accumulate_hooks_parked
from .segmented import SegmentRecord, segmented_backward
from .weight_capture import CaptureState

if TYPE_CHECKING:
    from .protocol import Key

logger = logging.getLogger(__name__)

__all__ = ["DeferredEngine", "WeightGradStore"]


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

    __slots__ = ("deferring", "exact", "immediate", "parked", "capture", "_entries", "_observer")

    def __init__(self, observer: Observer | None = None, *, exact: bool = False) -> None:
        self.deferring = False
        #: may its Linears take the output hook (zbpipe.engines.weight_capture; None: never)
        self.capture: CaptureState | None = None
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
    def done(self) -> bool:
        return self._entries is None

    @property
    def num_gemms(self) -> int:
        """GEMMs :meth:`run` will compute (one per Linear call of the microbatch)."""
        return len(self._entries or ())

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


class DeferredEngine:
    """The deferred engine on one rank's stages (the :class:`~zbpipe.engines.SplitEngine` the
    seam calls): F opens a :class:`WeightGradStore` per key, B queues the Linears' weight GEMMs
    in it, W runs them.

    ``exact``: W adds each product as ``AccumulateGrad`` does, bit for bit a fused backward's
    (:class:`WeightGradStore`), and fused BWs stay torch's (no B then W through a store).
    """

    def __init__(self, *, exact: bool = False) -> None:
        self.name: Literal["deferred"] = "deferred"
        self.exact = exact
        #: B is an ordinary autograd pass, unsharded by FSDP2's own pre-backward hooks, and W's
        #: GEMMs read queued activations and gradients, not weights: a resharded block stays so
        self.unshards_for_backward = False
        #: B frees the graph as it goes (what W needs is queued), so it needs no holders
        self.uses_saved_holders = False
        #: every fused BW but a stage's first of the step may run as B then W at once: each GEMM
        #: accumulates into ``.grad`` inside itself, cheaper than torch's fused backward; exact
        #: keeps torch's (see ``StageSeam.assign``)
        self.bw_through_store = not exact
        self._slots: dict[int, StoreSlot] = {}
        self.capture = CaptureState()  # the output hook from a schedule's second step on
        self._linears: dict[int, list[nn.Module]] = {}
        #: the stages' patched MoE expert modules (zbpipe.engines.expert_patch)
        self._experts = StageExperts()
        self._stores: dict[Key, WeightGradStore] = {}  # opened by F, waiting for B
        self._pending: dict[Key, WeightGradStore] = {}  # B ran, waiting for W
        #: the AccumulateGrad nodes of compiled Linears' weights, kept alive with their pre-hooks
        self._accumulators: list[Any] = []
        #: B can run in segments between communication points (an overlapped pair's
        #: backward half): :meth:`backward_input_steps`
        self.segments_backward = True
        #: stages whose compiled Linears are not routed yet: routed at their first step, not
        #: here, because a trainer may still rebuild the parameters after building the schedule
        #: (torchtitan's ``to_empty`` swaps them, which a route's weak reference would refuse)
        self._unrouted: dict[int, nn.Module] = {}

    def attach(self, stages: Sequence[Any]) -> None:
        """Patch every Linear of ``stages`` to read its stage's slot, which holds a store only
        around a zbpipe F or B: elsewhere the Linears are ordinary ones."""
        for st in stages:
            slot = self._slots[st.stage_index] = StoreSlot()
            n = patch_linears(st.submod, slot)
            self._linears[st.stage_index] = patched_linears(st.submod)
            e = self._experts.attach(st.stage_index, st.submod, slot)
            self._unrouted[st.stage_index] = st.submod
            logger.debug(
                "zbpipe: stage %d: %d Linears, %d expert modules defer their W",
                st.stage_index,
                n,
                e,
            )

    def _route_compiled(self) -> None:
        """Route the weight GEMMs of the compiled Linears of stages not routed yet (their first
        step): the parameters are the ones training uses by then."""
        for idx, submod in self._unrouted.items():
            nodes = route_compiled_linears(submod, self._linears[idx])
            nodes += self._experts.route_compiled(idx, submod)
            self._accumulators.extend(nodes)
            logger.debug("zbpipe: stage %d: %d compiled Linears routed", idx, len(nodes))
        self._unrouted.clear()

    def claim_linears(self) -> None:
        """Point this rank's patched Linears at this engine's slots again (call per step).

        A second schedule built on the same modules takes their Linears over (``patch_linears``
        re-points them); without this, this schedule would silently stop deferring.
        """
        if self._unrouted:
            self._route_compiled()
        self.capture.step_begins()
        for idx, linears in self._linears.items():
            slot = self._slots[idx]
            if linears and linears[0].__dict__.get("_zbpipe_slot") is not slot:
                for lin in linears:
                    lin._zbpipe_slot = slot  # type: ignore[assignment]
        self._experts.claim(self._slots)

    def check_stages(self, owner: type, stages: Sequence[Any]) -> None:
        """Nothing to refuse: a compiled region's Linears defer their W too
        (:mod:`zbpipe.engines.compiled_linear`); its other weight gradients come in B."""

    def forward_scope(
        self, key: Key, meter: Observer | None, *, fused: bool
    ) -> AbstractContextManager[None]:
        """Around F of ``key``: open its store and put it in the stage's slot.

        ``fused``: its backward is a fused BW run as B then W at once, so each GEMM is computed
        and accumulated during B (:attr:`WeightGradStore.immediate`).
        """
        store = self._stores[key] = WeightGradStore(meter, exact=self.exact)
        store.immediate, store.capture = fused, self.capture
        return self._slot_holding(key[0], store)

    def backward_input(
        self,
        key: Key,
        outputs: Sequence[Any],
        output_grads: Sequence[Tensor | None] | None,
        inputs: Sequence[Any],
        params: Callable[[], list[Tensor]],
        saved: SavedTensors | None,
    ) -> tuple[Tensor | None, ...]:
        """B: one autograd pass with the Linears queueing their GEMMs (``params`` unused: W
        computes whatever weights the Linears used)."""
        store = self._pending[key] = self._stores.pop(key)  # clear() frees it if B fails
        # Activation checkpointing recomputes forwards inside this pass: they must reach the
        # same store (and the same autograd.Function) as the original forward did.
        linears = self._linears[key[0]]
        with (
            self._slot_holding(key[0], store),
            post_accumulate_hooks_parked(linears) as hooked,
            self._experts.parked(key[0]) as hooked_experts,
        ):
            # those weights' GEMMs wait for W, which fires the hooks
            store.parked = hooked | hooked_experts
            store.deferring = True
            try:
                grads = backward_full(outputs, output_grads, inputs)
            finally:
                store.deferring = False
        if saved is not None:  # B freed the graph; only the store's tensors remain
            saved.release_all()
        return grads

    def backward_input_steps(
        self,
        key: Key,
        record: SegmentRecord,
        outputs: Sequence[Any],
        output_grads: Sequence[Tensor | None] | None,
        inputs: Sequence[Any],
        saved: SavedTensors | None,
    ) -> Generator[None, None, tuple[Tensor | None, ...]]:
        """B of a key whose forward was cut at its communication points (``record``): the
        same pass as :meth:`backward_input`, one segment per call, yielding while each point's
        collective is in flight (:mod:`zbpipe.engines.segmented`)."""
        store = self._pending[key] = self._stores.pop(key)
        linears = self._linears[key[0]]
        with self._slot_holding(key[0], store), post_accumulate_hooks_parked(linears) as hooked:
            store.parked = hooked
            store.deferring = True
            try:
                grads = yield from segmented_backward(record, outputs, output_grads, inputs)
            finally:
                store.deferring = False
        if saved is not None:
            saved.release_all()
        return grads

    def backward_weight(self, key: Key) -> None:
        """W: run the GEMMs B queued for ``key``."""
        self._pending.pop(key).run()

    def pending_keys(self) -> list[Key]:
        return list(self._pending)

    def clear(self) -> None:
        """Drop every open and pending store without computing it."""
        for store in (*self._pending.values(), *self._stores.values()):
            store.release()
        self._pending.clear()
        self._stores.clear()

    def _slot_holding(self, stage_index: int, store: WeightGradStore) -> _SlotHolding:
        return _SlotHolding(self._slots[stage_index], store)


class _SlotHolding:
    """``with``: the stage's slot holds ``store``; empty again afterwards, whatever happened.

    A plain object, not a generator: it runs around every F and B of a deferred key.
    """

    __slots__ = ("_slot", "_store")

    def __init__(self, slot: StoreSlot, store: WeightGradStore) -> None:
        self._slot, self._store = slot, store

    def __enter__(self) -> None:
        self._slot.store = self._store

    def __exit__(self, *exc: object) -> None:
        self._slot.store = None
