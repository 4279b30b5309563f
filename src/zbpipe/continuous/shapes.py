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
fake forward, cached by input shapes: a shape seen before costs a dict lookup.

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
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat as C
from .._compat.shims import stage_metas

Specs = tuple[C.TensorSpec, ...]


class StreamShapes:
    """The shapes of one stage's microbatches in a continuous stream, and its shape headers."""

    def __init__(self, stage: Any, n_microbatches: int, owner: str = "ScheduleContinuous") -> None:
        self.stage, self.m, self.owner = stage, n_microbatches, owner
        #: input key -> output specs of this stage
        self._outputs: dict[Hashable, Specs] = {}
        #: inputs' ranks and dtypes -> the stage's shape rule (None: none found)
        self._rules: dict[Hashable, C.ShapeRule | None] = {}
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
        ins = _specs(args0) if st.is_first else _meta_specs(stage_metas(st, "inputs"))
        failure = ""
        if not st.is_last:
            try:
                self.outputs_for(args0, ins, kwargs0)
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
            ins = [_specs(args[g]) for g in gs]
        else:
            status, ins = self._receive(st, m)
        outs: list[Specs] = []
        failure = ""
        if not status and not st.is_last:
            try:
                assert ins is not None
                for g, spec in zip(gs, ins, strict=True):
                    outs.append(self.outputs_for(args.get(g, ()), spec, kwargs.get(g) or {}))
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

    # ------------------------------------------------------------------ shapes
    def outputs_for(self, args: Any, ins: Specs, kwargs: Mapping[str, Any]) -> Specs:
        """This stage's output specs for inputs ``ins`` (stage 0 also reads ``args``' values
        where a fake forward needs them), or a ``ValueError`` saying why there are none."""
        st = self.stage
        key = _input_key(ins, kwargs)
        cached = self._outputs.get(key) if key is not None else None
        if cached is not None:
            return cached
        fake_args = tuple(args) if st.is_first else ins
        try:
            outs = self._by_rule(ins, kwargs) or C.output_specs(
                st.submod, fake_args, dict(kwargs), st.device
            )
        except Exception as e:
            why = (
                "its output shape depends on the values of its input, not only on its shape"
                if C.data_dependent_error(e)
                else "its forward failed on fake tensors of these shapes"
            )
            raise ValueError(
                f"stage {st.stage_index} cannot take microbatches of this shape "
                f"(inputs {[tuple(x.shape) for x in ins]}): {why} ({type(e).__name__}: {e}). "
                "zbpipe sizes each receive buffer from the stage's output shape for its input "
                "shapes; make the stage's output shape a function of its input shapes (no "
                ".item(), nonzero() or data-dependent slicing on the path to its outputs), or "
                "give every microbatch the same shape"
            ) from None
        expected = stage_metas(st, "outputs")
        if len(outs) != len(expected) or any(
            len(o.shape) != len(e.shape) or o.dtype != e.dtype
            for o, e in zip(outs, expected, strict=False)
        ):
            raise ValueError(
                f"stage {st.stage_index} gives outputs {[(o.shape, o.dtype) for o in outs]} for "
                f"inputs {[tuple(x.shape) for x in ins]}, but "
                f"{[(tuple(e.shape), e.dtype) for e in expected]} for the first microbatch: "
                "microbatches may differ in their sizes, not in the number, rank or dtype of "
                "a stage's outputs"
            )
        if key is not None:
            self._outputs[key] = outs
        return outs

    def _by_rule(self, ins: Specs, kwargs: Mapping[str, Any]) -> Specs | None:
        if kwargs or not ins:  # keyword inputs: a concrete fake forward decides
            return None
        key = tuple((len(x.shape), x.dtype) for x in ins)
        if key not in self._rules:
            self._rules[key] = C.shape_rule(self.stage.submod, tuple(ins), self.stage.device)
        rule = self._rules[key]
        return rule.apply(tuple(x.shape for x in ins)) if rule is not None else None

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
        work = dist.isend(msg, dst=_peer(st, st.stage_index + 1), group=st.group)
        sends.attach((True, st.stage_index + 1, g0), work)
        self.headers_sent += 1

    def _receive(self, st: Any, m: int) -> tuple[int, list[Specs] | None]:
        metas = stage_metas(st, "inputs")
        ndims = [len(x.shape) for x in metas]
        words = torch.empty(1 + m * sum(ndims), dtype=torch.int64)
        dist.recv(words, src=_peer(st, st.stage_index - 1), group=st.group)
        self.headers_received += 1
        msg = words.tolist()
        if msg[0]:
            return int(msg[0]), None
        at, ins = 1, []
        for _ in range(m):
            mb = []
            for meta, n in zip(metas, ndims, strict=True):
                mb.append(C.TensorSpec(tuple(msg[at : at + n]), meta.dtype))
                at += n
            ins.append(tuple(mb))
        return 0, ins


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


def _peer(st: Any, stage_index: int) -> int:
    group_rank = st.stage_index_to_group_rank[stage_index]
    return dist.get_global_rank(st.group, group_rank) if st.group is not None else group_rank


def _specs(args: Any) -> Specs:
    return tuple(C.TensorSpec(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))


def _meta_specs(metas: Sequence[Any]) -> Specs:
    return tuple(C.TensorSpec(tuple(x.shape), x.dtype) for x in metas)


def _input_key(ins: Specs, kwargs: Mapping[str, Any]) -> Hashable | None:
    """What a stage's output shapes may depend on: input shapes, keyword shapes and values
    (None when a keyword value cannot be a key: then the fake forward runs each time)."""
    kw = tuple(
        (k, C.TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
        for k, v in sorted(kwargs.items())
    )
    key = (ins, kw)
    try:
        hash(key)
    except TypeError:
        return None
    return key
