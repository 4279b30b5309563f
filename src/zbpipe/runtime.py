"""The torch-facing runtime: run a zbpipe :class:`~zbpipe.plan.Plan` with torch's action runtime.

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

import logging
from typing import Any, Callable, ClassVar, Literal

import torch

from . import _compat as C
from .backward import WeightGrad, backward_input
from .plan import Costs, Plan
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

    Subclasses set ``plan_name`` (a name :func:`zbpipe.plan` knows), ``placement`` and
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
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        costs: Costs | None = None,
        trace: bool = True,
        check_peers: bool = True,
        **plan_options: Any,
    ) -> None:
        stages = check_schedule_args(type(self), stages, n_microbatches, costs)
        super().__init__(
            stages=stages,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
        )
        self.costs = costs if costs is not None else Costs()
        self.plan: Plan = self.build_plan(self.pp_group_size, n_microbatches, self.costs, **plan_options)
        check_plan_for_runtime(self.plan, stages)
        if self.plan.uses_split_backward():
            check_not_compiled(type(self), stages)
        if check_peers:
            fingerprint = config_fingerprint(type(self), n_microbatches, self._num_stages, self.plan)
            summary = f"{type(self).__name__}(n_microbatches={n_microbatches}, stages={self._num_stages}, plan {fingerprint})"
            check_peers_agree(type(self), stages[0].group, self.rank, fingerprint, summary)
        torch_order = plan_to_torch_actions(self.plan)
        self.pipeline_order = {r: list(acts) for r, acts in torch_order.items()}
        self._prepare_schedule_with_comms(torch_order)
        self.tracer = Tracer(rank=self.rank, enabled=trace)
        self._stage_by_index = {s.stage_index: s for s in stages}
        self._pending_w: dict[tuple[int, int], WeightGrad] = {}
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
    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        """The plan this schedule runs (every rank computes the same one)."""
        from .plan import plan

        return plan(self.plan_name, num_ranks, n_microbatches, costs=costs, **options)

    @classmethod
    def stage_index_to_rank(cls, num_ranks: int) -> dict[int, int]:
        """Which rank holds each stage, for integrations that build stages (torchtitan)."""
        from .plan import loop_placement, v_placement

        if cls.placement == "v":
            return v_placement(num_ranks)
        return loop_placement(num_ranks, num_ranks * cls.stages_per_rank)

    # ------------------------------------------------------------------ stepping
    def step(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """Run one step over ``n_microbatches`` microbatches (torch's ``step`` contract).

        The rank holding stage 0 passes the batch (``args``); the rank holding the last stage
        passes ``target`` and may pass a ``losses`` list to receive the per-microbatch losses.
        """
        check_step_args(self, args, target)
        self.tracer.clear()
        out = super().step(*args, target=target, losses=losses, **kwargs)
        self._report_nonfinite_losses(losses)
        return out

    def _report_nonfinite_losses(self, losses: list | None) -> None:
        if not losses:
            return
        bad = [i for i, l in enumerate(losses) if isinstance(l, torch.Tensor) and not torch.isfinite(l).all()]
        self.nonfinite_microbatches = bad
        if bad:
            logger.warning("zbpipe: non-finite loss in microbatch(es) %s on rank %d", bad, self.rank)

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
        self._pending_w.clear()
        try:
            super()._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs)
        finally:
            # A failed step must not leak autograd graphs into the next one.
            self._pending_w.clear()
        if self._pending_w:
            raise RuntimeError(f"zbpipe: weight passes never ran for {sorted(self._pending_w)}")

    def _wait_recv(self, ops: dict, stage_idx: int, mb: int, what: str) -> None:
        key = (stage_idx, mb)
        if key not in ops:
            raise RuntimeError(f"zbpipe: rank {self.rank} ran {what} of stage {stage_idx} mb {mb} before its receive")
        C._wait_batch_p2p(ops.pop(key))

    def _run_forward(self, action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self._stage_by_index[s]
        self._assert_unsharded(stage)
        if not stage.is_first and (s - 1) not in self._stage_by_index:
            self._wait_recv(self.fwd_recv_ops, s, mb, "F")
        return_outputs, loss_kwargs = self._step_opts
        with self.tracer.span("F", s, mb):
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
        stage = self._backward_prologue(s, mb)
        with self.tracer.span("B", s, mb):
            stage_output, input_values = stage.fwd_cache.pop(mb)
            if stage.is_last:
                outputs, output_grads = (self._maybe_get_loss(stage, mb),), None
            else:
                outputs, output_grads = stage_output, stage._retrieve_recv_grads(mb)
            params = [p for p in stage.submod.parameters() if p.requires_grad]
            with _dp_no_sync(stage):
                grads, weight_grad = backward_input(outputs, output_grads, input_values, params)
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
        self._assert_unsharded(stage)
        self.backward_counter[s] += 1
        weight_grad = self._pending_w.pop((s, mb))
        with self.tracer.span("W", s, mb), _dp_no_sync(stage):
            weight_grad.run()

    def _run_full_backward(self, action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self._backward_prologue(s, mb)
        self.backward_counter[s] += 1
        last = self.backward_counter[s] == self._n_microbatches
        with self.tracer.span("BW", s, mb):
            stage.backward_one_chunk(mb, loss=self._maybe_get_loss(stage, mb), full_backward=True, last_backward=last)
        self._backward_epilogue(stage, mb)


class _dp_no_sync:
    """Keep FSDP2 from reducing gradients inside a microbatch's B or W.

    The gradient reduction of a stage follows its last W (torch lowers a REDUCE_GRAD action
    after it), not its last B. Mirrors what torch's stage does around its own backward.
    """

    def __init__(self, stage: Any) -> None:
        self.module = stage.submod

    def __enter__(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.module, FSDPModule):
            self.module.set_is_last_backward(False)
            self.module.set_reshard_after_backward(False)
            self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc: object) -> None:
        return None
