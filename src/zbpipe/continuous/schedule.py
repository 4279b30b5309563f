"""``ScheduleContinuous``: flush-free pipelining across optimizer steps (one stage per rank).

Execution model
---------------
The plan is :func:`zbpipe.planning.continuous.periods.continuous_parts`: per rank a warm-up, a
period per mini-batch boundary and a drain, over global microbatch indices ``g = k * m + j``
(mini-batch ``k`` of the current stream, microbatch ``j``). The user hands in one mini-batch per
:meth:`ScheduleContinuous.step` call. Every rank keeps the same
:class:`~zbpipe.planning.continuous.frontier.StreamFrontier`: the orders of all ranks grown by
one period per mini-batch, and a fixed point telling how far each rank can run with the data
given so far.
``step(k)`` runs, on this rank, exactly the new part of its own order: everything that needs only
mini-batches ``0..k`` (directly, or through a peer that needs a later one), then returns.
Actions that need mini-batch ``k + 1`` wait for the next call; :meth:`flush` swaps the last
period for the drain and runs it to the end.

Because every rank's slice is a dependency-closed prefix of its order, a receive this rank waits
on always has its send posted by a peer in this call or an earlier one. Sends never block
(``isend``; each let go of once complete, the rest waited for at :meth:`flush`), receives are
posted right before the action that consumes them, and every stage runs its F passes (and its B
passes) in microbatch order, so the point-to-point messages of one direction between two ranks
are matched first-in first-out, whichever call each side posts them in. The same holds between
calls made at different times on different ranks: stage 0 can start mini-batch ``k + 1`` while
the last stage is still in ``k``'s drain, which is the point of the schedule.

zbpipe runs the compute itself (as :mod:`zbpipe.schedules.runtime` does): F through the stage
module, B and W through the stage seam and its engine (:mod:`zbpipe.engines`), using torch's
``PipelineStage`` for shape inference, receive buffers and send ops. The stage's per-microbatch
caches are keyed by the global index ``g``: each receive gets a fresh buffer (a buffer is still an
autograd input of its microbatch until that microbatch's W, so buffers are never reused across
microbatches), and the stage is told its chunk count is unbounded.

Modes (see docs/use/continuous.md)
------------------------------
* ``sync``: each stage steps its optimizer for mini-batch ``k`` right after its last W of
  ``k`` (the plan's ``step_after``), and its first F of ``k + 1`` runs after that step.
  Parameters equal a plain synchronous training loop.
* ``2bw`` / ``stash``: separate weight versions (:mod:`zbpipe.continuous.versions`), put in the
  stage module's parameter slots for the forwards that must use them (one swap per run of
  forwards on the same version and mini-batch), their weight gradients summed per mini-batch
  where they are computed. ``correction="predict"`` / ``"nesterov"`` (2bw): each version is the
  last step extrapolated once (the weights a synchronous run would use) or twice (a look-ahead).
  Plain 2bw on a stage whose mini-batches do not overlap in its order (the last stage of 2bw's
  stream orders; every stage of a sync-derived order, which the planner may pick) applies each
  update one mini-batch late instead of copying the weights: the same parameters, bit for bit
  (with hyperparameters fixed between calls), without 2bw's one copy per step there.

When results appear: the losses of mini-batch ``k`` are computed on the last stage's F passes
of ``k``, which every continuous plan runs during ``step(k)``; they are returned (tagged
``(k, [m losses])``) by the call during which the last of them was computed (``step(k)`` for
the plans zbpipe generates), on the rank holding the last stage. ``flush()`` returns any not
yet returned.

Long because the class's public API and its stream bookkeeping share one state; what each action
does is already in :mod:`zbpipe.continuous.actions`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch

from .. import _compat as C
from ..engines import EngineName, Split, choose_engine
from ..observe.agree import check_peers_agree, config_fingerprint
from ..planning import Costs
from ..planning.continuous.frontier import StreamFrontier
from ..planning.continuous.periods import MODES, continuous_parts, plan_continuous, version_bound
from ..planning.continuous.stale_orders import minibatches_apart
from ..planning.continuous.tradeoff import continuous_tradeoff
from ..schedules.fixed_shapes import FixedShapes
from ..schedules.inputs import drop_inputs_off_stage0, microbatch_inputs
from ..schedules.sends import ChainProofs, PendingSends
from ..schedules.stage_seam import EVERY_KEY, StageSeam
from ..schedules.validation import check_schedule_args, check_step_args
from .actions import ContinuousActions
from .optim import PostValidatedStep, StepReport
from .shapes import StreamShapes
from .versions import CORRECTIONS, WeightVersions

log = logging.getLogger(__name__)

_FIXED_SHAPES_REMEDY = (
    "Build ScheduleContinuous with variable_shapes=True (mode='sync') to send each mini-batch's "
    "shapes down the pipeline with its first activation (docs/use/varlen.md), or pad or pack "
    "every microbatch to one shape"
)

LossRecord = tuple[int, list[torch.Tensor]]
OptimizerArg = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _check_options(
    stages: list[Any],
    mode: str,
    loss_fn: Any,
    post_validate: Any,
    correction: Any = None,
) -> None:
    """The construction checks of the continuous schedule's own options (ValueErrors)."""
    if mode not in MODES:
        raise ValueError(f"ScheduleContinuous: mode must be one of {MODES}, got {mode!r}")
    if correction not in CORRECTIONS:
        raise ValueError(
            f"ScheduleContinuous: correction must be one of {CORRECTIONS}, got {correction!r}"
        )
    if correction is not None and mode != "2bw":
        raise ValueError(
            f"ScheduleContinuous: correction={correction!r} corrects 2bw's one-step delay; "
            f"use it with mode='2bw' (got mode={mode!r}) or drop it"
        )
    if loss_fn is None:
        raise ValueError(
            "ScheduleContinuous: loss_fn is required "
            "(the schedule trains; use torch's eval() schedules to infer)"
        )
    if post_validate is not None and mode != "sync":
        raise ValueError(
            "ScheduleContinuous: post_validate is supported in mode='sync' only; "
            "drop it or use sync"
        )
    if mode != "sync" and any(C.has_own_weight_pass(st) for st in stages):
        # 2bw/stash run the forward on separate weight versions; a dw_builder's runner
        # writes the module's own .grad, which those modes never read.
        raise ValueError(
            "ScheduleContinuous: a stage built with dw_builder runs in mode='sync' only, "
            f"got mode={mode!r}; "
            "use mode='sync' or build the stage without dw_builder"
        )


