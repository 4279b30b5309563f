"""The torch-facing runtime: run a zbpipe :class:`~zbpipe.planning.Plan` with torch's action runtime.

:class:`PlannedSchedule` is a ``PipelineScheduleMulti`` (through torch's private
``_PipelineScheduleRuntime``). It never decides an order: a plan generator does, every rank
computes the same plan, and this class

1. lowers the plan to torch's action lists (F->F, B->I, W->W, BW->B) and lets torch insert the
   send/receive (and FSDP unshard/reshard, gradient-reduce) actions;
2. runs the compute actions itself, so the input-gradient pass B and the weight-gradient pass W
   go through :mod:`zbpipe.backward` (correct for the first stage, reused weights and custom
   autograd Functions, where torch's own split is not), and every action is timed by a
   :class:`~zbpipe.trace.Tracer` after its receive has completed.

Concrete schedules (:mod:`zbpipe.schedules`) only say which plan to build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, ClassVar, Literal

import torch
from torch.distributed.fsdp import FSDPModule

from . import _compat as C
from .backward import WeightGrad, backward_input
from .inputs import FirstStageKeywords
from .memory import SavedActivationMeter
from .planning import Costs, Plan
from .profile import CostProfiler, ProfileConfig
from .saved import SavedTensors, param_storages
from .step_inputs import microbatch_inputs
from .trace import Tracer
from .validation import (
    check_not_compiled,
    check_peers_agree,
    check_plan_for_runtime,
    check_schedule_args,
    check_step_args,
    config_fingerprint,
)

logger = logging.getLogger(__name__)


def plan_to_torch_actions(plan: Plan) -> dict[int, list[Any]]:
    """The plan as torch's compute-only action lists (lossless: see ``zbpipe._compat.KIND_TO_TORCH``)."""
    return {
        rank: [C._Action(a.stage, C.KIND_TO_TORCH[a.kind], a.microbatch) for a in actions]
        for rank, actions in plan.order.items()
    }


