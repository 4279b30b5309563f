"""Every private torch name zbpipe relies on, in one place.

torch.distributed.pipelining keeps its action IR and its action runtime private. A torch
upgrade that renames them should touch this file only; the rest of zbpipe imports from here.
Tested against torch 2.13.
"""

from __future__ import annotations

import torch  # noqa: F401  (annotations)

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


# --- what the stage seam reads from a torch PipelineStage ---------------------------------------


def received_grads(stage: _PipelineStageBase, mb: int) -> tuple:
    """The output gradients a stage received for microbatch ``mb`` (torch's receive buffers)."""
    return stage._retrieve_recv_grads(mb)


def received_activations(stage: _PipelineStageBase, mb: int) -> tuple:
    """The activations a stage received for microbatch ``mb`` (torch's receive buffers)."""
    return stage._retrieve_recv_activations(mb)


def num_stage_inputs(stage: _PipelineStageBase) -> int:
    """How many positional inputs the stage's forward takes (from torch's shape inference)."""
    return len(stage._stage_meta.inputs)


def has_post_accumulate_grad_hooks(t: "torch.Tensor") -> bool:
    """Whether ``register_post_accumulate_grad_hook`` put a hook on the leaf ``t``."""
    return getattr(t, "_post_accumulate_grad_hooks", None) is not None
