"""What the overlapped pairs reach of torch: the mode stacks a pair's backward half must run
outside of, torch's functional collectives (a work in flight as a tensor) and checkpoint's
``GraphExecGroup``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import GraphExecGroup


@contextlib.contextmanager
def outside_python_modes() -> Iterator[None]:
    """Run the body with no Python torch-function mode and no dispatch mode on this thread
    (selective checkpointing's caching mode, an alias mode...), then put them back: the other
    half of a pair runs its own passes, which those modes must not see."""
    popped = []
    while torch._C._len_torch_function_stack() > 0:
        popped.append(torch._C._pop_torch_function_stack())
    try:
        with _disable_current_modes():
            yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def all_to_all_single(
    x: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
) -> torch.Tensor:
    """torch's functional all-to-all: returns at once, the result a tensor whose data arrives
    later (wait with :func:`wait_tensor`); selective checkpointing sees it as one op."""
    return funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group)


def wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """Wait for a functional collective's result."""
    out: torch.Tensor = funcol.wait_tensor(t)  # type: ignore[no-untyped-call]
    return out


def backward_group() -> Any:
    """One ``GraphExecGroup``: activation checkpointing recomputes a region at most once over
    every backward call made inside (any) entry of it, so a backward split into several calls
    recomputes no more than one call would."""
    return GraphExecGroup()
