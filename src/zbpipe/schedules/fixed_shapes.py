"""Without ``variable_shapes=True``: a clear error for a microbatch of another shape.

torch's ``PipelineStage`` sizes its receive buffers once, from microbatch 0 of the first step. A
microbatch whose shapes differ makes the rank that receives it abort inside gloo ("Received data
size doesn't match expected size") and its peer fail with "Connection reset by peer". Sending the
shapes ahead costs a message per rank boundary per step (:mod:`.varlen`), so it is opt-in, and by
default the rank holding stage 0 compares each microbatch's input shapes (shapes and dtypes only,
no data read, no message) with those the stages were set up with, before any message of the step,
and raises a ``ValueError`` that says which microbatch differs and what to do. The other ranks
cannot know without a message: they wait for this rank's first send until the launcher ends the
job (torchrun, and zbpipe's ``run_ranks``, end the other processes when one fails).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .inputs import _leaves

#: one microbatch's stage-0 inputs: (where, shape, dtype) for each tensor, in a fixed order
Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Signature:
    """The shapes and dtypes of a microbatch's tensor inputs, positional then by keyword
    (dicts and TensorDicts by their leaves)."""
    out = [
        (f"argument {i}", tuple(a.shape), a.dtype)
        for i, a in enumerate(args)
        if isinstance(a, torch.Tensor)
    ]
    for name in sorted(kwargs):
        for where, leaf in _leaves(kwargs[name], name):
            if isinstance(leaf, torch.Tensor):
                out.append((f"keyword {where}", tuple(leaf.shape), leaf.dtype))
    return tuple(out)


class FixedShapes:
    """The rank of stage 0's check that a step's microbatches have the first step's shapes."""

    def __init__(self, remedy: str = "") -> None:
        #: microbatch 0 of the first step, once the stages were set up from it
        self.expected: Signature | None = None
        #: what the error tells the user to do (the planned schedules': variable_shapes=True)
        self.remedy = remedy or (
            "Build the schedule with variable_shapes=True to send each step's shapes down the "
            "pipeline (docs/use/varlen.md), or pad or pack every microbatch to one shape"
        )

    def check(self, owner: str, arg_mbs: Sequence[Any], kwarg_mbs: Sequence[Any]) -> None:
        """Raise a ``ValueError`` if a microbatch's input shapes differ from what the stages
        were (or, in the first step, are about to be) set up with. Call before any message."""
        if not arg_mbs:
            return
        expected = self.expected
        if expected is None:  # the first step: the stages are set up from its microbatch 0
            expected = signature(arg_mbs[0], kwarg_mbs[0])
        for i, (args, kwargs) in enumerate(zip(arg_mbs, kwarg_mbs, strict=True)):
            seen = signature(args, kwargs)
            if seen != expected:
                raise ValueError(_mismatch(owner, i, seen, expected, self.remedy))

    def set_up(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Remember the inputs the stages were set up from (the first step, after the set-up)."""
        if self.expected is None:
            self.expected = signature(args, kwargs)


def _mismatch(owner: str, mb: int, seen: Signature, expected: Signature, remedy: str) -> str:
    """What differs, in the first input where it does, and what to do."""
    names, want_names = [w for w, _, _ in seen], [w for w, _, _ in expected]
    if names != want_names:
        what, was = f"inputs are {names}", f"{want_names}"
    else:
        (where, shape, dtype), (_, want, want_dtype) = next(
            (s, e) for s, e in zip(seen, expected, strict=True) if s != e
        )
        same_dtype = dtype == want_dtype
        what = f"{where} has shape {shape}" + ("" if same_dtype else f" and dtype {dtype}")
        was = f"{want}" + ("" if same_dtype else f" and {want_dtype}")
    return (
        f"{owner}.step(): microbatch {mb}'s {what}, but the stages were set up for {was} "
        "(microbatch 0 of the first step): receive buffers have that size, and a microbatch of "
        f"another shape would abort the receiving rank. {remedy}. No microbatch of this step "
        "was sent; the other ranks wait until the launcher ends them"
    )
