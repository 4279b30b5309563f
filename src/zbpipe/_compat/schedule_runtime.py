"""What zbpipe's runtimes read and write of torch's schedule runtime and stages: posted
receives, the order with communication, the custom-function table, the receive, unshard and
reshard actions zbpipe's action loop runs as torch's does, the backward counter, receive tables,
shape inference."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import (
    _add_reduce_grad,
    _add_send_recv,
    _add_unshard_reshard,
    _batch_p2p,
    _format_pipeline_order,
    _PipelineContext,
    _wait_batch_p2p,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from ..patching import Patch, wrap

# --- what the runtimes read of torch's schedule runtime and stages --------------------------------


def forward_receives(sched: Any) -> dict[tuple[int, int], list[Any]]:
    """``(stage, microbatch)`` -> the posted receive of that forward's inputs (torch's
    ``_PipelineScheduleRuntime.fwd_recv_ops``; torch's RECV_F action fills it)."""
    receives: dict[tuple[int, int], list[Any]] = sched.fwd_recv_ops
    return receives


def backward_receives(sched: Any) -> dict[tuple[int, int], list[Any]]:
    """``(stage, microbatch)`` -> the posted receive of that backward's output gradients
    (torch's ``bwd_recv_ops``; torch's RECV_B action fills it)."""
    receives: dict[tuple[int, int], list[Any]] = sched.bwd_recv_ops
    return receives


def wait_batch_p2p(work: list[Any]) -> None:
    """Wait for a posted receive (one of :func:`forward_receives` or :func:`backward_receives`'s
    values; torch's ``_wait_batch_p2p``)."""
    _wait_batch_p2p(work)


def lower_part(sched: Any, actions: dict[int, list[Any]]) -> None:
    """torch's lowering of a compute-only order (``_prepare_schedule_with_comms``) for a *part* of
    a step, into :func:`order_with_comms`: the same insertions (FSDP unshard and reshard, the
    gradient reduce after a stage's last backward, sends and receives, receives deferred where
    the schedule asks), without torch's check that every stage runs every microbatch and each
    backward follows its forward in the same list (a part need not). Its sends and receives
    must pair up inside it."""
    to_rank = sched.stage_index_to_group_rank.__getitem__
    lowered: dict[int, Any] = {
        r: _add_reduce_grad(list(_add_unshard_reshard(acts)), sched._n_microbatches)
        for r, acts in actions.items()
    }
    orders = _add_send_recv(lowered, stage_to_rank=to_rank, num_stages=sched._num_stages)
    defer = getattr(_torch_schedules, "_defer_recv_ops", None)  # torch >= 2.13
    if defer is not None and getattr(sched, "_defer_pp_recv", False):
        orders = defer(orders, stage_to_rank=to_rank)
    sched.pipeline_order_with_comms = orders


def order_with_comms(sched: Any) -> dict[int, list[Any]]:
    """Every rank's action list after torch inserted the sends and receives
    (``pipeline_order_with_comms``, set by ``_prepare_schedule_with_comms``)."""
    orders: dict[int, list[Any]] = sched.pipeline_order_with_comms
    return orders


def custom_functions(sched: Any) -> dict[Any, Any]:
    """computation type -> the function ``register_custom_function`` registered for it (torch's
    ``_comp_type_to_function_map``): zbpipe's action loop runs an entry it did not register
    itself in place of its own handler, as torch's loop does."""
    table: dict[Any, Any] = sched._comp_type_to_function_map
    return table


def pipeline_context(sched: Any, arg_mbs: Any, kwarg_mbs: Any, target_mbs: Any, losses: Any) -> Any:
    """The context torch's loop hands a custom function (``_PipelineContext``): one per step."""
    return _PipelineContext(sched, arg_mbs, kwarg_mbs, target_mbs, losses)


