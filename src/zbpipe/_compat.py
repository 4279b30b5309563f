"""Every private torch name zbpipe relies on, in one place.

torch.distributed.pipelining keeps its action IR and its action runtime private. A torch
upgrade that renames them should touch this file only; the rest of zbpipe imports from here.
Tested against torch 2.13.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import (  # noqa: F401  (re-exported)
    PipelineScheduleMulti,
    _Action,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)
from torch.distributed.pipelining.stage import PipelineStage, _PipelineStageBase  # noqa: F401

FORWARD = _ComputationType.FORWARD
BACKWARD_INPUT = _ComputationType.BACKWARD_INPUT
BACKWARD_WEIGHT = _ComputationType.BACKWARD_WEIGHT
FULL_BACKWARD = _ComputationType.FULL_BACKWARD

#: zbpipe's paper letters -> torch's computation types (lossless both ways).
KIND_TO_TORCH = {"F": FORWARD, "B": BACKWARD_INPUT, "W": BACKWARD_WEIGHT, "BW": FULL_BACKWARD}
TORCH_TO_KIND = {v: k for k, v in KIND_TO_TORCH.items()}


def stage_message_bytes(stage: _PipelineStageBase, which: str) -> int:
    """Bytes of one microbatch's activations a stage receives (``"inputs"``) or sends (``"outputs"``).

    Read from the tensor metadata torch infers on the first step (``_stage_meta``, private);
    0 before that. Used by :mod:`zbpipe.profile` to time messages of the real size.
    """
    metas = getattr(getattr(stage, "_stage_meta", None), which, None) or ()
    total = 0
    for meta in metas:
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is not None and dtype is not None:
            total += shape.numel() * dtype.itemsize
    return total


# ---------------------------------------------------------------- step() contract (issue 12)
# torch 2.14's PipelineScheduleMulti.step() also takes microbatches already split (arg_mbs,
# kwarg_mbs, target_mbs); torch 2.13's takes only a whole batch. zbpipe's schedules split (or
# take) the microbatches themselves (zbpipe.step_inputs) and run them here, the body both
# torch versions' step() share after splitting, so the accepted arguments never depend on the
# installed torch.
def run_microbatches(
    sched: PipelineScheduleMulti,
    arg_mbs: list,
    kwarg_mbs: list,
    target_mbs: list | None,
    losses: list | None,
    return_outputs: bool,
    loss_kwargs: dict | None,
) -> object:
    """What torch's ``PipelineScheduleMulti.step`` does once its inputs are microbatches."""
    import torch

    if sched._has_backward and sched._backward_requires_autograd and not torch.is_grad_enabled():
        raise RuntimeError(
            f"{type(sched).__name__}.step() runs a backward and needs autograd; do not call it under "
            "torch.no_grad() (call eval() for a forward-only step)"
        )
    for stage in sched._stages:
        stage.has_backward = sched._has_backward
        stage.clear_runtime_states()
    sched._step_microbatches(
        arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
    )
    for stage in sched._stages:
        if stage.is_last and return_outputs:
            return sched._merge_outputs(stage.output_chunks)
    return None


# ---------------------------------------------------------------- end of step() contract
