"""The stage seam: everything one compute action does to a torch ``PipelineStage``.

Both runtimes (:mod:`zbpipe.schedules.runtime` for planned schedules, :mod:`zbpipe.continuous` for
the flush-free one) wait for their receives and post their sends themselves, then call this seam for
the compute, so F, B (with either engine), W and BW are written once:

* **F**: :meth:`StageSeam.forward` wraps the stage's forward. It owns what the forward saves
  (:mod:`zbpipe.memory.saved`) when the engine or a memory meter needs it, and opens the engine's
  scope for a microbatch whose backward runs through it (the deferred engine's
  :class:`~zbpipe.engines.deferred.WeightGradStore`). :meth:`~StageSeam.hand_forward` passes the
  output to a local next stage (V placement: no send).
* **B**: :meth:`StageSeam.backward_input` takes the stage output and its gradient (or the
  loss), runs the engine's input pass, fills the stage's ``bwd_cache`` for the send, frees what
  only B needed, and hands the input gradient to a local previous stage.
* **W**: :meth:`StageSeam.backward_weight` runs the pending weight pass, then frees what it held.
* **BW**: :meth:`StageSeam.full_backward`: torch's fused backward, or (an engine whose
  ``bw_through_store`` says so, every BW but a stage's first of the step) the engine's B with
  each weight GEMM accumulated at once.

A stage built with torch's ``dw_builder`` brings its own weight pass, so zbpipe's engines stay
out of it: its B is torch's ``backward_one_chunk(full_backward=False)`` (the stage's ordinary
autograd backward, then ``dw_builder()`` kept for W) and its W runs that runner, exactly as
torch's own runtime does. Before any backward, the seam checks that every stage output that
requires grad got a gradient (:func:`check_output_grads`).

The engine (:mod:`zbpipe.engines`; docs/design/backward.md says when each is right) is an object
with one protocol, :class:`~zbpipe.engines.SplitEngine`: the seam never asks which one it holds.
Keys are ``(stage_index, microbatch)``, the microbatch being whatever index the stage's caches use
(the step's for planned schedules, a global one for continuous).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from .. import _compat as C
from ..engines import Key, SplitEngine
from ..engines.segmented import SegmentRecord
from ..memory.probe import KeyBytes, MemoryProbe, inputs_of
from ..memory.saved import (
    Observer,
    SavedTensors,
    SliceCounting,
    count_all_until_freed,
    input_storages,
    param_storages,
)
from .stage_checks import check_output_grads
from .stage_checks import prepare_fsdp as _prepare_fsdp

logger = logging.getLogger(__name__)

_NO_SCOPE = contextlib.nullcontext()


class _EveryKey:
    """``split_keys`` of a runtime whose every backward is split (the continuous schedule)."""

    def __contains__(self, key: object) -> bool:
        return True


EVERY_KEY: Container[Key] = _EveryKey()


class StageSeam:
    """Runs F, B, W and BW of this rank's stages with one split-backward ``engine``.

    ``split_keys``: the ``(stage, microbatch)`` keys whose backward the plan splits into B and
    W; ``store_bw_keys``: the keys whose fused BW runs as the engine's B then W at once
    (:meth:`assign` fills both from a rank's order). Other BWs are torch's fused backward, which
    needs neither the engine nor early release.
    """

    def __init__(self, stages: Sequence[Any], engine: SplitEngine) -> None:
        self.engine = engine
        self.stages = {st.stage_index: st for st in stages}
        #: stages built with torch's ``dw_builder``: B and W are torch's, the runner its W
        self.own_w: frozenset[int] = frozenset(
            st.stage_index for st in stages if C.has_own_weight_pass(st)
        )
        self.split_keys: Container[Key] = ()
        self.store_bw_keys: Container[Key] = ()
        self.meter: Observer | None = None
        #: set while ``costs="profile"`` measures what each microbatch holds (zbpipe.memory.probe)
        self.probe: MemoryProbe | None = None
        self._saved: dict[Key, SavedTensors] = {}
        self._observers: dict[Key, KeyBytes] = {}  # per microbatch, while probing
        #: keys whose forward is cut at the communication points, their B run in segments
        #: (the backward halves of overlapped pairs: :mod:`zbpipe.engines.segmented`)
        self.cut_keys: Container[Key] = ()
        #: the record of the forward now cutting (None outside such a forward)
        self.recording: SegmentRecord | None = None
        self._records: dict[Key, SegmentRecord] = {}
        engine.attach(stages)

    def assign(self, actions: Iterable[Any]) -> None:
        """Set :attr:`split_keys` and :attr:`store_bw_keys` from this rank's compute actions.

        With an engine whose ``bw_through_store`` says so (the deferred one, not ``exact``),
        every BW but a stage's first backward of the step runs as B then W: W adds into the
        ``.grad`` the first backward created inside its GEMMs, where torch's fused backward
        writes a weight-sized product and adds it in a second pass. A stage's first backward
        usually finds no ``.grad`` (``zero_grad`` sets them to None), so both ways create it
        alike and torch's, with no Python per Linear, is kept.
        """
        split: set[Key] = set()
        store_bw: set[Key] = set()
        seen: set[int] = set()
        fast_bw = self.engine.bw_through_store
        for a in actions:
            key = (a.stage, a.microbatch)
            if a.kind == "B":
                split.add(key)
            elif a.kind == "BW" and fast_bw and a.stage in seen and a.stage not in self.own_w:
                store_bw.add(key)
            if a.kind in ("B", "BW"):
                seen.add(a.stage)
        self.split_keys, self.store_bw_keys = split, store_bw

    def claim_linears(self) -> None:
        """Take this rank's stages back from another schedule built on the same modules (call
        per step): the deferred engine points their patched Linears at its slots again."""
        self.engine.claim_linears()

    # ------------------------------------------------------------------ F
    def forward(self, stage: Any, mb: int, given: Any = ()) -> AbstractContextManager[None]:
        """Around the forward of ``stage`` on ``mb`` (and its loss, on the last stage).

        ``given``: what the caller handed in for this microbatch (the first stage's inputs, the
        last stage's target): slices of batches the caller holds for the whole step, each
        counted as its own slice (:func:`~zbpipe.memory.saved.input_storages`).

        Runs once per F: a forward that needs no scope (no saved-tensor holders, no engine)
        gets a shared no-op, one that needs only the engine's gets that scope itself.
        """
        key = (stage.stage_index, mb)
        split = (
            stage.has_backward
            and stage.stage_index not in self.own_w  # torch runs its B and W (no store)
            and (key in self.split_keys or key in self.store_bw_keys)
        )
        observer = self.meter
        if self.probe is not None and stage.has_backward and self.probe.watches(mb):
            observer = self._observers[key] = KeyBytes(self.meter, inputs_of(stage, mb, given))
        holders = stage.has_backward and (
            (split and self.engine.uses_saved_holders) or observer is not None
        )
        if split and key in self.cut_keys:
            return self._forward_cut(stage, key, given, observer, holders)
        if holders:
            return self._forward_holding(stage, key, given, observer, split)
        if split:
            return self.engine.forward_scope(key, observer, fused=key in self.store_bw_keys)
        return _NO_SCOPE

    @contextlib.contextmanager
    def _forward_cut(
        self, stage: Any, key: Key, given: Any, observer: Observer | None, holders: bool
    ) -> Iterator[None]:
        """:meth:`forward` of a key whose B runs in segments: the communication points cut the
        graph (:attr:`recording`), their record kept for B."""
        record = SegmentRecord(where=f"stage {key[0]} microbatch {key[1]}")
        with contextlib.ExitStack() as scope:
            if holders:
                scope.enter_context(self._forward_holding(stage, key, given, observer, True))
            else:
                scope.enter_context(self.engine.forward_scope(key, observer, fused=False))
            self.recording = record
            record.open()
            try:
                yield
            finally:
                self.recording = None
                record.finish()
        self._records[key] = record

    @contextlib.contextmanager
    def _forward_holding(
        self, stage: Any, key: Key, given: Any, observer: Observer | None, split: bool
    ) -> Iterator[None]:
        """:meth:`forward` with the saved-tensor holders installed (and the engine's scope)."""
        skip = param_storages(stage.submod.parameters())
        slices = input_storages(given)
        if observer is not None and slices:  # the engine's reports of the batch: as the slice
            observer = SliceCounting(observer, slices)
        saved = self._saved[key] = SavedTensors(observer, skip, slices)
        with contextlib.ExitStack() as scope:
            scope.enter_context(saved.hooks())
            if split:
                fused = key in self.store_bw_keys
                scope.enter_context(self.engine.forward_scope(key, observer, fused=fused))
            yield

    def hand_forward(self, stage: Any, output: Any, mb: int) -> None:
        """Hand the output on: V placement's local next stage gets it without a send.

        A meter counts the output of every stage but the last from here until its storage is
        freed: torch's stage keeps it until B, and a send or the local next stage may keep it
        longer.
        """
        key = (stage.stage_index, mb)
        if not stage.is_last:
            self._count_held(key, output)
        self._probe("F", key)
        nxt = self.stages.get(stage.stage_index + 1)
        if nxt is not None:
            nxt.set_local_fwd_input(output, mb)

    # ------------------------------------------------------------------ B
    def backward_input(
        self,
        stage: Any,
        mb: int,
        loss: torch.Tensor | None,
        params: Callable[[], list[torch.Tensor]] | None = None,
    ) -> None:
        """B of ``stage`` on ``mb``: input gradients into ``bwd_cache``, the weight pass pending.

        ``loss``: the microbatch's loss on the last stage (else the received output gradients
        are used). ``params``: the weights W computes (default: the stage module's parameters,
        read after FSDP unsharded them, when the engine asks: the graph engine does, the
        deferred one queues whatever weights its Linears used).
        """
        for _ in self.backward_input_steps(stage, mb, loss, params):
            pass  # a B cut at communication points, run alone: each collective waited at once

    def backward_input_steps(
        self,
        stage: Any,
        mb: int,
        loss: torch.Tensor | None,
        params: Callable[[], list[torch.Tensor]] | None = None,
    ) -> Iterator[None]:
        """:meth:`backward_input` as a generator: it yields while a collective of a key whose
        forward was cut at its communication points is in flight (the backward half of an
        overlapped pair); any other B runs whole at the first step."""
        key = (stage.stage_index, mb)
        if stage.stage_index in self.own_w:
            self._torch_backward(stage, mb, loss, full=False, last_backward=False)
            return
        stage_output, input_values = C.forward_cache(stage).pop(mb)
        if stage.is_last:
            outputs, output_grads = (loss,), None
        else:
            outputs, output_grads = stage_output, C.received_grads(stage, mb)
            check_output_grads(stage, mb, outputs, output_grads)
        # The graph engine collects the unsharded parameters (the graph's leaves) before B; the
        # deferred B is an ordinary autograd pass, unsharded by FSDP2's own pre-backward hooks.
        _prepare_fsdp(stage, unshard=self.engine.unshards_for_backward)
        record = self._records.pop(key, None)
        if record is not None:
            grads = yield from self.engine.backward_input_steps(
                key, record, outputs, output_grads, input_values, self._saved.get(key)
            )
        else:
            grads = self.engine.backward_input(
                key,
                outputs,
                output_grads,
                input_values,
                params if params is not None else lambda: _trainable(stage),
                self._saved.get(key),
            )
        if not stage.is_first:
            C.input_grad_cache(stage)[mb] = tuple(grads[: C.num_stage_inputs(stage)])
        if stage.is_last and not stage.is_first:
            # The outputs are only kept to be merged for the user: free their graph now.
            for t in stage_output:
                if isinstance(t, torch.Tensor) and not C.is_view(t):
                    t.detach_()
        self._probe("B", key)
        self._hand_backward(stage, mb)
        self._drop_handed_grads(stage.stage_index, mb)

    # ------------------------------------------------------------------ W
    def backward_weight(self, stage: Any, mb: int, last_backward: bool = False) -> None:
        """W of ``stage`` on ``mb``: accumulate the weight gradients B left pending.

        ``last_backward``: this is the stage's last backward pass of the step (torch passes it
        to a ``dw_builder`` stage's weight pass; zbpipe's engines do not need it).
        """
        key = (stage.stage_index, mb)
        if stage.stage_index in self.own_w:
            stage.backward_weight_one_chunk(mb, last_backward=last_backward)  # runs dw_runner[mb]
            self.release(key)
            return
        # The graph engine re-enters the graph (a weight-norm's gradient reads the weight); the
        # deferred one reads only queued activations, so a resharded FSDP block stays sharded.
        _prepare_fsdp(stage, unshard=self.engine.unshards_for_backward)
        self.engine.backward_weight(key)
        self.release(key)

    # ------------------------------------------------------------------ BW
    def full_backward(
        self, stage: Any, mb: int, loss: torch.Tensor | None, last_backward: bool
    ) -> None:
        """BW of ``stage`` on ``mb``: torch's fused backward, or B then W (:meth:`assign`)."""
        if (stage.stage_index, mb) in self.store_bw_keys:  # F told the engine (forward_scope)
            self.backward_input(stage, mb, loss)
            self.backward_weight(stage, mb)
            return
        self._torch_backward(stage, mb, loss, full=True, last_backward=last_backward)

    def _torch_backward(
        self, stage: Any, mb: int, loss: torch.Tensor | None, full: bool, last_backward: bool
    ) -> None:
        """torch's ``backward_one_chunk``: fused (``full``), or a ``dw_builder`` stage's B."""
        if not stage.is_last:
            stage_output, _ = C.forward_cache(stage)[mb]
            check_output_grads(stage, mb, stage_output, C.received_grad_buffers(stage, mb))
        stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last_backward)
        if full:
            self.release((stage.stage_index, mb))
        self._hand_backward(stage, mb)
        self._drop_handed_grads(stage.stage_index, mb)

    # ------------------------------------------------------------------ bookkeeping
    def release(self, key: Key) -> None:
        """Free what the forward of ``key`` saved (after its last backward pass).

        With V placement this also drops what torch's stage keeps of a local hand-off for this
        microbatch (:func:`zbpipe._compat.drop_local_inputs`): the input a local previous stage
        handed over and the output gradient a local next stage did; torch would keep both until
        the next step.
        """
        saved = self._saved.pop(key, None)
        if saved is not None:
            saved.release_all()
        self._observers.pop(key, None)
        self._drop_local_inputs(key[0], key[1])

    def pending_weight_passes(self) -> list[Key]:
        """The ``(stage, microbatch)`` keys whose B ran but whose W has not (yet)."""
        torch_w = [(i, mb) for i in self.own_w for mb in C.weight_runners(self.stages[i])]
        return sorted([*self.engine.pending_keys(), *torch_w])

    def clear(self) -> None:
        """Drop every pending pass and saved tensor (a step ended, or failed midway)."""
        self.engine.clear()
        for i in self.own_w:  # torch keeps a dw_builder stage's pending weight passes itself
            C.weight_runners(self.stages[i]).clear()
        for saved in self._saved.values():
            saved.release_all()
        self._saved.clear()
        self._records.clear()
        if self.recording is not None:  # a forward failed midway
            self.recording.finish()
            self.recording = None
        self._observers.clear()
        for idx in self.stages:  # what a forward-only or failed step handed over locally
            self._drop_local_inputs(idx, None)

    def _drop_local_inputs(self, idx: int, mb: int | None) -> None:
        fwd, bwd = idx - 1 in self.stages, idx + 1 in self.stages
        if fwd or bwd:
            C.drop_local_inputs(self.stages[idx], mb, fwd=fwd, bwd=bwd)

    def _drop_handed_grads(self, idx: int, mb: int) -> None:
        """B consumed the output gradient a local next stage handed over (V placement): the
        engines keep what W needs themselves, so torch's stage need not hold it until W."""
        if idx + 1 in self.stages:
            C.drop_local_inputs(self.stages[idx], mb, fwd=False, bwd=True)

    def _hand_backward(self, stage: Any, mb: int) -> None:
        if stage.is_first:
            return
        # a meter counts the input gradient until the send or the local previous stage lets go
        self._count_held((stage.stage_index, mb), C.input_grad_cache(stage).get(mb, ()))
        prev = self.stages.get(stage.stage_index - 1)
        if prev is not None:  # V placement: hand the input gradient to the local previous stage
            C.set_local_bwd_input(prev, stage.get_local_bwd_output(mb), mb)

    def _count_held(self, key: Key, values: Any) -> None:
        """A meter counts what is handed on (sent, or kept for a local neighbour) until freed."""
        observer = self._observers.get(key, self.meter)
        if observer is not None:
            count_all_until_freed(values, observer)

    def _probe(self, kind: str, key: Key) -> None:
        """While probing: record what ``key`` holds now (after its F, or its B)."""
        observer = self._observers.get(key)
        # A fused BW run as B then W (``store_bw_keys``) accumulates each weight GEMM inside its
        # B: nothing waits for W there, so "after B" would read as if B freed everything, and a
        # plan budgeting that would defer every W of the stage for free. Only a real B says
        # what a split backward holds until its W.
        if kind == "B" and key not in self.split_keys:
            return
        if self.probe is not None and observer is not None:
            self.probe.record(kind, key[0], observer.live)


def _trainable(stage: Any) -> list[torch.Tensor]:
    return [p for p in stage.submod.parameters() if p.requires_grad]