def _check_variable_shapes(variable_shapes: Any, mode: Any) -> None:
    """``variable_shapes`` is a bool, and True only in sync mode (checked before the stages are
    looked at)."""
    if not isinstance(variable_shapes, bool):
        raise ValueError(
            f"ScheduleContinuous: variable_shapes must be True or False, got {variable_shapes!r}"
        )
    if variable_shapes and mode != "sync":
        raise ValueError(
            f"ScheduleContinuous: variable_shapes=True is supported in mode='sync' only, got "
            f"mode={mode!r}: the shape headers of the 2bw and stash streams are not tested yet "
            "(docs/use/varlen.md). Use mode='sync', or pad or pack every microbatch to one shape"
        )


def _build_optimizer(
    optimizer: OptimizerArg, params: list[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The stage's optimizer: the one given, or the factory's over the stage's parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    raise ValueError(
        "ScheduleContinuous: optimizer must be a torch Optimizer or a callable(params) -> Optimizer"
    )


class ScheduleContinuous(ContinuousActions, C.PipelineScheduleMultiBase):
    """Flush-free pipeline schedule: mini-batches flow across optimizer steps without a barrier.

    ``stages``: this rank's one ``PipelineStage`` (loop placement: stage ``r`` on rank ``r``).
    ``optimizer``: an optimizer over this stage's parameters, or a factory
    ``callable(params) -> Optimizer`` called with them (either works in every mode: the
    optimizer always steps the module's own parameters; 2bw/stash keep their weight versions
    as separate copies). The schedule owns the step and the gradients (it sets them to None;
    2bw/stash reuse their memory afterwards, so a hook that keeps one must copy it).
    ``mode``: ``"sync"`` (default, exact synchronous semantics), ``"2bw"`` or ``"stash"``.
    ``post_validate``: keyword arguments of :class:`~zbpipe.continuous.optim.PostValidatedStep`
    (``max_norm``, ``check_finite``) to clip by the global gradient norm / skip non-finite steps
    with no barrier; sync mode only. ``costs`` / ``memory_limit`` go to the plan generator.
    ``split``: the split-backward engine, as for the planned schedules (``"auto"``,
    ``"deferred"``, ``"graph"``; :attr:`split` is the one chosen). ``exact``: the deferred
    engine's W adds each weight gradient as ``AccumulateGrad`` does instead of inside its GEMMs,
    so in sync mode the gradients, and the parameters, are bitwise those of a plain loop that
    runs one fused backward per microbatch (the graph engine ignores it); in 2bw/stash it sums
    each mini-batch's gradient in microbatch order as ``AccumulateGrad`` would.
    ``correction`` (2bw only): ``None`` (default: PipeDream-2BW's update, as published),
    ``"predict"`` (mini-batch ``k`` runs on ``W(k-1) + (W(k-1) - W(k-2))``, a prediction of the
    ``W(k)`` sync would use: weight prediction) or ``"nesterov"`` (``W(k-1) + 2 (W(k-1) -
    W(k-2))``: that prediction plus a one-step look-ahead); docs/use/continuous.md has the
    literature and what each earns back. ``variable_shapes`` (sync mode only): microbatches may
    differ in shape; each mini-batch's shapes travel down the pipeline with its first
    activation (:mod:`zbpipe.continuous.shapes`, docs/use/varlen.md). Without it (the
    default) every microbatch must have the first one's shapes, which stage 0's rank checks
    before a mini-batch is kept or sent (a ``ValueError`` otherwise).
    """

    layout = "loop"
    stages_per_rank = 1

    def __init__(
        self,
        stages: Any,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        use_full_backward: bool | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        optimizer: OptimizerArg,
        mode: Literal["sync", "2bw", "stash"] = "sync",
        costs: Costs | None = None,
        memory_limit: float | None = None,
        post_validate: dict[str, Any] | None = None,
        check_peers: bool = True,
        split: Split = "auto",
        exact: bool = False,
        correction: Literal["predict", "nesterov"] | None = None,
        variable_shapes: bool = False,
    ) -> None:
        """Check the arguments; plan the stream; build the stage seam, the optimizer and the weight
        versions; check that every rank built the same.

        Long because it takes torch's constructor signature plus the continuous options, each
        checked, then set, in order.
        """
        _check_variable_shapes(variable_shapes, mode)
        stages = check_schedule_args(type(self), stages, n_microbatches, costs)
        _check_options(stages, mode, loss_fn, post_validate, correction)
        super().__init__(
            stages=stages,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            use_full_backward=use_full_backward,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
        )
        self.mode = mode
        #: 2bw's delay correction: None (PipeDream-2BW as published), "predict" or "nesterov"
        self.correction = correction
        self.costs = costs if costs is not None else Costs()
        self.stage = stages[0]
        engine = choose_engine(split, stages, type(self).__name__, exact=exact)
        #: the split-backward engine in use: "deferred" or "graph" (see zbpipe.engines)
        self.split: EngineName = engine.name
        engine.check_stages(type(self), stages)
        self.exact = exact  # W adds as AccumulateGrad does (there is no fused BW to keep)
        self.seam = StageSeam(stages, engine)
        self.seam.split_keys = EVERY_KEY  # a continuous plan splits every backward
        p, m = self.pp_group_size, n_microbatches
        self.parts = continuous_parts(p, m, self.costs, memory_limit, mode)
        if log.isEnabledFor(logging.INFO):  # (two more plans and a simulation: only if shown)
            log.info("%s", continuous_tradeoff(p, m, self.costs, memory_limit).summary())
        if check_peers:
            plan = plan_continuous(p, m, self.costs, memory_limit, n_minibatches=2, mode=mode)
            fp = config_fingerprint(type(self), m, self._num_stages, plan)
            fp += "|variable_shapes" if variable_shapes else ""
            check_peers_agree(
                type(self),
                self.stage.group,
                self.rank,
                fp,
                f"ScheduleContinuous(n_microbatches={m}, mode={mode}, "
                f"correction={correction}, variable_shapes={variable_shapes}, plan {fp})",
            )
        self.optimizer = _build_optimizer(optimizer, list(self.stage.submod.parameters()))
        self._pv = (
            PostValidatedStep(self.optimizer, group=self.stage.group, **post_validate)
            if post_validate
            else None
        )
        #: reports of the post-validated steps, in mini-batch order (post_validate only)
        self.step_reports: list[StepReport] = []
        # 2bw on a stage whose mini-batches do not overlap in its order (the last stage of the
        # stream plans): each update applied one mini-batch late, the master is the version
        # the forwards need, no weight copy per step (zbpipe.continuous.versions)
        order = self.parts.join(3)[self.rank]
        self._step_lag = int(mode == "2bw" and correction is None and minibatches_apart(order, m))
        self._versions = (
            WeightVersions(self.stage.submod, mode, correction, on_master=self._step_lag == 1)
            if mode != "sync"
            else None
        )
        self._initialized = False
        self.variable_shapes = variable_shapes
        several_ranks = self._num_stages > 1
        #: variable_shapes=True: each mini-batch's shapes travel with its first activation
        self._shapes = (
            StreamShapes(self.stage, n_microbatches, type(self).__name__)
            if variable_shapes and several_ranks
            else None
        )
        #: otherwise, stage 0's rank: every microbatch must have the first one's shapes
        self._fixed_shapes = (
            FixedShapes(remedy=_FIXED_SHAPES_REMEDY)
            if self.stage.is_first and not variable_shapes
            else None
        )
        self._warned_ignored_inputs = False  # step(x) on a rank without stage 0: warned once
        self._minibatches_before = 0  # mini-batches completed by earlier (flushed) streams
        self._reset_stream()

    # ------------------------------------------------------------------ public API
    @classmethod
    def stage_index_to_rank(cls, num_ranks: int) -> dict[int, int]:
        return {s: s for s in range(num_ranks)}

    @property
    def minibatches_done(self) -> int:
        """Mini-batches whose optimizer step this stage has applied."""
        return self._minibatches_before + self._stepped

    @property
    def in_flight(self) -> bool:
        """True when mini-batches were given since the last :meth:`flush`."""
        return self._given > 0 or (self._pv is not None and self._pv._pending is not None)

    @property
    def live_versions(self) -> int:
        """Weight versions held now (1 in sync mode)."""
        return 1 if self._versions is None else len(self._versions.store)

    @property
    def max_live_versions(self) -> int:
        """The most weight versions held at once so far (1 in sync mode)."""
        return 1 if self._versions is None else self._versions.peak

    @property
    def weight_copies(self) -> int:
        """Copies of this stage's weights made so far (0 in sync mode): 2bw's price per step on
        a stage whose mini-batches overlap, stash's per overtaken forward."""
        return 0 if self._versions is None else self._versions.copies

    @property
    def version_bound(self) -> int:
        """The documented bound on :attr:`max_live_versions` for this stage."""
        return version_bound(self.mode, self._num_stages, self.stage.stage_index)

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list | None = None,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        **kwargs: Any,
    ) -> list[LossRecord]:
        """Hand in one mini-batch and run everything it makes runnable on this rank.

        The mini-batch comes whole (``step(x, target=y)``) or as its microbatches (``arg_mbs``,
        ``kwarg_mbs``, ``target_mbs``: torch 2.14's form, see :mod:`zbpipe.schedules.inputs`);
        ``loss_kwargs`` go to each of its microbatches' ``loss_fn``. torch's ``return_outputs``
        does not apply: a continuous step finishes microbatches of earlier mini-batches, so it
        returns losses, not this mini-batch's outputs.

        Returns (and appends to ``losses`` if given) ``(minibatch_index, [per-microbatch
        losses])`` for the mini-batches whose losses were completed during this call (last
        stage only; mini-batch indices count from the first step, across flushes).
        """
        check_step_args(
            self, args, kwargs, target, arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs
        )
        args, arg_mbs, self._warned_ignored_inputs = drop_inputs_off_stage0(
            self, args, arg_mbs, self._warned_ignored_inputs
        )
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "ScheduleContinuous.step() trains and needs autograd; "
                "do not call it under torch.no_grad()"
            )
        m = self._n_microbatches
        mbs = microbatch_inputs(self, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        arg_mbs, kwarg_mbs, target_mbs = mbs.arg_mbs, mbs.kwarg_mbs, mbs.target_mbs
        self._first_shapes(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs)
        start = self._given * m
        for j in range(m):
            if self.stage.is_first:  # only stage 0 consumes positional inputs (else they pile up)
                self._args[start + j] = arg_mbs[j]
            self._kwargs[start + j] = kwarg_mbs[j]
            if target_mbs is not None:
                self._targets[start + j] = target_mbs[j]
                self._loss_kwargs[start + j] = dict(loss_kwargs or {})
        self.seam.claim_linears()
        self._given += 1
        self._frontier.give(self._given)
        self._run(self._frontier.advance(self._given * m))
        return self._report(losses)

    def _first_shapes(
        self,
        arg_mbs: list,
        kwarg_mbs: list,
        target_mbs: list | None,
        loss_kwargs: dict[str, Any] | None,
    ) -> None:
        """Before anything of a mini-batch is kept or sent: its shapes checked against the
        first's (fixed shapes), and on the first step torch's shape inference and, with
        ``variable_shapes``, the every-rank check of the stage's shape rule (a collective)."""
        if self._fixed_shapes is not None:
            self._fixed_shapes.check(type(self).__name__, arg_mbs, kwarg_mbs)
        if not self._initialized:
            first_target = target_mbs[0] if target_mbs else None
            self._initialize(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
            if self._fixed_shapes is not None:
                self._fixed_shapes.set_up(arg_mbs[0], kwarg_mbs[0])
        if self._shapes is not None and not self._shapes.checked:  # collective, once
            self._shapes.check_every_rank(arg_mbs[0] if self.stage.is_first else (), kwarg_mbs[0])

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported: a continuous schedule only trains (torch's ``eval()`` would train here).

        Evaluate after :meth:`flush` with the stage modules themselves, or with a
        :class:`~zbpipe.Schedule1F1BMulti` built on new ``PipelineStage`` objects over the same
        modules (this schedule re-keys its stages' buffers).
        """
        raise RuntimeError(
            "ScheduleContinuous.eval() is not supported: the continuous schedule only trains; "
            "call flush(), then evaluate with the modules or with a Schedule1F1BMulti built on new "
            "PipelineStages of the same modules"
        )

    def flush(self, losses: list | None = None) -> list[LossRecord]:
        """Finish every mini-batch given: run the drain, wait for all sends, validate the last step.

        Afterwards every stage has stepped its optimizer once per mini-batch given, the
        parameters are final (post-validation settled), nothing is in flight, and ``step()``
        may start a new stream (the mini-batch count continues). Returns the losses not yet
        returned. Call it at the end of training and before evaluation or a checkpoint.
        """
        if self._given:
            self._frontier.drain(self._given)
            self._run(self._frontier.advance(self._given * self._n_microbatches))
            self._step_held()
            if self._frontier.pending():
                raise RuntimeError(
                    "zbpipe continuous: the drain did not finish; the plan is inconsistent"
                )
        self._sends.wait_all()
        self._validate()
        out = self._report(losses)
        if (
            self._stepped != self._given
            or self.seam.pending_weight_passes()
            or C.forward_cache(self.stage)
        ):
            raise RuntimeError(
                f"zbpipe continuous: rank {self.rank} left work after flush "
                f"({self._stepped} of {self._given} steps)"
            )
        self._minibatches_before += self._given
        self._reset_stream()
        return out

    def state_dict(self) -> dict[str, Any]:
        """This stage's module, optimizer state, weight versions (2bw/stash) and mini-batch count.

        Tensors and plain Python only (``torch.load(..., weights_only=True)`` reads it).
        Raises ``RuntimeError`` with work in flight: call flush() first.
        """
        self._refuse_in_flight("state_dict")
        return {
            "mode": self.mode,
            "correction": self.correction,
            "stage_index": self.stage.stage_index,
            "n_microbatches": self._n_microbatches,
            "minibatches_done": self._minibatches_before,
            "module": self.stage.submod.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "versions": self._versions.state_dict() if self._versions is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (same mode and stage; nothing in flight)."""
        self._refuse_in_flight("load_state_dict")
        checks = (
            ("mode", self.mode),
            ("correction", self.correction),
            ("stage_index", self.stage.stage_index),
        )
        for key, mine in checks:
            if state.get(key) != mine:  # (a checkpoint from before corrections has none)
                raise ValueError(
                    f"ScheduleContinuous.load_state_dict: checkpoint has {key}={state.get(key)!r}, "
                    f"this schedule {mine!r}"
                )
        self.stage.submod.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._minibatches_before = int(state["minibatches_done"])
        if self._versions is not None:
            self._versions.load_state_dict(state["versions"])

    # ------------------------------------------------------------------ internals
    def _refuse_in_flight(self, what: str) -> None:
        if self.in_flight:
            raise RuntimeError(
                f"ScheduleContinuous.{what}(): {self._given} mini-batch(es) are in flight; "
                "call flush() first"
            )

    def _reset_stream(self) -> None:
        self._frontier = StreamFrontier(self.parts)
        self._given = 0
        self._stepped = 0
        self._finished = 0
        self._f_count = (
            0  # F passes this rank has run in this stream (the frontier runs ahead of it)
        )
        self._args: dict[int, Any] = {}
        self._kwargs: dict[int, Any] = {}
        self._targets: dict[int, Any] = {}
        self._loss_kwargs: dict[int, dict[str, Any]] = {}  # step(loss_kwargs=...) per microbatch
        self._losses: dict[int, torch.Tensor] = {}
        self._loss_values: dict[int, torch.Tensor] = {}
        self._reported = 0
        self._w_done: dict[int, int] = {}
        self.seam.clear()
        if self._shapes is not None:
            self._shapes.forget()
        #: 2bw/stash: each microbatch's leaf set and its key (zbpipe.continuous.versions)
        self._leaves: dict[int, tuple[tuple[int, int], list[torch.Tensor]]] = {}
        if self._versions is not None:
            self._versions.forget_leaf_sets()
            self._versions.drop_spare_grads()
        self._sends = PendingSends(consume_proofs=True)
        self._proofs = ChainProofs(self.stage.stage_index)

    def _initialize(
        self, args: Any, kwargs: Any, target: Any, loss_kwargs: dict[str, Any] | None
    ) -> None:
        """torch's shape inference and buffers, re-keyed by global microbatch (see module doc).
        torch's backward inference calls ``loss_fn`` too: it gets the step's ``loss_kwargs``."""
        st = self.stage
        st.has_backward = True
        C.initialize_stages(self, args, kwargs, target, loss_kwargs)
        self._act_template, self._grad_template = C.key_by_global_microbatch(st)
        for q in st.submod.parameters():  # shape inference must not leave gradients behind
            q.grad = None
        self._initialized = True

    def _report(self, losses: list | None) -> list[LossRecord]:
        out: list[LossRecord] = []
        if not self.stage.is_last:
            return out
        m = self._n_microbatches
        while self._reported < self._given and all(
            self._reported * m + j in self._loss_values for j in range(m)
        ):
            k = self._reported
            out.append(
                (self._minibatches_before + k, [self._loss_values.pop(k * m + j) for j in range(m)])
            )
            self._reported += 1
        if losses is not None:
            losses.extend(out)
        return out


__all__ = ["ScheduleContinuous"]