class PlannedSchedule(C._PipelineScheduleRuntime):
    """Base class: a multi-stage torch schedule whose order comes from a zbpipe plan.

    Subclasses set ``plan_name`` (a name :func:`zbpipe.planning` knows), ``placement`` and
    ``stages_per_rank``, and may override :meth:`build_plan`.
    """

    plan_name: ClassVar[str]
    placement: ClassVar[Literal["loop", "v"]] = "loop"
    stages_per_rank: ClassVar[int] = 1

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
        costs: Costs | Literal["profile"] | None = None,
        profile: ProfileConfig | None = None,
        trace: bool = True,
        check_peers: bool = True,
        **plan_options: Any,
    ) -> None:
        # costs="profile": plan for equal costs now, measure real ones on the first steps, re-plan
        # (zbpipe.profile). Everything else about construction is unchanged.
        profiling = _check_profile_args(type(self), costs, profile)
        if profiling:
            costs = None
        stages = check_schedule_args(type(self), stages, n_microbatches, costs)
        super().__init__(
            stages=stages,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            use_full_backward=use_full_backward,  # torch's deprecated flag: it warns and ignores it
            backward_requires_autograd=backward_requires_autograd,
        )
        self.costs = costs if costs is not None else Costs()
        self._plan_options = plan_options  # kept for a re-plan from measured costs
        #: the agreed per-stage costs once ``costs="profile"`` has measured them (else None)
        self.measured_costs: Costs | None = None
        self.plan: Plan = self.build_plan(
            self.pp_group_size, n_microbatches, self.costs, **plan_options
        )
        check_plan_for_runtime(self.plan, stages)
        if self.plan.uses_split_backward():
            check_not_compiled(type(self), stages)
        if check_peers:
            fingerprint = config_fingerprint(
                type(self), n_microbatches, self._num_stages, self.plan
            )
            summary = f"{type(self).__name__}(n_microbatches={n_microbatches}, stages={self._num_stages}, plan {fingerprint})"
            check_peers_agree(type(self), stages[0].group, self.rank, fingerprint, summary)
        self._lower(self.plan)
        self.tracer = Tracer(rank=self.rank, enabled=trace or profiling, device=stages[0].device)
        self._profiler = (
            CostProfiler(profile or ProfileConfig(), keep_tracing=trace) if profiling else None
        )
        self._stage_by_index = {s.stage_index: s for s in stages}
        # dict/TensorDict batches reach stage 0 by keyword (torch stages take only tensors positionally)
        self._batch_keywords = FirstStageKeywords(stages)
        self._pending_w: dict[tuple[int, int], WeightGrad] = {}
        self._saved: dict[tuple[int, int], SavedTensors] = {}
        self._meter: SavedActivationMeter | None = None
        self._step_opts: tuple[bool, dict[str, Any] | None] = (True, None)
        #: microbatches whose loss was NaN/Inf in the last step (last-stage rank only)
        self.nonfinite_microbatches: list[int] = []
        for kind, fn in (
            (C.FORWARD, self._run_forward),
            (C.BACKWARD_INPUT, self._run_backward_input),
            (C.BACKWARD_WEIGHT, self._run_backward_weight),
            (C.FULL_BACKWARD, self._run_full_backward),
        ):
            self.register_custom_function(kind, fn)

    # ------------------------------------------------------------------ planning
    def _lower(self, plan: Plan) -> None:
        self._split_backward = plan.uses_split_backward()
        torch_order = plan_to_torch_actions(plan)
        self.pipeline_order = {r: list(acts) for r, acts in torch_order.items()}
        self._prepare_schedule_with_comms(torch_order)

    def replan(self, new_plan: Plan) -> None:
        """Run ``new_plan`` from the next step on (call between steps, on every rank, same plan).

        Lowers it to torch's action lists again (torch re-inserts the communication). The caller
        guarantees the ranks agree (``zbpipe.profile`` exchanges the fingerprint first).
        """
        check_plan_for_runtime(new_plan, self._stages)
        if new_plan.uses_split_backward():
            check_not_compiled(type(self), self._stages)
        self._lower(new_plan)
        self.plan = new_plan

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        """The plan this schedule runs (every rank computes the same one)."""
        from .planning import plan

        return plan(self.plan_name, num_ranks, n_microbatches, costs=costs, **options)

    @classmethod
    def stage_index_to_rank(cls, num_ranks: int) -> dict[int, int]:
        """Which rank holds each stage, for integrations that build stages (torchtitan)."""
        from .planning import loop_placement, v_placement

        if cls.placement == "v":
            return v_placement(num_ranks)
        return loop_placement(num_ranks, num_ranks * cls.stages_per_rank)

    # ------------------------------------------------------------------ stepping
    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step over ``n_microbatches`` microbatches (torch 2.14's ``step`` contract, on any torch).

        The rank holding stage 0 passes the batch: whole (``args``: tensors, or a dict / TensorDict
        that stage 0 receives split into microbatches, see :mod:`zbpipe.inputs`) or already split
        (``arg_mbs``: one tuple per microbatch; ``kwarg_mbs``: one dict per microbatch). The rank
        holding the last stage passes ``target`` (or ``target_mbs``) and may pass a ``losses`` list
        to receive the per-microbatch losses; ``loss_kwargs`` go to every microbatch's
        ``loss_fn(output, target, **loss_kwargs)``. See :mod:`zbpipe.step_inputs`.
        """
        check_step_args(
            self, args, kwargs, target, arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs
        )
        # A whole dict/TensorDict batch goes to stage 0 by keyword (zbpipe.inputs).
        args, kwargs = self._batch_keywords.bind(args, kwargs, self._n_microbatches)
        mbs = microbatch_inputs(self, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        if arg_mbs is not None:  # dict/TensorDict microbatches reach stage 0 by keyword too
            bound = [self._batch_keywords.bind(a, k, 1) for a, k in zip(mbs.arg_mbs, mbs.kwarg_mbs)]
            mbs = dataclasses.replace(
                mbs, arg_mbs=[a for a, _ in bound], kwarg_mbs=[k for _, k in bound]
            )
        self.tracer.clear()
        out = C.run_microbatches(
            self, mbs.arg_mbs, mbs.kwarg_mbs, mbs.target_mbs, losses, return_outputs, loss_kwargs
        )
        if self._profiler is not None:
            self._profiler.after_step(self)  # collective on the profiling window's last step
        return out

    def _update_losses(self, stages: Any, losses: list | None) -> None:
        # torch hands the losses over (and clears its own list) here: check them first, whether
        # or not the caller asked for them.
        self._report_nonfinite_losses(self._internal_losses)
        super()._update_losses(stages, losses)

    def _report_nonfinite_losses(self, losses: list) -> None:
        bad = [
            i
            for i, l in enumerate(losses)
            if isinstance(l, torch.Tensor) and not torch.isfinite(l).all()
        ]
        self.nonfinite_microbatches = bad
        if bad:
            logger.warning(
                "zbpipe: non-finite loss in microbatch(es) %s on rank %d", bad, self.rank
            )

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        # torch's custom-function context carries no return_outputs / loss_kwargs: keep them here.
        self._step_opts = (return_outputs, loss_kwargs)
        try:
            super()._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs
            )
            if self._pending_w:
                raise RuntimeError(
                    f"zbpipe: weight passes never ran for (stage, microbatch) {sorted(self._pending_w)}"
                )
        finally:
            # A failed step must not leak autograd graphs or saved activations into the next one.
            self._pending_w.clear()
            for saved in self._saved.values():
                saved.release_all()
            self._saved.clear()

    def attach_meter(self, meter: SavedActivationMeter) -> None:
        """Count this rank's saved-activation bytes with ``meter`` (see :mod:`zbpipe.memory`)."""
        self._meter = meter

    def _hold_saved(self, stage: Any, mb: int) -> Any:
        """Own what this forward saves (zbpipe.saved), so B and W can release it early."""
        if not stage.has_backward or not (self._split_backward or self._meter is not None):
            return contextlib.nullcontext()
        saved = SavedTensors(observer=self._meter, skip=param_storages(stage.submod.parameters()))
        self._saved[(stage.stage_index, mb)] = saved
        return saved.hooks()

    def _release_saved(self, s: int, mb: int) -> None:
        saved = self._saved.pop((s, mb), None)
        if saved is not None:
            saved.release_all()

    def _wait_recv(self, ops: dict, stage_idx: int, mb: int, what: str) -> None:
        key = (stage_idx, mb)
        if key not in ops:
            raise RuntimeError(
                f"zbpipe: rank {self.rank} ran {what} of stage {stage_idx} mb {mb} before its receive"
            )
        C._wait_batch_p2p(ops.pop(key))

    def _run_forward(self, action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self._stage_by_index[s]
        self._assert_unsharded(stage)
        if not stage.is_first and (s - 1) not in self._stage_by_index:
            self._wait_recv(self.fwd_recv_ops, s, mb, "F")
        return_outputs, loss_kwargs = self._step_opts
        with self.tracer.span("F", s, mb), self._hold_saved(stage, mb):
            output = stage.forward_one_chunk(
                mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=return_outputs
            )
            self._maybe_compute_loss(stage, output, ctx.target_mbs, mb, loss_kwargs)
        if (s + 1) in self._stage_by_index:  # V placement: the next stage is local, no send
            self._stage_by_index[s + 1].set_local_fwd_input(output, mb)

    def _backward_prologue(self, s: int, mb: int) -> Any:
        stage = self._stage_by_index[s]
        self._assert_unsharded(stage)
        if not stage.is_last and (s + 1) not in self._stage_by_index:
            self._wait_recv(self.bwd_recv_ops, s, mb, "backward")
        return stage

    def _backward_epilogue(self, stage: Any, mb: int) -> None:
        prev = self._stage_by_index.get(stage.stage_index - 1)
        if prev is not None:  # V placement: hand the input gradient to the local previous stage
            prev.set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def _run_backward_input(self, action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        if not self._stage_by_index[
            s
        ].has_backward:  # eval(), or no loss_fn: forward only, like torch
            return
        stage = self._backward_prologue(s, mb)
        with self.tracer.span("B", s, mb):
            stage_output, input_values = stage.fwd_cache.pop(mb)
            if stage.is_last:
                outputs, output_grads = (self._maybe_get_loss(stage, mb),), None
            else:
                outputs, output_grads = stage_output, stage._retrieve_recv_grads(mb)
            _prepare_fsdp(stage)
            # Read the parameters after _prepare_fsdp: under FSDP2 it unshards the stage first, so
            # these are the unsharded tensors the forward used (the graph's leaves).
            params = [p for p in stage.submod.parameters() if p.requires_grad]
            grads, weight_grad = backward_input(
                outputs, output_grads, input_values, params, saved=self._saved.get((s, mb))
            )
            self._pending_w[(s, mb)] = weight_grad
            num_args = len(stage._stage_meta.inputs)
            stage.bwd_cache[mb] = tuple(grads[:num_args])
            if stage.is_last and not stage.is_first:
                # The outputs are only kept to be merged for the user: free their graph now.
                for t in stage_output:
                    if isinstance(t, torch.Tensor) and not t._is_view():
                        t.detach_()
        self._backward_epilogue(stage, mb)

    def _run_backward_weight(self, action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self._stage_by_index[s]
        if not stage.has_backward:
            return
        self._assert_unsharded(stage)
        weight_grad = self._pending_w.pop((s, mb))
        with self.tracer.span("W", s, mb):
            _prepare_fsdp(stage)
            weight_grad.run()
        self._release_saved(s, mb)

    def _run_full_backward(self, action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self._backward_prologue(s, mb)
        self.backward_counter[s] += 1
        last = self.backward_counter[s] == self._n_microbatches
        with self.tracer.span("BW", s, mb):
            stage.backward_one_chunk(
                mb, loss=self._maybe_get_loss(stage, mb), full_backward=True, last_backward=last
            )
        self._release_saved(s, mb)
        self._backward_epilogue(stage, mb)


def _check_profile_args(cls: type, costs: Any, profile: Any) -> bool:
    """True for ``costs="profile"``; a ValueError for other strings or a stray ``profile=``."""
    if isinstance(costs, str):
        if costs != "profile":
            raise ValueError(
                f"{cls.__name__}: costs must be a zbpipe.Costs, None or 'profile', got {costs!r}"
            )
        if profile is not None and not isinstance(profile, ProfileConfig):
            raise ValueError(
                f"{cls.__name__}: profile must be a zbpipe.profile.ProfileConfig, got {profile!r}"
            )
        return True
    if profile is not None:
        raise ValueError(
            f"{cls.__name__}: profile= only applies with costs='profile'; pass costs='profile' or drop it"
        )
    return False


def _prepare_fsdp(stage: Any) -> None:
    """Prepare an FSDP2 stage for one split backward pass (B or W) of one microbatch.

    1. No gradient reduction inside a microbatch's B or W: the reduce-scatter of a stage follows
       its LAST W (torch lowers a REDUCE_GRAD action after it, which calls FSDP's post-backward
       once), not its last B. Mirrors what torch's stage does around its own backward. FSDP2's
       own hooks stay harmless: its pre-backward hook (on the stage outputs, so it fires in B
       only) queues a final callback that runs post_backward with sync off (accumulate only),
       and W's ``autograd.grad`` calls start inside the graph, below every FSDP hook.
    2. Every FSDP module of the stage is unsharded (a no-op when it already is). With
       ``reshard_after_forward=True`` a block is resharded after each forward, and FSDP2 then
       registers the *sharded* DTensor parameters on the module. B must collect the unsharded
       parameters (the leaves of the forward's graph; FSDP2 keeps those objects across
       reshards): collected from a resharded block they are DTensors no graph node leads to,
       and W silently drops their gradients. W may also read a weight (a weight-norm's grad
       does) whose storage a later microbatch's forward freed. FSDP2's pre-backward hook would
       all-gather in B anyway; for W it is one extra all-gather when a forward resharded the
       block in between, the price of ``reshard_after_forward=True`` with a split backward.
       Every dp rank runs the same plan, so these collectives match across the dp group.
    """
    module = stage.submod
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.unshard()
