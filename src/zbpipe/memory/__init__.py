"""Memory: what a stage holds for its backward, measured and owned.

``saved`` owns the tensors autograd saves in a forward (so the split backward can free them
early), ``meter`` measures the activation bytes a stage keeps (:class:`SavedActivationMeter`),
``probe`` records what one microbatch holds after its F and after its B (for planning in bytes).
"""

from .meter import SavedActivationMeter, StepMemory

__all__ = ["SavedActivationMeter", "StepMemory"]