def post_receive(sched: Any, stage: _PipelineStageBase, mb: int, forward: bool) -> None:
    """torch's RECV_F / RECV_B action: post the receive of ``mb``'s inputs (``forward``) or
    output gradients, kept in the runtime's table until the compute action waits for it."""
    table = sched.fwd_recv_ops if forward else sched.bwd_recv_ops
    key = (stage.stage_index, mb)
    if key in table:
        what = "forward" if forward else "backward"
        raise AssertionError(
            f"Recv twice for stage_idx={key[0]} mb_index={mb} without executing {what}"
        )
    ops = stage.get_fwd_recv_ops(mb) if forward else stage.get_bwd_recv_ops(mb)
    table[key] = _batch_p2p(ops)


def unshard_stage(sched: Any, stage: _PipelineStageBase) -> None:
    """torch's UNSHARD action on an FSDP2 stage: start the all-gather of every FSDP module of
    it; the stage's next compute action waits for them (``_assert_unsharded``)."""
    idx = stage.stage_index
    if idx in sched.unsharded_stages or idx in sched.unshard_ops:
        raise AssertionError(f"Unsharding the same stage_idx={idx} twice")
    for sub in stage.submod.modules():
        if isinstance(sub, FSDPModule):
            sched.unshard_ops[idx].append(sub.unshard(async_op=True))


def reshard_stage(sched: Any, stage: _PipelineStageBase) -> None:
    """torch's RESHARD action on an FSDP2 stage."""
    idx = stage.stage_index
    if idx not in sched.unsharded_stages:
        raise AssertionError(f"Resharding stage_idx={idx} without unsharding")
    if idx in sched.unshard_ops:
        raise AssertionError(f"Resharding stage_idx={idx} before finishing unshard")
    for sub in stage.submod.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    sched.unsharded_stages.discard(idx)  # present: checked above


def check_unshards_used(sched: Any) -> None:
    """The end of torch's step: every UNSHARD was waited for by a compute action."""
    if sched.unshard_ops:
        raise AssertionError("Unused unshard operations")


def format_order(orders: dict[int, list[Any]], error_step: int) -> str:
    """Every rank's action list as torch prints it when an action fails, the failing step
    marked (``_format_pipeline_order``)."""
    text: str = _format_pipeline_order(orders, error_step_number=error_step)
    return text


def backward_counter(sched: Any) -> Counter[int]:
    """stage -> backward passes with weight gradients (W or fused BW) run so far this step
    (torch's ``backward_counter``). torch's own actions count in it to tell a stage's last
    backward, and torch clears it at the end of the step; zbpipe's actions, which replace
    torch's, count in it the same way."""
    counter: Counter[int] = sched.backward_counter
    return counter


def activation_receives(stage: _PipelineStageBase) -> dict[int, tuple[Any, ...]]:
    """microbatch -> the receive buffers for that forward's inputs (torch's ``args_recv_info``)."""
    return stage.args_recv_info


def grad_receives(stage: _PipelineStageBase) -> dict[int, tuple[Any, ...]]:
    """microbatch -> the receive buffers for that backward's output gradients (torch's
    ``grad_recv_info``)."""
    return stage.grad_recv_info


def key_by_global_microbatch(
    stage: _PipelineStageBase,
) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
    """Make a stage's receive buffers and caches take any microbatch index (the continuous
    schedule's global ones), after torch's shape inference keyed them ``0..n_microbatches-1``.

    Returns the receive-buffer templates of microbatch 0 (activations; output gradients, None on
    the last stage), empties torch's per-microbatch receive tables so each receive can get a
    fresh buffer, creates the gradient-send description torch builds lazily, and lifts torch's
    bound on the microbatch index.
    """
    act_template = stage.args_recv_info[0]
    grad_template = stage.grad_recv_info.get(0)
    if stage.grad_send_info is None:
        stage.grad_send_info = stage._create_grad_send_info(stage.args_recv_info[0])
    stage.args_recv_info.clear()
    stage.grad_recv_info.clear()
    stage.chunks = sys.maxsize  # keys are global microbatch indices, unbounded
    return act_template, grad_template


def wrap_shape_inference(stage: _PipelineStageBase, make: Callable[[Any], Any]) -> Patch:
    """Replace this stage object's shape-inference entry (``_prepare_forward_infra(n, args,
    kwargs, ...)``, which receives ``step()``'s keywords on the first step) by ``make(current)``;
    ``.undo()`` the result to restore it."""
    return wrap(stage, "_prepare_forward_infra", make)
