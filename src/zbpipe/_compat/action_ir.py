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
UNSHARD = _ComputationType.UNSHARD
RESHARD = _ComputationType.RESHARD
OVERLAP_F_B = _ComputationType.OVERLAP_F_B

#: zbpipe's paper letters -> torch's computation types (lossless both ways).
KIND_TO_TORCH = {kind: _ComputationType.from_str(t) for kind, t in TORCH_LETTERS.items()}
TORCH_TO_KIND = {v: k for k, v in KIND_TO_TORCH.items()}


def torch_action(stage: int, kind: _ComputationType, microbatch: int | None) -> _Action:
    """torch's action-IR entry (``_Action``): ``kind`` of ``microbatch`` on ``stage``."""
    return _Action(stage, kind, microbatch)


def torch_pair_action(first: _Action, second: _Action) -> _Action:
    """torch's overlapped pair (``OVERLAP_F_B``, torch 2.9+) of two compute actions; torch's
    lowering posts both sub-actions' receives before it and their sends after it."""
    return _Action(-1, OVERLAP_F_B, None, (first, second))


def sub_actions(action: _Action) -> tuple[_Action, ...]:
    """The compute actions of torch's ``OVERLAP_F_B`` action, in order."""
    subs = action.sub_actions
    if subs is None:
        raise ValueError(f"{action} is not an overlapped pair")
    return tuple(subs)
