"""torch's pipelining action IR: computation types, ``_Action``, and the map between the paper's
letters and torch's."""

from __future__ import annotations

from torch.distributed.pipelining.schedules import _Action, _ComputationType

from ..planning.core import TORCH_LETTERS

FORWARD = _ComputationType.FORWARD
BACKWARD_INPUT = _ComputationType.BACKWARD_INPUT
BACKWARD_WEIGHT = _ComputationType.BACKWARD_WEIGHT
FULL_BACKWARD = _ComputationType.FULL_BACKWARD
REDUCE_GRAD = _ComputationType.REDUCE_GRAD
SEND_F = _ComputationType.SEND_F
SEND_B = _ComputationType.SEND_B
RECV_F = _ComputationType.RECV_F
RECV_B = _ComputationType.RECV_B

#: zbpipe's paper letters -> torch's computation types (lossless both ways).
KIND_TO_TORCH = {kind: _ComputationType.from_str(t) for kind, t in TORCH_LETTERS.items()}
TORCH_TO_KIND = {v: k for k, v in KIND_TO_TORCH.items()}


def torch_action(stage: int, kind: _ComputationType, microbatch: int | None) -> _Action:
    """torch's action-IR entry (``_Action``): ``kind`` of ``microbatch`` on ``stage``."""
    return _Action(stage, kind, microbatch)
