"""What the continuous schedule does for one action of its stream: receive, F (with the weight
version its microbatch must use), B, W, and the optimizer step after a mini-batch's last W.

A mixin of :class:`~zbpipe.continuous.schedule.ScheduleContinuous`, which owns the state these
methods read (the stage, the seam, the stream's inputs and counters): the class says what a
stream is, this file what each of its actions does.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat as C

# the schedule's logger: a user filters on one name for the continuous schedule
log = logging.getLogger("zbpipe.continuous.schedule")


def _post(op: dist.P2POp) -> dist.Work:
    if op.op is dist.isend:
        return dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
    return dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer)


def _fresh(infos: tuple) -> tuple:
    """New receive infos with their own buffers (never share a buffer between microbatches)."""
    out = []
    for info in infos:
        c = copy.copy(info)
        if c.buffer is not None:
            # Keep requires_grad: torch 2.11 receives into the buffer as it is (torch >= 2.13
            # sets requires_grad when it hands the activation over).
            c.buffer = torch.empty_like(info.buffer).requires_grad_(info.buffer.requires_grad)
        out.append(c)
    return tuple(out)


class ContinuousActions:
    """The per-action methods of :class:`~zbpipe.continuous.schedule.ScheduleContinuous`.

    What they read and write, all set by the schedule (``__init__`` and ``_reset_stream``):
    """

    # the stage, its seam and optimizer, the settings
    stage: Any
    seam: Any
    optimizer: Any
    rank: int
    scale_grads: bool
    _n_microbatches: int
    _loss_fn: Any
    _pv: Any  # the post-validated step, or None
    _versions: Any  # the weight versions (2bw / stash), or None
    step_reports: list[Any]
    # the stream: inputs handed in, in flight, done
    _args: dict[int, Any]
    _kwargs: dict[int, Any]
    _targets: dict[int, Any]
    _loss_kwargs: dict[int, Any]
    _losses: dict[int, Any]  # loss graphs, until B
    _loss_values: dict[int, Any]  # what the user gets
    # the leaf set (and its (version, mini-batch) key) each microbatch used, until its W
    _leaves: dict[int, tuple[tuple[int, int], list[Any]]]
    _w_done: dict[int, int]
    _f_count: int
    _stepped: int
    _finished: int  # mini-batches whose last W ran (their step may be held: _step_lag)
    _step_lag: int  # 1: this stage applies each update one mini-batch late (2bw on the master)
    _minibatches_before: int
    _act_template: tuple
    _grad_template: tuple
    _sends: Any
    _proofs: Any
    _shapes: Any  # variable_shapes=True: the stream's shapes (zbpipe.continuous.shapes), or None

    def _minibatch(self, g: int) -> int:
        return g // self._n_microbatches

    def _run(self, slices: dict[int, list]) -> None:
        """Run this rank's slice of the stream (``slices``: every rank's, from the frontier)."""
        if self.rank > 0:  # what the previous rank runs proves which gradients it received
            self._sends.add_proofs(self._proofs.previous_rank_ran(slices[self.rank - 1]))
        try:
            for a in slices[self.rank]:
                self._sends.prune()  # let go of the sends that completed (zbpipe.schedules.sends)
                try:
                    run = {
                        "F": self._forward,
                        "B": self._backward_input,
                        "W": self._backward_weight,
                    }[a.kind]
                    run(a.microbatch)
                except Exception:
                    log.error(
                        "zbpipe continuous: rank %d failed at %s (mini-batch %d of this stream)",
                        self.rank,
                        a,
                        self._minibatch(a.microbatch),
                    )
                    raise
        finally:
            if self._versions is not None:  # between calls the module holds its own parameters
                self._versions.slots.restore()
        self._sends.prune()

    def _validate(self) -> None:
        if self._pv is not None:
            report = self._pv.validate()
            if report is not None:
                self.step_reports.append(report)

    def _forward(self, g: int) -> None:
        st = self.stage
        self._validate()  # the previous step must be settled before these weights are read
        shapes = self._shapes
        if shapes is not None and g % self._n_microbatches == 0:  # before anything of g's
            shapes.start_minibatch(self._minibatch(g), self._args, self._kwargs, self._sends)
        if st.is_first:
            args = self._args.pop(g)
        else:
            C.activation_receives(st)[g] = (
                shapes.activation_infos(g, self._act_template)
                if shapes is not None
                else _fresh(self._act_template)
            )
            works = [_post(op) for op in st.get_fwd_recv_ops(g)]
            for w in works:
                w.wait()
            if works:  # an empty receive proves nothing (zbpipe.schedules.sends)
                self._sends.received((True, st.stage_index, g))
            args = C.received_activations(st, g)
            del C.activation_receives(st)[g]
        kwargs = self._kwargs.pop(g) or {}
        given = (args, kwargs) if st.is_first else ()
        if st.is_last:
            given = (*given, self._targets.get(g))
        with self.seam.forward(st, g, given):
            out = self._forward_compute(g, args, kwargs)
        out_tuple = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        inputs = [*args, *kwargs.values()]
        C.forward_cache(st)[g] = (out_tuple, inputs)
        self._f_count += 1
        if not st.is_last:
            self._sends.post(st, g, forward=True)
            self._sends.add_proofs(self._proofs.output_sent(g))

    def _forward_compute(self, g: int, args: Any, kwargs: dict) -> Any:
        """The stage's forward (with the weight version microbatch ``g`` must use), and its loss."""
        st = self.stage
        if self._versions is not None:
            # The microbatch's version goes in the module's parameter slots; a run of forwards
            # on the same (version, mini-batch) swaps once (zbpipe.continuous.versions).
            k = self._minibatch(g)
            # a step of this stage comes before g's backward passes end iff g's mini-batch is
            # ahead of the next step (step j follows the last W of j + lag, W's in order)
            key, leaves = self._versions.acquire(
                g, self._minibatches_before + k, overtaken=k > self._stepped + self._step_lag
            )
            self._versions.slots.install(key, leaves)
            self._leaves[g] = (key, leaves)
        out = st.submod(*args, **kwargs)
        if st.is_last:
            loss = self._loss_fn(out, self._targets.pop(g), **self._loss_kwargs.pop(g, {}))
            self._losses[g] = loss  # the graph, until B
            self._loss_values[g] = loss.detach()  # what the user gets
        return out

    def _backward_input(self, g: int) -> None:
        st = self.stage
        if not st.is_last:
            C.grad_receives(st)[g] = (
                self._shapes.gradient_infos(g, self._grad_template)
                if self._shapes is not None
                else _fresh(self._grad_template)
            )
            works = [_post(op) for op in st.get_bwd_recv_ops(g)]
            for w in works:
                w.wait()
            if works:
                self._sends.received((False, st.stage_index, g))
        params = None
        if self._versions is not None:  # W computes the gradients of this microbatch's version
            key, leaves = self._leaves[g]
            # ... and B runs on it: a checkpointed block recomputes its forward here, reading the
            # parameter slots (another microbatch's version, or the master after a step(), sat
            # there: a wrong gradient that no check catches). One comparison when installed.
            self._versions.slots.install(key, leaves)
            self._versions.prepare_grads(key)
            params = lambda: leaves  # noqa: E731
        self.seam.backward_input(st, g, self._losses.pop(g) if st.is_last else None, params)
        if not st.is_last:
            del C.grad_receives(st)[g]
        if not st.is_first:
            self._sends.post(st, g, forward=False)

    def _backward_weight(self, g: int) -> None:
        if self._versions is not None:  # the graph engine's W re-enters (and recomputes) too
            self._versions.slots.install(*self._leaves[g])
        self.seam.backward_weight(self.stage, g)
        k = self._minibatch(g)
        if self._versions is not None:  # its gradients are in its leaf set's .grad already
            del self._leaves[g]
            self._versions.release(g, self._next_forward_minibatch())
        self._w_done[k] = self._w_done.get(k, 0) + 1
        if self._w_done[k] == self._n_microbatches:  # the plan's step_after: the last W of k
            if k != self._finished:
                raise RuntimeError(
                    f"zbpipe continuous: mini-batch {k} finished before {self._finished}"
                )
            self._finished += 1
            if self._versions is not None:
                self._versions.withdraw_offers(self._minibatches_before + k)
            # (with a lag, the step of k - 1: k's forwards ran on the master as k - 1 needs it)
            while self._stepped < self._finished - self._step_lag:
                self._optimizer_step(self._stepped)

    def _step_held(self) -> None:
        """The end of a stream: apply the updates a lag still holds."""
        while self._stepped < self._finished:
            self._optimizer_step(self._stepped)

    def _next_forward_minibatch(self) -> int:
        return self._minibatches_before + self._f_count // self._n_microbatches

    def _optimizer_step(self, k: int) -> None:
        if self._versions is not None:
            # the module's slots may hold a version's leaves: step the master parameters
            params = list(self._versions.params.values())
            grads = self._versions.take_grads(self._minibatches_before + k)
            for q, grad in zip(params, grads):
                q.grad = grad
            self._versions.before_step(self._next_forward_minibatch())
        else:
            params = [q for q in self.stage.submod.parameters()]
        if self.scale_grads and self._n_microbatches != 1:
            for q in params:
                if q.grad is not None:
                    q.grad.div_(self._n_microbatches)
        if self._pv is not None:
            self._pv.step()
        else:
            self.optimizer.step()
        if self._versions is not None:  # the schedule owns the gradients: reuse their buffers
            self._versions.recycle_grads([q.grad for q in params])
        for q in params:
            q.grad = None
        if self._versions is not None:
            self._versions.updated(self._next_forward_minibatch())
        del self._w_done[k]
        self._stepped += 1
