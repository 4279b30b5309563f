"""The flush-free continuous schedule: the class (``schedule``), which actions can run given the
mini-batches handed in so far (``stream``), weight versions for the stale modes (``versions``),
and the post-validated optimizer step (``optim``). Its plans are the plan layer's
(:mod:`zbpipe.planning.continuous_plan`).
"""

from .optim import PostValidatedStep, StepReport
from .schedule import LossRecord, ScheduleContinuous

__all__ = ["LossRecord", "PostValidatedStep", "ScheduleContinuous", "StepReport"]
