"""What each action of a planned schedule does, bound once per lowering (the action loop's table).

:data:`BINDERS` is the table :class:`~zbpipe.schedules.runtime.PlannedSchedule` runs its actions
with (:mod:`zbpipe.schedules.action_loop`): computation type -> a binder that, given the schedule
and one action, returns the call the loop makes for it each step. A binder settles what does not
change between steps (the stage object, whether a receive precedes the action, whether the stage
is FSDP-sharded, a local neighbour stage) and leaves the call only the work:

* **compute** (F, B, W, BW): wait for the receive torch posted, let go of the sends that
  completed meanwhile (:mod:`zbpipe.schedules.sends`), then the stage seam does the work
  (:mod:`zbpipe.schedules.stage_seam`), inside the tracer's span (timing starts after the
  receive);
* **communication**: zbpipe's sends (let go of once known complete), torch's receives;
* **FSDP**: torch's UNSHARD / RESHARD (no call for a stage without FSDP), REDUCE_GRAD without
  torch's division (the runtime divides once at the end of the step);
* **OVERLAP_F_B**: its sub-actions in order, each through this table (torch's default; a
  schedule that overlaps them for real replaces this entry).
"""

from __future__ import annotations

import functools
from typing import Any

from torch.distributed.fsdp import FSDPModule

from .. import _compat as C
from .action_loop import Binder, Call


def _uses_fsdp(stage: Any) -> bool:
    return isinstance(stage.submod, FSDPModule)


def _receives(sched: Any, stage: Any, forward: bool) -> bool:
    """Whether torch posted a receive before this stage's F (``forward``) or backward: none on
    the first (last) stage, none from a neighbour stage on this rank (V placement)."""
    local = sched.seam.stages
    if forward:
        return not stage.is_first and (stage.stage_index - 1) not in local
    return not stage.is_last and (stage.stage_index + 1) not in local


def wait_receive(sched: Any, stage_idx: int, mb: int, forward: bool) -> None:
    """Wait for the receive torch posted for this F (``forward``) or backward, then let go of
    the sends it proves complete (:mod:`zbpipe.schedules.sends`)."""
    ops = C.forward_receives(sched) if forward else C.backward_receives(sched)
    works = ops.pop((stage_idx, mb), None)
    if works is None:
        raise RuntimeError(
            f"zbpipe: rank {sched.rank} ran {'F' if forward else 'backward'} of stage "
            f"{stage_idx} mb {mb} before its receive"
        )
    C.wait_batch_p2p(works)
    if works:  # an empty receive (nothing requires grad there) proves nothing
        sched._sends.received((forward, stage_idx, mb))


# ---------------------------------------------------------------- compute
def bind_forward(sched: Any, action: Any) -> Call:
    stage = sched.seam.stages[action.stage_index]
    return functools.partial(
        _forward,
        sched,
        stage,
        action.microbatch_index,
        _receives(sched, stage, forward=True),
        _uses_fsdp(stage),
    )


def _forward(sched: Any, stage: Any, mb: int, receive: bool, fsdp: bool, ctx: Any) -> None:
    sched._sends.prune()
    s = stage.stage_index
    if fsdp:
        sched._assert_unsharded(stage)
    if receive:
        wait_receive(sched, s, mb, forward=True)
    return_outputs, loss_kwargs = sched._step_opts
    first, last, targets = stage.is_first, stage.is_last, ctx.target_mbs
    # what the caller holds for the step (slices of its batch and targets, for the seam)
    given = (
        ctx.arg_mbs[mb] if first else (),
        ctx.kwarg_mbs[mb] if first else {},
        targets[mb] if last and targets is not None else (),
    )
    with sched.tracer.span("F", s, mb), sched.seam.forward(stage, mb, given):
        output = stage.forward_one_chunk(
            mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=return_outputs
        )
        # eval(x) without a target: outputs only (torch would index the missing targets)
        if targets is not None or stage.has_backward:
            sched._maybe_compute_loss(stage, output, targets, mb, loss_kwargs)
    sched.seam.hand_forward(stage, output, mb)


def _backward_args(sched: Any, action: Any) -> tuple[Any, ...]:
    stage = sched.seam.stages[action.stage_index]
    return (
        sched,
        stage,
        action.microbatch_index,
        _receives(sched, stage, forward=False),
        _uses_fsdp(stage),
    )


def _before_backward(sched: Any, stage: Any, mb: int, receive: bool, fsdp: bool) -> None:
    sched._sends.prune()
    if fsdp:
        sched._assert_unsharded(stage)
    if receive:
        wait_receive(sched, stage.stage_index, mb, forward=False)


def prepare_backward(sched: Any, stage: Any, mb: int) -> None:
    """What a backward of ``stage`` does before its compute (an overlapped pair's B, run in
    segments, calls it): let go of completed sends, wait for FSDP's unshard and for the
    receive of its output gradients."""
    _before_backward(sched, stage, mb, _receives(sched, stage, False), _uses_fsdp(stage))


def skip_backward(sched: Any, stage_idx: int, mb: int) -> None:
    """A forward-only step's B or BW: nothing to compute, but torch's RECV_B was posted.

    torch lowers a receive before every B/BW that is not fed by a local stage, and posts it
    even in a forward-only step (an empty batch then: a stage without backward receives no
    gradient). Its own B pops that entry; skipping the pop left it behind, and the next
    step's receive failed with torch's "Recv twice ... without executing backward".
    """
    pending = C.backward_receives(sched).pop((stage_idx, mb), None)
    if pending is not None:
        C.wait_batch_p2p(pending)


