"""Microbatches of different shapes (``variable_shapes=True``): each rank sizes its receive
buffers per step. Opt-in: it costs a message per rank boundary per step; without it the rank of
stage 0 only checks that every microbatch has the first step's shapes (:mod:`.fixed_shapes`).

torch's ``PipelineStage`` sizes its receive buffers once, from microbatch 0 of the first step, so
a microbatch of another sequence length aborts the receive ("Received data size doesn't match").
Before each step's first activation moves, :class:`ShapeExchange` sends the shapes down the
pipeline once:

1. the rank of stage 0 reads every microbatch's input shapes (from ``arg_mbs``);
2. each stage, in stage order, computes its output shapes for every microbatch from its input
   shapes (cached by input shapes and seeded with what torch inferred, so a shape seen before
   costs a dict lookup; a new one is read off the stage's shape rule, expressions of its input
   sizes from one forward on fake tensors with symbolic sizes, :func:`zbpipe._compat.shape_rule`,
   and where the rule's guards do not hold, from a concrete fake forward,
   :func:`zbpipe._compat.output_specs`; the rule the continuous stream shares,
   :mod:`.stage_shapes`) and sends them to the next stage's rank as one small
   int64 message, posted without waiting for it (a stage on the same rank gets them without one);
3. each rank sizes its stages' receive buffers: activations from the input shapes, output
   gradients from the output shapes. A buffer of the right shape stays; the others are pooled by
   shape and handed to the step's microbatches that need that shape; only what the pool cannot
   give is allocated. Nothing is padded;
4. one all-reduce of a status word: a stage whose output shape is not a function of its input's
   shape (the fake forward met a data-dependent shape) makes every rank raise the same
   ``ValueError`` before the step's first send, so no rank waits for a peer that gave up.

Step 4 is skipped in the steady state: when every microbatch's stage-0 inputs (shapes and
keywords) were seen in an earlier step whose exchange succeeded, every later stage's inputs were
seen too (a stage's output shapes are a function of its input shapes, which is what step 2
requires), so no stage can fail. The rank of stage 0 says so in the header of the message it
sends anyway ("known"), every message passes the word on, and no rank all-reduces.

The output gradients a stage receives have its outputs' shapes, so step 2 sizes them too: one
message per stage boundary per step, forward only.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat as C
from .._compat.shims import stage_metas
from .stage_shapes import Specs, StageShapes, input_key, peer, specs_of, unpack_specs

logger = logging.getLogger(__name__)


class ShapeExchange:
    """Sizes the receive buffers of one schedule's stages for each step's microbatches."""

    def __init__(self) -> None:
        #: stage index -> its output shapes per input shapes; seeded from torch's first-step
        #: inference
        self._shapes: dict[int, StageShapes] = {}
        self._seeded = False
        #: stage-0 input keys of the microbatches of every step whose exchange succeeded
        self._seen_first: set[Hashable] = set()
        #: buffers allocated (not reused) by the last step, for tests and logs
        self.allocated = 0
        #: whether the last step skipped the all-reduce (its shapes were all seen), for tests
        self.skipped_agree = False
        #: the last step's shape messages still being sent, with the tensors they read
        self._in_flight: list[tuple[Any, torch.Tensor]] = []

    def before_step(
        self,
        sched: Any,
        arg_mbs: Sequence[Any],
        kwarg_mbs: Sequence[Any],
        slots: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """Send this step's shapes down the pipeline and size every receive buffer (collective:
        every rank calls it at the same point of the step). ``slots`` (stage 0's rank; its
        microbatches already in that order, :mod:`.cost_order`) travels in the messages'
        header: every rank gets it back (data order when not given; other ranks' ``kwarg_mbs``
        come in data order and follow it)."""
        self._finish_sends()
        stages = sorted(sched._stages, key=lambda st: st.stage_index)
        local = {st.stage_index: st for st in stages}
        m = len(arg_mbs)
        kwargs = [dict(k) for k in kwarg_mbs]
        if not self._seeded:
            self._seed(sched, stages, arg_mbs, kwargs)
        self.allocated = 0
        found: dict[int, list[Specs] | None] = {}
        failed = 0  # 1 + the index of the first stage whose output shapes could not be found
        failure = ""
        first_keys: list[Hashable | None] = []
        known: bool | None = None  # every microbatch's stage-0 inputs seen in a good step
        order = tuple(slots) if slots is not None else tuple(range(m))
        for st in stages:
            s = st.stage_index
            ins: list[Specs] | None
            if st.is_first:
                ins = [specs_of(a) for a in arg_mbs]
                first_keys = [input_key(i, kw) for i, kw in zip(ins, kwargs, strict=True)]
                known = all(k is not None and k in self._seen_first for k in first_keys)
            elif s - 1 in local:
                ins = found.get(s - 1)
            else:
                status, said_known, said_order, ins = self._receive(st, m)
                if known is None:  # the first message a rank without stage 0 gets (its
                    known, order = said_known, said_order  # kwargs came in data order)
                    kwargs = [kwargs[i] for i in order]
                failed = failed or status
                if ins is not None:
                    self._size(st, ins, forward=True)
            outs, error = self._all_outputs(sched, st, arg_mbs, ins, kwargs)
            if error:
                failed, failure = failed or s + 1, error
            found[s] = outs
            if not st.is_last and s + 1 not in local:
                if outs is not None:
                    self._size(st, outs, forward=False)
                self._send(st, outs, failed, bool(known), order)
        # known: no stage can fail on inputs a good step saw, so every rank skips the
        # all-reduce. known and failed cannot meet while a stage's output shapes are a function
        # of its input shapes; if a stage broke that, this rank raises without its peers.
        self.skipped_agree = bool(known)
        self._agree(sched, stages[0], failed, failure, collective=not known)
        self._seen_first.update(k for k in first_keys if k is not None)
        if self.allocated:
            logger.debug("rank %d: %d receive buffers allocated", sched.rank, self.allocated)
        return order

    def _finish_sends(self) -> None:
        """Wait for the last step's shape messages (long delivered: the peers received them)."""
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()

    # ------------------------------------------------------------------ shapes
    def _all_outputs(
        self, sched: Any, st: Any, arg_mbs: Sequence[Any], ins: list[Specs] | None, kwargs: list
    ) -> tuple[list[Specs] | None, str]:
        """Every microbatch's output specs of ``st`` (None for the last stage or no inputs), or
        the reason they cannot be found."""
        if ins is None or st.is_last:
            return None, ""
        try:
            return [
                self._stage_outputs(sched, st, arg_mbs[mb], ins[mb], kwargs[mb])
                for mb in range(len(ins))
            ], ""
        except ValueError as e:
            return None, str(e)

    def _seed(
        self, sched: Any, stages: Sequence[Any], arg_mbs: Sequence[Any], kwargs: list[dict]
    ) -> None:
        """What torch inferred from microbatch 0 on the first step: no fake forward for it."""
        self._seeded = True
        for st in stages:
            ins = tuple(_spec_of_meta(x) for x in stage_metas(st, "inputs"))
            outs = tuple(_spec_of_meta(x) for x in stage_metas(st, "outputs"))
            if None in ins or None in outs or not arg_mbs:
                continue
            kw = _stage_kwargs(sched, st, kwargs[0])
            self._stage_shapes(st).seed(ins, kw, outs)  # type: ignore[arg-type]

    def _stage_outputs(
        self, sched: Any, st: Any, args: tuple, ins: Specs, kwargs: dict[str, Any]
    ) -> Specs:
        return self._stage_shapes(st).outputs(args, ins, _stage_kwargs(sched, st, kwargs))

    def _stage_shapes(self, st: Any) -> StageShapes:
        shapes = self._shapes.get(st.stage_index)
        if shapes is None:
            shapes = self._shapes[st.stage_index] = StageShapes(st)
        return shapes

    # ------------------------------------------------------------------ buffers
    def _size(self, st: Any, specs: list[Specs], forward: bool) -> None:
        """Give each microbatch's receive buffers the shapes ``specs`` say (pooled by shape)."""
        pool: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = defaultdict(list)
        todo = []
        for mb, mb_specs in enumerate(specs):
            for info, spec in zip(C.receive_infos(st, mb, forward), mb_specs, strict=False):
                if info is None:
                    continue
                buf = info.buffer
                if tuple(buf.shape) != spec.shape or buf.dtype != spec.dtype:
                    pool[(tuple(buf.shape), buf.dtype)].append(buf)
                    todo.append((info, spec))
        for info, spec in todo:
            free = pool.get((spec.shape, spec.dtype))
            if free:
                C.set_receive_buffer(info, free.pop())
            else:
                self.allocated += 1
                C.set_receive_buffer(
                    info, torch.empty(spec.shape, dtype=spec.dtype, device=st.device)
                )

    # ------------------------------------------------------------------ messages
    # A message, int64: [status, known, the m slots, then every microbatch's output dimensions].
    # status is 1 + the first failed stage (0: none); known is 1 when stage 0 saw all its inputs
    # in an earlier good step; slot k holds the microbatch (in data order) that runs there.
    _HEADER = 2

    def _send(
        self, st: Any, outs: list[Specs] | None, failed: int, known: bool, order: Sequence[int]
    ) -> None:
        ndims = [len(x.shape) for x in stage_metas(st, "outputs")]
        m = len(order)
        header = [failed, int(known), *order]
        dims = [d for mb in outs for spec in mb for d in spec.shape] if outs and not failed else []
        msg = torch.tensor(header + dims + [0] * (m * sum(ndims) - len(dims)), dtype=torch.int64)
        # posted, not waited for: the receiver needs it before its first receive of the step,
        # the sender does not; its handle (and the tensor it reads) is kept until the next step
        work = dist.isend(msg, dst=peer(st, st.stage_index + 1), group=st.group)
        self._in_flight.append((work, msg))

    def _receive(self, st: Any, m: int) -> tuple[int, bool, tuple[int, ...], list[Specs] | None]:
        metas = stage_metas(st, "inputs")
        ndims = [len(x.shape) for x in metas]
        head = self._HEADER + m
        words = torch.empty(head + m * sum(ndims), dtype=torch.int64)
        dist.recv(words, src=peer(st, st.stage_index - 1), group=st.group)
        msg = words.tolist()
        status, known, order = int(msg[0]), bool(msg[1]), tuple(msg[self._HEADER : head])
        if status:
            return status, known, order, None
        return 0, known, order, unpack_specs(msg[head:], metas, m)

    def _agree(
        self, sched: Any, st: Any, failed: int, failure: str, collective: bool = True
    ) -> None:
        """Every rank learns whether a stage failed, and raises the same error if one did
        (``collective=False``: only this rank's knowledge, no all-reduce)."""
        code = torch.tensor([failed], dtype=torch.int64)
        if collective:
            dist.all_reduce(code, op=dist.ReduceOp.MAX, group=st.group)
        bad = int(code)
        if not bad:
            return
        owner = type(sched).__name__
        if failure:
            raise ValueError(f"{owner}.step() cannot size its receive buffers: {failure}")
        raise ValueError(
            f"{owner}.step(): stage {bad - 1} (on another rank) cannot take microbatches of these "
            "shapes: its output shape is not a function of its input shapes (that rank's error "
            "says why); no microbatch of this step was sent"
        )


def _spec_of_meta(meta: Any) -> C.TensorSpec | None:
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    return None if shape is None or dtype is None else C.TensorSpec(tuple(shape), dtype)


def _stage_kwargs(sched: Any, st: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword inputs the stage's forward gets (dict batches reach stage 0 only)."""
    if st.is_first:
        return dict(kwargs)
    return dict(sched._batch_keywords._drop(dict(kwargs)) or {})
