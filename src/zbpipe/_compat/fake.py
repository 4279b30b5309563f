"""A stage's output shapes for inputs of given shapes, computed without data: torch's
``FakeTensorMode`` (private: ``torch._subclasses``). Used to size receive buffers per microbatch
when microbatches differ in shape (:mod:`zbpipe.schedules.varlen`).

The module's real parameters are read as constants of the fake computation (no copy); the
inputs are fake tensors of the given shapes. An operator whose output shape depends on the
values of its input (``.item()``, ``nonzero``) raises inside the mode: that stage's output shape
is not a function of its input's shape, and the caller says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten


class TensorSpec(NamedTuple):
    """What a receive buffer needs: a shape and a dtype (the device is the stage's)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def output_specs(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    device: torch.device,
) -> tuple[TensorSpec, ...]:
    """The specs of ``module(*args, **kwargs)``'s tensor outputs (flattened, in order).

    ``args`` / ``kwargs`` hold real tensors (read for their shapes only), :class:`TensorSpec`s,
    or other values passed as they are. Exceptions of the module's forward propagate.
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():

        def fake(v: Any) -> Any:
            if isinstance(v, TensorSpec):
                return torch.empty(v.shape, dtype=v.dtype, device=device)
            if isinstance(v, torch.Tensor):
                return mode.from_tensor(v)
            return v

        out = module(*(fake(a) for a in args), **{k: fake(v) for k, v in kwargs.items()})
        leaves, _ = tree_flatten(out)
        return tuple(
            TensorSpec(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)
        )


def data_dependent_error(e: BaseException) -> bool:
    """Whether ``e`` says an output's shape (or a value read on the host) depends on data."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException))