def count_backward(sched: Any, stage_idx: int) -> bool:
    """Count a W or BW of the stage as torch does; True for the stage's last of the step."""
    counter = C.backward_counter(sched)
    counter[stage_idx] += 1
    return bool(counter[stage_idx] == sched._n_microbatches)


def bind_backward_input(sched: Any, action: Any) -> Call:
    return functools.partial(_backward_input, *_backward_args(sched, action))


def _backward_input(sched: Any, stage: Any, mb: int, receive: bool, fsdp: bool, ctx: Any) -> None:
    s = stage.stage_index
    if not stage.has_backward:  # eval(), or no loss_fn: forward only, like torch
        skip_backward(sched, s, mb)
        return
    _before_backward(sched, stage, mb, receive, fsdp)
    with sched.tracer.span("B", s, mb):
        sched.seam.backward_input(stage, mb, sched._maybe_get_loss(stage, mb))


def bind_full_backward(sched: Any, action: Any) -> Call:
    return functools.partial(_full_backward, *_backward_args(sched, action))


def _full_backward(sched: Any, stage: Any, mb: int, receive: bool, fsdp: bool, ctx: Any) -> None:
    s = stage.stage_index
    if not stage.has_backward:  # eval(), or no loss_fn: forward only
        skip_backward(sched, s, mb)
        return
    _before_backward(sched, stage, mb, receive, fsdp)
    last = count_backward(sched, s)
    with sched.tracer.span("BW", s, mb):
        sched.seam.full_backward(stage, mb, sched._maybe_get_loss(stage, mb), last)


def bind_backward_weight(sched: Any, action: Any) -> Call:
    stage = sched.seam.stages[action.stage_index]
    return functools.partial(
        _backward_weight, sched, stage, action.microbatch_index, _uses_fsdp(stage)
    )


def _backward_weight(sched: Any, stage: Any, mb: int, fsdp: bool, ctx: Any) -> None:
    if not stage.has_backward:
        return
    sched._sends.prune()
    if fsdp:
        sched._assert_unsharded(stage)
    s = stage.stage_index
    last = count_backward(sched, s)
    with sched.tracer.span("W", s, mb):
        sched.seam.backward_weight(stage, mb, last_backward=last)


# ---------------------------------------------------------------- communication and FSDP
def bind_send(sched: Any, action: Any) -> Call:
    stage = sched.seam.stages[action.stage_index]
    forward = action.computation_type == C.SEND_F
    return functools.partial(_send, sched._sends, stage, action.microbatch_index, forward)


def _send(sends: Any, stage: Any, mb: int, forward: bool, ctx: Any) -> None:
    sends.post(stage, mb, forward)


def bind_receive(sched: Any, action: Any) -> Call:
    stage = sched.seam.stages[action.stage_index]
    forward = action.computation_type == C.RECV_F
    return functools.partial(_receive, sched, stage, action.microbatch_index, forward)


def _receive(sched: Any, stage: Any, mb: int, forward: bool, ctx: Any) -> None:
    C.post_receive(sched, stage, mb, forward)


def bind_unshard(sched: Any, action: Any) -> Call | None:
    stage = sched.seam.stages[action.stage_index]
    if not _uses_fsdp(stage):  # torch's UNSHARD does nothing to other stages
        return None
    return functools.partial(_fsdp_call, C.unshard_stage, sched, stage)


def bind_reshard(sched: Any, action: Any) -> Call | None:
    stage = sched.seam.stages[action.stage_index]
    if not _uses_fsdp(stage):
        return None
    return functools.partial(_fsdp_call, C.reshard_stage, sched, stage)


def _fsdp_call(fn: Any, sched: Any, stage: Any, ctx: Any) -> None:
    fn(sched, stage)


def bind_reduce_grad(sched: Any, action: Any) -> Call:
    stage = sched.seam.stages[action.stage_index]
    return functools.partial(_reduce_grad, stage)


def _reduce_grad(stage: Any, ctx: Any) -> None:
    # FSDP's post-backward (gradient reduce-scatter), as torch runs it, without torch's
    # division by n_microbatches: the runtime divides once at the end of the step.
    stage.perform_reduce_grad(1)


def bind_overlap(sched: Any, action: Any) -> Call | None:
    """torch's default for an OVERLAP_F_B action: its sub-actions one after the other."""
    subs = [bind_action_of(sched, sub) for sub in C.sub_actions(action)]
    calls = tuple(c for c in subs if c is not None)
    if not calls:
        return None
    return functools.partial(_in_order, calls)


def _in_order(calls: tuple[Call, ...], ctx: Any) -> None:
    for call in calls:
        call(ctx)


def bind_action_of(sched: Any, action: Any) -> Call | None:
    """``action``'s call through ``sched``'s own table (the custom functions left aside)."""
    return sched.action_binders[action.computation_type](sched, action)  # type: ignore[no-any-return]


#: computation type -> binder: what :class:`~zbpipe.schedules.runtime.PlannedSchedule` runs
BINDERS: dict[Any, Binder] = {
    C.FORWARD: bind_forward,
    C.BACKWARD_INPUT: bind_backward_input,
    C.BACKWARD_WEIGHT: bind_backward_weight,
    C.FULL_BACKWARD: bind_full_backward,
    C.SEND_F: bind_send,
    C.SEND_B: bind_send,
    C.RECV_F: bind_receive,
    C.RECV_B: bind_receive,
    C.UNSHARD: bind_unshard,
    C.RESHARD: bind_reshard,
    C.REDUCE_GRAD: bind_reduce_grad,
    C.OVERLAP_F_B: bind_overlap,
}
