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

from .planning.core import TORCH_LETTERS

FORWARD = _ComputationType.FORWARD
BACKWARD_INPUT = _ComputationType.BACKWARD_INPUT
BACKWARD_WEIGHT = _ComputationType.BACKWARD_WEIGHT
FULL_BACKWARD = _ComputationType.FULL_BACKWARD

#: zbpipe's paper letters -> torch's computation types (lossless both ways).
KIND_TO_TORCH = {kind: _ComputationType.from_str(t) for kind, t in TORCH_LETTERS.items()}
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
