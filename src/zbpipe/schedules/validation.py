"""Construction-time checks for zbpipe schedules.

Everything here runs before any communication and depends only on arguments every rank has,
so a misconfiguration raises the same ``ValueError`` on every rank instead of hanging at the
first send.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat as C
from ..planning import Costs, Plan


def check_schedule_args(cls: type, stages: Any, n_microbatches: Any, costs: Any) -> list[Any]:
    """Validate a schedule's constructor arguments; return the stages as a list.

    Long because it holds every construction-time check of the shared arguments, in the order a
    user reads the signature.
    """
    name = cls.__name__
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
        raise ValueError(f"{name}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
    if n_microbatches < 1:
        raise ValueError(
            f"{name}: n_microbatches must be >= 1, got {n_microbatches}; "
            "pass the number of microbatches per step"
        )
    if isinstance(stages, C._PipelineStageBase):
        stages = [stages]
    if not isinstance(stages, (list, tuple)) or not stages:
        raise ValueError(
            f"{name}: stages must be a non-empty list of torch PipelineStage objects, "
            f"got {stages!r}"
        )
    for i, st in enumerate(stages):
        if not isinstance(st, C._PipelineStageBase):
            raise ValueError(
                f"{name}: stages[{i}] is a {type(st).__name__}, "
                "not a torch.distributed.pipelining.PipelineStage; "
                "wrap each model chunk in PipelineStage(module, stage_index, num_stages, device)"
            )
    if costs is not None and not isinstance(costs, Costs):
        raise ValueError(
            f"{name}: costs must be a zbpipe.Costs, 'profile' or None, got {type(costs).__name__}"
        )
    from torch.nn.parallel import DistributedDataParallel

    for st in stages:
        if isinstance(st.submod, DistributedDataParallel):
            raise ValueError(
                f"{name}: stage {st.stage_index} is wrapped in DistributedDataParallel, "
                "whose gradient all-reduce hooks do not fire for a split backward's weight pass "
                "(gradients would stay unsynchronized); "
                "shard the stage with FSDP2 (fully_shard) or replicate() instead"
            )
    first = stages[0]
    num_ranks, rank, num_stages = first.group_size, first.group_rank, first.num_stages
    for st in stages[1:]:
        if (st.group_size, st.group_rank, st.num_stages) != (num_ranks, rank, num_stages):
            raise ValueError(
                f"{name}: all stages on a rank must share one process group and num_stages; "
                f"stage {first.stage_index} has "
                f"(group size {num_ranks}, rank {rank}, num_stages {num_stages}), "
                f"stage {st.stage_index} has ({st.group_size}, {st.group_rank}, {st.num_stages})"
            )
    per_rank = cls.stages_per_rank
    flexible = getattr(cls, "any_stages_per_rank", False)
    if flexible and len(stages) >= per_rank:
        per_rank = len(stages)  # (ZB-Interleaved: 2 or more loop stages per rank)
    if len(stages) != per_rank:
        raise ValueError(
            f"{name}: expects exactly {per_rank} stage(s) per rank, got {len(stages)}; "
            f"build {per_rank} PipelineStage(s) on each rank ({per_rank * num_ranks} in total)"
        )
    if num_stages != per_rank * num_ranks:
        raise ValueError(
            f"{name}: the pipeline has num_stages={num_stages} "
            f"but {num_ranks} ranks x {per_rank} stage(s) per rank = {per_rank * num_ranks} "
            f"are needed; set num_stages={per_rank * num_ranks} in every PipelineStage"
        )
    placement = (
        cls.stage_index_to_rank(num_ranks, per_rank)
        if flexible
        else cls.stage_index_to_rank(num_ranks)
    )
    expected = sorted(s for s, r in placement.items() if r == rank)
    got = sorted(st.stage_index for st in stages)
    if got != expected:
        raise ValueError(
            f"{name}: rank {rank} holds stages {got} "
            f"but {cls.layout!r} layout puts stages {expected} on rank {rank}; "
            f"build PipelineStage(..., stage_index=i, ...) for i in {expected} on this rank"
        )
    return list(stages)


def check_plan_for_runtime(plan: Plan, stages: Sequence[Any]) -> None:
    """The runtime's own requirements on a (valid) plan."""
    plan.validate()
    for st in stages:
        if plan.placement.get(st.stage_index) != st.group_rank:
            raise ValueError(
                f"plan {plan.name} places stage {st.stage_index} "
                f"on rank {plan.placement.get(st.stage_index)}, "
                f"but it was built on rank {st.group_rank}"
            )
    # torch keeps the last stage's losses in a list indexed by microbatch: forwards of the last
    # stage must run in microbatch order.
    last = plan.num_stages - 1
    fwd = [
        a.microbatch for a in plan.order[plan.placement[last]] if a.stage == last and a.kind == "F"
    ]
    if fwd != sorted(fwd):
        raise ValueError(
            f"plan {plan.name}: the last stage's forwards must run in microbatch order, got {fwd}"
        )


def check_step_args(
    sched: Any,
    args: tuple,
    kwargs: dict,
    target: Any,
    *,
    arg_mbs: list | None = None,
    kwarg_mbs: list | None = None,
    target_mbs: list | None = None,
) -> None:
    """The rank holding stage 0 needs the batch, the rank holding the last stage the target.

    Either form counts: a whole batch (``args`` / ``kwargs`` / ``target``) or its microbatches
    (``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs``, torch 2.14's form). Stage 0 may get its batch
    positionally or by keyword (``step(batch=td)``); a target is needed on the last stage only
    when the step runs a backward (not under torch's ``eval()``). Positional inputs on a rank
    without stage 0 are not an error: torch ignores them there, and so does zbpipe
    (:func:`zbpipe.schedules.inputs.drop_inputs_off_stage0`).
    """
    stages = sched._stages
    name = type(sched).__name__
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)
    if has_first and not args and not kwargs and arg_mbs is None and kwarg_mbs is None:
        raise ValueError(
            f"{name}.step(): rank {sched.rank} holds stage 0 and needs the batch: "
            "call step(x, ...) or step(arg_mbs=[...])"
        )
    if (
        has_last
        and sched._loss_fn is not None
        and sched._has_backward
        and target is None
        and target_mbs is None
    ):
        raise ValueError(
            f"{name}.step(): rank {sched.rank} holds the last stage "
            "and the schedule has a loss_fn, "
            "but no target was given: call step(..., target=y) or step(..., target_mbs=[...])"
        )
