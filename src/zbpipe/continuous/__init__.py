"""The flush-free continuous schedule: the class (``schedule``), what each action of its stream
does (``actions``), weight versions for the stale modes (``versions``) and the post-validated
optimizer step (``optim``). Its plans, and which actions can run given the mini-batches handed in
so far, are the plan layer's (:mod:`zbpipe.planning.continuous`).
"""

from .optim import PostValidatedStep, StepReport
from .schedule import LossRecord, ScheduleContinuous

__all__ = ["LossRecord", "PostValidatedStep", "ScheduleContinuous", "StepReport"]
