"""What zbpipe's runtimes read and write of torch's schedule runtime and stages: posted
receives, the order with communication, the send handlers, the backward counter, receive
tables, shape inference."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining.schedules import _wait_batch_p2p
from torch.distributed.pipelining.stage import _PipelineStageBase

from ..patching import Patch, wrap
from .action_ir import SEND_B, SEND_F

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


def order_with_comms(sched: Any) -> dict[int, list[Any]]:
    """Every rank's action list after torch inserted the sends and receives
    (``pipeline_order_with_comms``, set by ``_prepare_schedule_with_comms``)."""
    orders: dict[int, list[Any]] = sched.pipeline_order_with_comms
    return orders


def handle_sends(sched: Any, handler: Callable[[Any, Any], None]) -> None:
    """Run ``handler(action, ctx)`` for the SEND_F and SEND_B actions of ``sched``'s runtime.

    torch's ``register_custom_function`` accepts compute and FSDP actions only, but its action
    loop looks every action type up in the same map (``_comp_type_to_function_map``, in torch
    2.11 to 2.14) before its built-in handling, which would keep each send's work, and so its
    tensor, until the step ends (see :mod:`zbpipe.schedules.sends`).
    """
    table: dict[Any, Any] = sched._comp_type_to_function_map
    for kind in (SEND_F, SEND_B):
        table[kind] = handler


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
