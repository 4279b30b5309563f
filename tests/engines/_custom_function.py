"""A custom ``autograd.Function`` with a parameter, for the split-backward tests.

Neither engine can see inside it: its weight gradient must come out of B, as in a fused backward.
"""

import torch


class Scale(torch.autograd.Function):
    """y = x * s (s a vector), with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * s, (g * x).sum(0)
