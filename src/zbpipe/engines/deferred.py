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

from torch import Tensor, nn

from ..memory.saved import Observer, SavedTensors
from .compiled_linear import route_compiled_linears
from .expert_patch import StageExperts
from .fused import backward_full
from .linear_patch import (
    SlotHolding,
    StoreSlot,
    patch_linears,
    patched_linears,
    post_accumulate_hooks_parked,
)
from .native import source as native_source
from .segmented import SegmentRecord, segmented_backward
from .weight_capture import CaptureState
from .weight_store import WeightGradStore

if TYPE_CHECKING:
    from .protocol import Key

logger = logging.getLogger(__name__)

__all__ = ["DeferredEngine", "WeightGradStore"]


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
        #: the native capture where it is built (ZBPIPE_NATIVE), else the output hook from a
        #: schedule's second step on
        self.capture = CaptureState(source=native_source())
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
        if self.capture.native is not None and meter is None:  # a meter counts Python's queue
            store.native = self.capture.native.Queue(fused, self.exact)
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
        with (
            self._slot_holding(key[0], store),
            post_accumulate_hooks_parked(linears) as hooked,
            self._experts.parked(key[0]) as hooked_experts,
        ):
            store.parked = hooked | hooked_experts  # as backward_input's: fired once, in W
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

    def _slot_holding(self, stage_index: int, store: WeightGradStore) -> SlotHolding:
        return SlotHolding(self._slots[stage_index], store)
