"""The loss the small multi-rank tests train with, for their schedules and their references alike.

Module level: rank processes import it by name, like the ``_*_cases`` modules.
"""

from __future__ import annotations

import torch


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, written out as each test file had it (``F.mse_loss`` would record
    another autograd node): the schedules and the references compute it the same way."""
    return (out - target).pow(2).mean()
