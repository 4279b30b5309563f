"""The torch-facing runtime: run a :class:`~zbpipe.planning.Plan` with torch's action runtime.

:class:`PlannedSchedule` is a ``PipelineScheduleMulti`` (through torch's private
``_PipelineScheduleRuntime``). It never decides an order: a plan generator does, every rank
computes the same plan, and this class

1. lowers the plan to torch's action lists (F->F, B->I, W->W, BW->B) and lets torch insert the
   send/receive (and FSDP unshard/reshard, gradient-reduce) actions;
2. runs the compute actions itself through the stage seam (:mod:`zbpipe.schedules.stage_seam`),
   so the input-gradient pass B and the weight-gradient pass W use zbpipe's engines (``split=``:
   deferred Linear GEMMs, or the general graph split; both correct for the first stage, reused
   weights and custom autograd Functions, where torch's own split is not), and every action is
   timed by a :class:`~zbpipe.observe.trace.Tracer` after its receive has completed. A W that
   directly follows its own B runs fused, as one BW.

Concrete schedules (:mod:`zbpipe.schedules`) only say which plan to build.

Long because it is the one class that turns a plan into torch's runtime: its construction, step and
re-plan share state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch

from .. import _compat as C
from ..engines import EngineName, Split, choose_engine
from ..memory.meter import SavedActivationMeter
from ..observe.agree import check_peers_agree, config_fingerprint
from ..observe.profile import ProfileConfig
from ..observe.trace import Tracer
from ..planning import Costs, Layout, Plan
from ..planning.fuse import fuse_adjacent_backward
from . import measured_start, planned_actions
from .action_loop import ActionProgram, Binder, bind_action, bind_program
from .cost_order import CostOrder, check_microbatch_costs, in_data_order, in_slots
from .entry import entry_name
from .fixed_shapes import FixedShapes
from .inputs import FirstStageKeywords, drop_inputs_off_stage0, microbatch_inputs
from .measured_start import MeasuredStart
from .memory_promise import first_step_plan, promise_words
from .memory_replan import MemoryReplanner
from .nonfinite import NonfiniteLosses
from .pairs import PairRunner, bind_pair
from .plain_order import never_slower
from .replan import CostProfiler
from .sends import PendingSends, proven_sends
from .stage_seam import StageSeam
from .validation import (
    check_plan_for_runtime,
    check_schedule_args,
    check_step_args,
)
from .varlen import ShapeExchange


def plan_to_torch_actions(plan: Plan) -> dict[int, list[Any]]:
    """The plan as torch's compute-only action lists (lossless: see ``_compat.KIND_TO_TORCH``);
    an overlapped pair is one ``OVERLAP_F_B`` action (:mod:`zbpipe.schedules.pairs`)."""

    def torch_action(a: Any) -> Any:
        return C.torch_action(a.stage, C.KIND_TO_TORCH[a.kind], a.microbatch)

    partner = dict(plan.pairs)
    seconds = set(partner.values())
    return {
        rank: [
            C.torch_pair_action(torch_action(a), torch_action(partner[a]))
            if a in partner
            else torch_action(a)
            for a in actions
            if a not in seconds
        ]
        for rank, actions in plan.order.items()
    }


# torch's schedule base is built at import time (_compat's shims for the installed torch), so the
# type checker sees it as Any: subclassing it is the point of this class.
class PlannedSchedule(C._PipelineScheduleRuntime):  # type: ignore[misc]
    """Base class: a multi-stage torch schedule whose order comes from a zbpipe plan.

    Subclasses set ``plan_name`` (a name :func:`zbpipe.planning.plan` knows), ``layout`` and
    ``stages_per_rank``, or override :meth:`build_plan`.
    """

    plan_name: ClassVar[str]
    layout: ClassVar[Layout] = "loop"
    stages_per_rank: ClassVar[int] = 1
    #: takes any number of loop stages per rank from ``stages_per_rank`` up (the stages it is
    #: given say how many); ``stages_per_rank`` is then the number integrations build by default
    any_stages_per_rank: ClassVar[bool] = False
    #: weight gradients bitwise equal to a fused backward's (the ``exact=`` option; set per
    #: instance in ``__init__``, before the plan is built)
    exact: bool = False
    #: does the plan's order depend on the bytes a stage holds? (1F1B's does not: its first
    #: step is not probed)
    memory_planned: ClassVar[bool] = True
    #: do the steps before the bytes are measured run a plan made for the worst bytes
    #: (:func:`zbpipe.schedules.memory_promise.first_step_plan`)? Set where the promise is
    #: 1F1B's peak (or a multiple) or a V formula
    safe_first_step: bool = False
    #: the plan re-made for the measured bytes is chosen, among the plans as fast under the
    #: time costs, as the least slowed by this many cost sets drawn around them
    #: (:mod:`zbpipe.planning.search.perturbed`); 0: the generator's own choice. Set (per
    #: instance, before the plan is built) where the generator takes ``perturbed_ties``
    replan_perturbed_ties: int = 0
    #: how each of torch's computation types becomes a call of the action loop
    #: (:mod:`zbpipe.schedules.action_loop`); a schedule with an action kind of its own adds
    #: an entry: ``action_binders = {**PlannedSchedule.action_binders, KIND: bind_kind}``
    action_binders: ClassVar[Mapping[Any, Binder]] = {
        **planned_actions.BINDERS,
        C.OVERLAP_F_B: bind_pair,  # overlapped pairs: zbpipe.schedules.pairs
    }

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
        split: Split = "auto",
        exact: bool = False,
        measure_memory: bool = True,
        memory_promise: bool = True,
        variable_shapes: bool = False,
        **plan_options: Any,
    ) -> None:
        """Check the arguments; build the plan, the engine, the stage seam and the tracer; check
        that every rank built the same.

        Long because it takes torch's constructor signature plus zbpipe's options, each checked,
        then set, in the order the runtime needs them.
        """
        self.exact = exact  # every BW torch's fused one; W adds as AccumulateGrad does
        # costs="profile": plan for equal costs now, measure real ones on the first steps, re-plan
        # (zbpipe.observe.profile). Everything else about construction is unchanged.
        profiling = _check_profile_args(type(self), costs, profile)
        if not isinstance(measure_memory, bool):
            raise ValueError(
                f"{type(self).__name__}: measure_memory must be True or False, "
                f"got {measure_memory!r}"
            )
        if not isinstance(memory_promise, bool):
            raise ValueError(
                f"{type(self).__name__}: memory_promise must be True or False, "
                f"got {memory_promise!r}"
            )
        #: False: the plan for equal bytes per stage runs from the first step and is not re-made
        #: to keep the promise in the measured bytes, which are still measured and logged
        #: (zbpipe.schedules.memory_replan): speed where the promise binds, for memory
        self.memory_promise = memory_promise
        if not memory_promise and profiling:
            raise ValueError(
                f"{type(self).__name__}: memory_promise=False with costs='profile': the "
                "profile's re-plan keeps the promise in the measured bytes; drop one of them"
            )
        if not memory_promise and getattr(self, "memory_limit", None) is not None:
            raise ValueError(
                f"{type(self).__name__}: memory_promise=False with memory_limit="
                f"{self.memory_limit!r}: the budget is the promise; give a larger memory_limit "
                "instead"
            )
        if not isinstance(variable_shapes, bool):
            raise ValueError(
                f"{type(self).__name__}: variable_shapes must be True or False, "
                f"got {variable_shapes!r}"
            )
        #: microbatches may differ in shape from step to step and within a step: each step's
        #: shapes go down the pipeline before its first send (zbpipe.schedules.varlen)
        self.variable_shapes = variable_shapes
        if profiling:
            costs = None
            if not measure_memory:  # one switch for both ways of measuring bytes
                profile = dataclasses.replace(profile or ProfileConfig(), memory=False)
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
        # costs is a Costs or None by now (check_schedule_args); isinstance says so to mypy
        self.costs = costs if isinstance(costs, Costs) else Costs()
        self._plan_options = plan_options  # kept for a re-plan from measured costs
        #: the agreed per-stage costs once ``costs="profile"`` has measured them (else None)
        self.measured_costs: Costs | None = None
        #: bytes per memory unit of ``measured_costs`` (None until memory was measured)
        self.memory_unit_bytes: float | None = None
        #: the costs the plan was re-made for after the first step measured bytes: the given
        #: times with the measured memory fields (None until then; zbpipe.schedules.memory_replan)
        self.memory_costs: Costs | None = None
        #: how the schedule was named where it was built from a name (torchtitan's config),
        #: so that advice is given in a form that entry point accepts (None: the constructor)
        self.entry_name: str | None = entry_name()
        # never slower than the plain order (zbpipe.schedules.plain_order), here and in both
        # re-plans: each plan made goes through never_slower
        self.plan: Plan = never_slower(
            self,
            self.build_plan(self.pp_group_size, n_microbatches, self.costs, **plan_options),
            self.costs,
        )
        #: the plan for equal bytes per stage (what ``measure_memory=False`` runs throughout)
        self.equal_bytes_plan: Plan = self.plan
        measured = measure_memory and (profile or ProfileConfig()).memory
        if measured and memory_promise and type(self).memory_planned:
            # until the bytes are measured: a plan that keeps the promise whatever they are
            self.plan = first_step_plan(self) or self.plan
        check_plan_for_runtime(self.plan, stages)
        promise = promise_words(self, self.equal_bytes_plan) if type(self).memory_planned else None
        engine = choose_engine(split, stages, type(self).__name__, exact=exact, promise=promise)
        #: the split-backward engine in use: "deferred" or "graph" (see zbpipe.engines)
        self.split: EngineName = engine.name
        if self.plan.uses_split_backward():
            engine.check_stages(type(self), stages)
        if check_peers:
            fingerprint = config_fingerprint(
                type(self), n_microbatches, self._num_stages, self.plan
            )
            # ranks that disagree would send shape messages nobody receives
            fingerprint += "|variable_shapes" if variable_shapes else ""
            summary = (
                f"{type(self).__name__}(n_microbatches={n_microbatches}, "
                f"stages={self._num_stages}, variable_shapes={variable_shapes}, "
                f"plan {fingerprint})"
            )
            check_peers_agree(type(self), stages[0].group, self.rank, fingerprint, summary)
        self.seam = StageSeam(stages, engine)
        self._pairs = PairRunner(self)  # overlapped pairs (OVERLAP_F_B): zbpipe.schedules.pairs
        # Sends go through zbpipe too: each is let go of once known complete, not kept (with the
        # tensor it sent) until the end of the step as torch's runtime does
        # (zbpipe.schedules.sends).
        self._sends = PendingSends()
        self._program: ActionProgram | None = None  # bound at the first step (action_loop)
        self._program_functions: dict[Any, Any] = {}
        # the first step measures the bytes (below) unless told not to
        bytes_measured = measure_memory and (profile or ProfileConfig()).memory
        self._lower(self.plan, probing=bytes_measured and type(self).memory_planned)
        self.tracer = Tracer(rank=self.rank, enabled=trace or profiling, device=stages[0].device)
        self._profiler = (
            CostProfiler(profile or ProfileConfig(), keep_tracing=trace) if profiling else None
        )
        # Memory promises by default: the first step measures bytes, the plan is re-made for
        # them (zbpipe.schedules.memory_replan). With costs="profile" too, from the same probe:
        # its re-plan for the measured times comes steps later, and keeps the promise.
        self._memory_replanner = (
            MemoryReplanner(self._profiler.memory if self._profiler is not None else None)
            if bytes_measured and type(self).memory_planned
            else None
        )
        self._measured_start = (
            MeasuredStart(self)
            if self._memory_replanner is not None
            and memory_promise
            and measured_start.applies(self)
            else None
        )
        # dict/TensorDict batches reach stage 0 by keyword (torch stages take only tensors
        # positionally)
        self._batch_keywords = FirstStageKeywords(stages)
        self._step_opts: tuple[bool, dict[str, Any] | None] = (True, None)
        self._warned_ignored_inputs = False  # step(x) on a rank without stage 0: warned once
        # variable_shapes=True: each step's shapes go down the pipeline before its first send
        # (zbpipe.schedules.varlen). Else nothing is sent: the rank of stage 0 checks that each
        # microbatch has the first step's shapes (zbpipe.schedules.fixed_shapes). One rank: no
        # receive buffers, neither is needed.
        several_ranks = self.pp_group_size > 1
        self._shapes = ShapeExchange() if variable_shapes and several_ranks else None
        holds_first = any(st.is_first for st in stages)
        self._fixed_shapes = (
            FixedShapes() if not variable_shapes and several_ranks and holds_first else None
        )
        # microbatches ordered by their costs (zbpipe.schedules.cost_order): this step's factors
        # (stage 0's rank) and the order every rank runs, None for data order
        self._cost_order = CostOrder()
        self._step_costs: tuple[float, ...] | None = None
        self._slots: tuple[int, ...] | None = None
        # NaN/Inf losses of the last step, checked on the device and resolved when read
        self._nonfinite = NonfiniteLosses(self.rank)
        # torch's custom-function table lists zbpipe's handler for its compute and FSDP actions
        # (one generic function), so code that reads or wraps the table sees a working handler;
        # the action loop binds its table's calls wherever the entry is still this one.
        self._run_action = self.run_action
        for kind in (
            C.FORWARD,
            C.BACKWARD_INPUT,
            C.BACKWARD_WEIGHT,
            C.FULL_BACKWARD,
            C.REDUCE_GRAD,
            C.OVERLAP_F_B,
        ):
            self.register_custom_function(kind, self._run_action)

    # ------------------------------------------------------------------ planning
    def _lower(self, plan: Plan, probing: bool = False) -> None:
        # Run a W that directly follows its own B as one fused BW: same place, less work. A
        # step that probes the bytes keeps microbatch 0's pairs split: a fused BW cannot say
        # what B holds until W (zbpipe.planning.fuse).
        keep = {(s, 0) for s in range(self._num_stages)} if probing else ()
        self.lowered_for_probe = probing
        executed = fuse_adjacent_backward(plan, keep_split=keep)
        #: what runs: ``plan`` with its adjacent B and W fused where that delays no rank (a
        #: fused backward holds nothing after it, so this holds at most what ``plan`` does)
        self.executed_plan: Plan = executed
        self.seam.assign(executed.order[self.rank])
        self._pairs.lowered(executed)
        torch_order = plan_to_torch_actions(executed)
        self.pipeline_order = {r: list(acts) for r, acts in torch_order.items()}
        self._prepare_schedule_with_comms(torch_order)
        self._program = None  # bound again at the next step
        self._sends.set_proofs(
            proven_sends(C.order_with_comms(self), self.rank, plan.placement.__getitem__)
        )

    def replan(self, new_plan: Plan) -> None:
        """Run ``new_plan`` from the next step on (call between steps, on every rank, same plan).

        Lowers it to torch's action lists again (torch re-inserts the communication). The caller
        guarantees the ranks agree (``zbpipe.schedules.replan`` exchanges the fingerprint first).
        """
        check_plan_for_runtime(new_plan, self._stages)
        if new_plan.uses_split_backward():
            self.seam.engine.check_stages(type(self), self._stages)
        self._lower(new_plan)
        self.plan = new_plan

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        """The plan this schedule runs (every rank computes the same one)."""
        from ..planning import plan

        return plan(self.plan_name, num_ranks, n_microbatches, costs=costs, **options)

    @classmethod
    def stage_index_to_rank(
        cls, num_ranks: int, stages_per_rank: int | None = None
    ) -> dict[int, int]:
        """Which rank holds each stage, for integrations that build stages (torchtitan);
        ``stages_per_rank`` for a class that takes several (``any_stages_per_rank``), else the
        class's own."""
        from ..planning import loop_placement, v_placement

        if cls.layout == "v":
            return v_placement(num_ranks)
        per_rank = cls.stages_per_rank
        if stages_per_rank is not None and cls.any_stages_per_rank:
            per_rank = stages_per_rank
        return loop_placement(num_ranks, num_ranks * per_rank)

    # ------------------------------------------------------------------ stepping
    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        microbatch_costs: Sequence[float] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step over ``n_microbatches`` microbatches (torch 2.14's ``step`` contract, on
        any torch).

        The rank holding stage 0 passes the batch: whole (``args``: tensors, or a dict / TensorDict
        that stage 0 receives split into microbatches, see :mod:`zbpipe.schedules.inputs`) or
        already split (``arg_mbs``: one tuple per microbatch; ``kwarg_mbs``: one dict per
        microbatch). The rank holding the last stage passes ``target`` (or ``target_mbs``) and may
        pass a ``losses`` list to receive the per-microbatch losses; ``loss_kwargs`` go to every
        microbatch's ``loss_fn(output, target, **loss_kwargs)``. See :mod:`zbpipe.schedules.inputs`.
        ``microbatch_costs``: run the microbatches in their fastest order (:mod:`.cost_order`).
        """
        self._step_costs = check_microbatch_costs(self, microbatch_costs, self.variable_shapes)
        check_step_args(
            self, args, kwargs, target, arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs
        )
        args, arg_mbs, self._warned_ignored_inputs = drop_inputs_off_stage0(
            self, args, arg_mbs, self._warned_ignored_inputs
        )
        # A whole dict/TensorDict batch goes to stage 0 by keyword (zbpipe.schedules.inputs).
        args, kwargs = self._batch_keywords.bind(args, kwargs, self._n_microbatches)
        mbs = microbatch_inputs(self, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        if arg_mbs is not None:  # dict/TensorDict microbatches reach stage 0 by keyword too
            bound = [self._batch_keywords.bind(a, k, 1) for a, k in zip(mbs.arg_mbs, mbs.kwarg_mbs)]
            mbs = dataclasses.replace(
                mbs, arg_mbs=[a for a, _ in bound], kwarg_mbs=[k for _, k in bound]
            )
        self.tracer.clear()
        if self._profiler is not None:
            self._profiler.before_step(self)  # memory is probed during the profiled steps
        if self._memory_replanner is not None:
            self._memory_replanner.before_step(self)  # the first step's bytes are probed
        out = C.run_microbatches(
            self, mbs.arg_mbs, mbs.kwarg_mbs, mbs.target_mbs, losses, return_outputs, loss_kwargs
        )
        if self._profiler is not None and self._has_backward:
            # A forward-only step (eval()) is not what the plan runs: it is not profiled.
            self._profiler.after_step(self)  # collective on the profiling window's last step
        if self._memory_replanner is not None and self._has_backward:
            self._memory_replanner.after_step(self)  # collective after the first step
        return out

    def _choose_slots(self) -> tuple[int, ...] | None:
        """The order of this step's microbatches over the plan's slots (stage 0's rank, given
        ``microbatch_costs``); None: data order, or another rank (it learns the order)."""
        costs, self._step_costs = self._step_costs, None
        if costs is None or not any(st.is_first for st in self._stages):
            return None
        return self._cost_order.slots(self.plan, self.costs, costs)

    def _update_losses(self, stages: Any, losses: list[Any] | None) -> None:
        if self._slots is not None:  # back in the caller's order (zbpipe.schedules.cost_order)
            slots, self._slots = self._slots, None
            if len(self._internal_losses) == len(slots):
                self._internal_losses[:] = in_data_order(self._internal_losses, slots)
            for st in self._stages:
                if st.is_last and len(st.output_chunks) == len(slots):
                    st.output_chunks[:] = in_data_order(st.output_chunks, slots)
        # torch hands the losses over (and clears its own list) here: check them first, whether
        # or not the caller asked for them.
        self._report_nonfinite_losses(self._internal_losses)
        if not self._internal_losses and not self._has_backward:
            # A forward-only step without a target computed no loss: there is none to return
            # (torch's check would count zero losses against n_microbatches and raise).
            if losses is not None:
                losses.clear()
            return
        super()._update_losses(stages, losses)

    def _report_nonfinite_losses(self, losses: list[Any]) -> None:
        # No host-device sync inside step(): the flags stay on the device until read.
        self._nonfinite.record(losses)

    @property
    def nonfinite_microbatches(self) -> list[int]:
        """Microbatches whose loss was NaN/Inf in the last step (last-stage rank only).

        On an accelerator, reading this waits for the last step's losses (and logs the warning).
        """
        return self._nonfinite.resolve()

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        # torch's custom-function context carries no return_outputs / loss_kwargs: keep them here.
        self._step_opts = (return_outputs, loss_kwargs)
        self.seam.claim_linears()
        self._pairs.claim()
        try:
            self._run_actions(arg_mbs, kwarg_mbs, target_mbs, losses, loss_kwargs)
            self._sends.wait_all()
            if pending := self.seam.pending_weight_passes():
                raise RuntimeError(
                    f"zbpipe: weight passes never ran for (stage, microbatch) {pending}"
                )
            if self.scale_grads and self._n_microbatches != 1:
                self._scale_grads_once()
        except BaseException:
            # torch hands the losses over (and empties its list) only at a step's end: a failed
            # step's losses, whose graphs B freed, must not be the next step's
            self._internal_losses.clear()
            raise
        finally:
            # A failed step must not leak autograd graphs or saved activations into the next one
            # (nor wait on sends a failed peer will never receive).
            self._sends.abandon()
            self.seam.clear()

    def _scale_grads_once(self) -> None:
        """Divide each parameter's gradient by ``n_microbatches``, once per parameter.

        torch divides at each stage's REDUCE_GRAD action, parameter by parameter of that stage: a
        parameter shared by two stages of this rank (a tied embedding on a V schedule's first and
        last stage) would be divided twice, the first time before the other stage has added its
        part. Here the division waits for the end of the step and sees every parameter once.
        """
        seen: set[int] = set()
        for stage in self.seam.stages.values():
            if not stage.has_backward:  # a forward-only step leaves gradients alone
                continue
            for p in stage.submod.parameters():
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    p.grad.div_(self._n_microbatches)

    def attach_meter(self, meter: SavedActivationMeter) -> None:
        """Count this rank's saved-activation bytes with ``meter`` (see :mod:`zbpipe.memory`)."""
        self.seam.meter = meter

    # ------------------------------------------------------------------ the action loop
    def _run_actions(
        self,
        arg_mbs: list[Any] | None,
        kwarg_mbs: list[Any] | None,
        target_mbs: list[Any] | None,
        losses: list[Any] | None,
        loss_kwargs: dict[str, Any] | None,
    ) -> None:
        """torch's ``_PipelineScheduleRuntime._step_microbatches`` with zbpipe's action loop:
        the same prologue (input checks, shape inference on the first step) and epilogue
        (unshard check, losses), the actions run as bound calls (:mod:`.action_loop`)."""
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        if self._fixed_shapes is not None:  # stage 0's rank, before any message (fixed_shapes)
            self._fixed_shapes.check(type(self).__name__, arg_mbs, kwarg_mbs)
        C.initialize_stages(self, arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        if self._fixed_shapes is not None:
            self._fixed_shapes.set_up(arg_mbs[0], kwarg_mbs[0])
        slots = self._choose_slots()
        if slots is not None:  # stage 0's rank: its microbatches in the order they run
            arg_mbs, kwarg_mbs = in_slots(arg_mbs, slots), in_slots(kwarg_mbs, slots)
        learnt = False  # the order came from stage 0's rank with the shapes
        if self._shapes is not None:  # variable_shapes=True on several ranks (varlen.py)
            learnt = slots is None
            slots = self._shapes.before_step(self, arg_mbs, kwarg_mbs, slots)
        self._slots = slots if slots is not None and list(slots) != sorted(slots) else None
        if learnt and self._slots is not None:
            # a rank without stage 0 learnt the order: its keyword inputs (which reach every
            # stage, a packed batch's metadata say) follow it
            kwarg_mbs = in_slots(kwarg_mbs, self._slots)
        if self._slots is not None and target_mbs is not None:
            target_mbs = in_slots(target_mbs, self._slots)
        C.backward_counter(self).clear()
        ctx = C.pipeline_context(self, arg_mbs, kwarg_mbs, target_mbs, losses)
        if self._measured_start is not None and self._has_backward:
            # a V schedule's first step, in two parts (zbpipe.schedules.measured_start)
            start, self._measured_start, self._program = self._measured_start, None, None
            try:
                start.run(self, ctx)
            except BaseException:
                # a part of the step is lowered: a failed first step leaves the whole plan
                self._lower(self.plan, probing=self.lowered_for_probe)
                raise
        else:
            functions = C.custom_functions(self)
            if self._program is None or functions != self._program_functions:
                self._program = bind_program(
                    self, C.order_with_comms(self), self.action_binders, functions, self._run_action
                )
                self._program_functions = dict(functions)
            self._program.run(ctx)
        C.check_unshards_used(self)
        self._update_losses(self._stages, losses)

    def run_action(self, action: Any, ctx: Any) -> None:
        """Run one action through :attr:`action_binders` (binding it first): what torch's
        custom-function table lists for zbpipe's actions, for code that calls it directly."""
        call = bind_action(self, action, self.action_binders, {}, None)
        if call is not None:
            call(ctx)


def _check_profile_args(cls: type, costs: Any, profile: Any) -> bool:
    """True for ``costs="profile"``; a ValueError for other strings or a stray ``profile=``."""
    if isinstance(costs, str):
        if costs != "profile":
            raise ValueError(
                f"{cls.__name__}: costs must be a zbpipe.Costs, None or 'profile', got {costs!r}"
            )
        if profile is not None and not isinstance(profile, ProfileConfig):
            raise ValueError(
                f"{cls.__name__}: profile must be a zbpipe.ProfileConfig, got {profile!r}"
            )
        return True
    if profile is not None:
        raise ValueError(
            f"{cls.__name__}: profile= only applies with costs='profile'; "
            "pass costs='profile' or drop it"
        )
    return False
