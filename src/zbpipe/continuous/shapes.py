"""Microbatches of different shapes in the continuous stream (``variable_shapes=True``, sync mode).

The planned schedules send every step's shapes down the pipeline at the step's start
(:mod:`zbpipe.schedules.varlen`). The continuous stream has no such point: its ranks run
different mini-batches at once (stage 0 may start mini-batch ``k + 1`` while the last stage
drains ``k``), and a message that every rank waits for at a step boundary would be the barrier the
schedule exists to remove. So the shapes travel *with the data*:

* **one header per mini-batch per rank boundary, in order with the activations.** When a stage
  runs its first forward of mini-batch ``k`` (microbatch ``g = k * m``; every stage runs its
  forwards in microbatch order), it knows the input shapes of all ``m`` microbatches of ``k``
  (stage 0 from the inputs ``step(k)`` was given, a later stage from the header it has just
  received), computes its output shapes for each, and posts one small int64 message to the next
  stage's rank *before* the activation of ``g``: ``[status, the m microbatches' output
  dimensions]``. The receiver reads it right before it receives that activation, in the same
  first-in first-out channel, so the sizes are known in advance with no extra round trip (the
  sender never waits for a reply) and no barrier;
* **per mini-batch, not per transfer:** a header on every activation would cost ``m`` times the
  messages, and a header "only when the shape changes" would need the receiver to know whether
  one comes, i.e. a fixed-size header on every transfer anyway. The output gradients a stage
  receives have its own outputs' shapes, which it computed itself: the backward direction needs
  no header;
* each receive gets a buffer of its microbatch's shape (the continuous runtime never shares a
  receive buffer between microbatches: a buffer is an autograd input until its microbatch's W),
  so nothing is padded and there is no pool to keep.

A stage's output shapes come from its shape rule (expressions of its input sizes, one symbolic
fake forward: :func:`zbpipe._compat.shape_rule`), or where its guards do not hold from a concrete
fake forward, cached by input shapes: a shape seen before costs a dict lookup. The planned
schedules use the same rule (:mod:`zbpipe.schedules.stage_shapes`).

Errors. A stage whose output shape is not a function of its input's (``.item()``, ``nonzero``
on the path to an output) is found in the **first** ``step()``: after torch's shape inference,
each rank computes its stage's outputs for microbatch 0's input shapes, and one all-reduce of a
status word makes every rank raise the same ``ValueError`` before any activation is sent (the
only collective the variable shapes add, once per schedule). A shape that a stage cannot take
later in the stream (its forward fails on fake tensors of that shape) puts the failing stage's
index in the header: every rank downstream raises when it reads it, the failing rank raises
before it sends anything of that mini-batch; the ranks upstream, which sent that mini-batch
already, are ended by the launcher (as for any forward that fails mid-stream).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat as C
from .._compat.shims import stage_metas
from ..schedules.stage_shapes import Specs, StageShapes, peer, specs_of, unpack_specs


class StreamShapes:
    """The shapes of one stage's microbatches in a continuous stream, and its shape headers."""

    def __init__(self, stage: Any, n_microbatches: int, owner: str = "ScheduleContinuous") -> None:
        self.stage, self.m, self.owner = stage, n_microbatches, owner
        #: this stage's output specs per input specs (the planned schedules' rule too)
        self._rule = StageShapes(stage)
        self._ins: dict[int, Specs] = {}  # g -> input specs (activation receive buffers)
        self._outs: dict[int, Specs] = {}  # g -> output specs (gradient receive buffers)
        #: whether the first step's check passed on every rank
        self.checked = False
        #: headers sent and received so far (for tests and logs)
        self.headers_sent = 0
        self.headers_received = 0

    # ------------------------------------------------------------------ the first step
    def check_every_rank(self, args0: Sequence[Any], kwargs0: Mapping[str, Any]) -> None:
        """Collective, once: every rank learns whether some stage's output shape is not a
        function of its input shapes (found on microbatch 0's), and raises the same error."""
        st = self.stage
        ins = specs_of(args0) if st.is_first else _meta_specs(stage_metas(st, "inputs"))
        failure = ""
        if not st.is_last:
            try:
                self._rule.outputs(args0, ins, kwargs0)
            except ValueError as e:
                failure = str(e)
        code = torch.tensor([st.stage_index + 1 if failure else 0], dtype=torch.int64)
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=st.group)
        bad = int(code)
        if failure:
            raise ValueError(f"{self.owner}.step() cannot size its receive buffers: {failure}")
        if bad:
            raise ValueError(_elsewhere(self.owner, bad - 1, "the first mini-batch"))
        self.checked = True

    # ------------------------------------------------------------------ each mini-batch
    def start_minibatch(
        self, k: int, args: Mapping[int, Any], kwargs: Mapping[int, Any], sends: Any
    ) -> None:
        """At this stage's first forward of mini-batch ``k`` (local index): learn its
        microbatches' input shapes (stage 0: ``args``; else the header from the previous
        stage's rank), compute their output shapes, post the header to the next stage's rank
        (attached to ``sends`` with the activation it precedes). Raises before anything of
        ``k`` is sent if a stage cannot take these shapes."""
        st, m = self.stage, self.m
        gs = range(k * m, (k + 1) * m)
        status = 0
        ins: list[Specs] | None = None
        if st.is_first:
            ins = [specs_of(args[g]) for g in gs]
        else:
            status, ins = self._receive(st, m)
        outs: list[Specs] = []
        failure = ""
        if not status and not st.is_last:
            try:
                assert ins is not None
                for g, spec in zip(gs, ins, strict=True):
                    outs.append(self._rule.outputs(args.get(g, ()), spec, kwargs.get(g) or {}))
            except ValueError as e:
                status, failure = st.stage_index + 1, str(e)
        if not st.is_last:
            self._send(st, g0=k * m, outs=outs, status=status, sends=sends)
        if failure:
            raise ValueError(f"{self.owner}.step() cannot size its receive buffers: {failure}")
        if status:
            raise ValueError(_elsewhere(self.owner, status - 1, "a mini-batch in the stream"))
        assert ins is not None
        for j, g in enumerate(gs):
            if not st.is_first:
                self._ins[g] = ins[j]
            if not st.is_last:
                self._outs[g] = outs[j]

    def activation_infos(self, g: int, template: tuple) -> tuple:
        """Receive infos for ``g``'s inputs with buffers of its shapes."""
        return _sized(template, self._ins.pop(g))

    def gradient_infos(self, g: int, template: tuple) -> tuple:
        """Receive infos for the gradients of ``g``'s outputs, with buffers of their shapes."""
        return _sized(template, self._outs.pop(g))

    def forget(self) -> None:
        """A new stream: no shapes are pending."""
        self._ins.clear()
        self._outs.clear()

    # ------------------------------------------------------------------ headers
    # int64: [status, then each microbatch's output dimensions, in order]; status is 1 + the
    # index of the first stage that cannot take the mini-batch's shapes (0: none)
    def _send(self, st: Any, g0: int, outs: list[Specs], status: int, sends: Any) -> None:
        ndims = sum(len(x.shape) for x in stage_metas(st, "outputs"))
        dims = [d for mb in outs for spec in mb for d in spec.shape] if not status else []
        words = [status, *dims, *([0] * (self.m * ndims - len(dims)))]
        msg = torch.tensor(words, dtype=torch.int64)
        # posted before g0's activation on the same channel: the receiver reads it first; the
        # work (holding msg) is let go of with that activation's send (zbpipe.schedules.sends)
        work = dist.isend(msg, dst=peer(st, st.stage_index + 1), group=st.group)
        sends.attach((True, st.stage_index + 1, g0), work)
        self.headers_sent += 1

    def _receive(self, st: Any, m: int) -> tuple[int, list[Specs] | None]:
        metas = stage_metas(st, "inputs")
        ndims = [len(x.shape) for x in metas]
        words = torch.empty(1 + m * sum(ndims), dtype=torch.int64)
        dist.recv(words, src=peer(st, st.stage_index - 1), group=st.group)
        self.headers_received += 1
        msg = words.tolist()
        if msg[0]:
            return int(msg[0]), None
        return 0, unpack_specs(msg[1:], metas, m)


def _sized(template: tuple, specs: Specs) -> tuple:
    """Copies of the receive infos ``template`` with fresh buffers shaped as ``specs`` (one spec
    per info; an info without a buffer, a gradient not expected, keeps none)."""
    out = []
    for info, spec in zip(template, specs, strict=True):
        c = copy.copy(info)
        buf = getattr(info, "buffer", None)
        if isinstance(buf, torch.Tensor):
            # keep requires_grad as the template has it (see actions._fresh)
            new = torch.empty(spec.shape, dtype=spec.dtype, device=buf.device)
            c.buffer = new.requires_grad_(buf.requires_grad)
        out.append(c)
    return tuple(out)


def _elsewhere(owner: str, stage: int, when: str) -> str:
    return (
        f"{owner}.step(): stage {stage} (on another rank) cannot take the microbatches of "
        f"{when}: its output shape is not a function of its input shapes (that rank's error "
        "says why); no microbatch of it was sent from this rank"
    )


def _meta_specs(metas: Sequence[Any]) -> Specs:
    return tuple(C.TensorSpec(tuple(x.shape), x.dtype) for x in metas)
