"""One stage's output shapes for microbatches of different input shapes: the rule by which both
variable-shape paths size their receive buffers (the planned schedules' per-step exchange,
:mod:`.varlen`, and the continuous stream's headers, :mod:`zbpipe.continuous.shapes`), and the
small pieces of their int64 shape messages that they share.

A stage's output specs for given input specs come from a cache (keyed by input shapes and
keywords), else its shape rule (:func:`zbpipe._compat.shape_rule`: one symbolic fake forward,
then an expression per size), else a concrete fake forward. A shape the stage cannot take, or
outputs that differ from the first microbatch's in number, rank or dtype, is a ``ValueError``
that says why; the caller decides how every rank learns of it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat as C
from .._compat.shims import stage_metas

Specs = tuple[C.TensorSpec, ...]


class StageShapes:
    """The output specs of one stage (a torch ``PipelineStage``) per input specs, cached."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        #: input key -> output specs
        self._outputs: dict[Hashable, Specs] = {}
        #: inputs' ranks and dtypes -> the stage's shape rule (None: none found)
        self._rules: dict[Hashable, C.ShapeRule | None] = {}

    def seed(self, ins: Specs, kwargs: Mapping[str, Any], outs: Specs) -> None:
        """Record outputs known without a fake forward (what torch inferred on microbatch 0)."""
        key = input_key(ins, kwargs)
        if key is not None:
            self._outputs[key] = outs

    def outputs(self, args: Sequence[Any], ins: Specs, kwargs: Mapping[str, Any]) -> Specs:
        """The stage's output specs for inputs ``ins`` (the first stage's fake forward reads
        its real ``args``, other stages' their specs), or a ``ValueError`` saying why none."""
        st = self.stage
        key = input_key(ins, kwargs)
        cached = self._outputs.get(key) if key is not None else None
        if cached is not None:
            return cached
        fake_args = tuple(args) if st.is_first else ins
        try:
            outs = self._by_rule(fake_args, ins, kwargs) or C.output_specs(
                st.submod, fake_args, dict(kwargs), st.device
            )
        except Exception as e:
            why = (
                "its output shape depends on the values of its input, not only on its shape"
                if C.data_dependent_error(e)
                else "its forward failed on fake tensors of these shapes"
            )
            raise ValueError(
                f"stage {st.stage_index} cannot take microbatches of this shape "
                f"(inputs {[tuple(x.shape) for x in ins]}): {why} ({type(e).__name__}: {e}). "
                "zbpipe sizes each receive buffer before its data arrives, from the stage's "
                "output shape for its input shapes; make the stage's output shape a function "
                "of its input shapes (no .item(), nonzero() or data-dependent slicing on the "
                "path to its outputs), or give every microbatch the same shape"
            ) from None
        _check_like_first(st, ins, outs)
        if key is not None:
            self._outputs[key] = outs
        return outs

    def _by_rule(
        self, fake_args: tuple[Any, ...], ins: Specs, kwargs: Mapping[str, Any]
    ) -> Specs | None:
        """The outputs from the stage's :class:`~zbpipe._compat.ShapeRule`, or None where it
        does not apply (keyword inputs, non-tensor positional inputs, a guard that fails, a
        symbolic forward that failed): then a concrete fake forward decides, and says why a
        shape cannot be taken."""
        if kwargs or not ins or len(fake_args) != len(ins):
            return None
        key = tuple((len(x.shape), x.dtype) for x in ins)
        if key not in self._rules:
            self._rules[key] = C.shape_rule(self.stage.submod, tuple(ins), self.stage.device)
        rule = self._rules[key]
        return rule.apply(tuple(x.shape for x in ins)) if rule is not None else None


def _check_like_first(st: Any, ins: Specs, outs: Specs) -> None:
    """Microbatches may differ in sizes only: the number, ranks and dtypes of the outputs are
    those torch inferred from the first microbatch (and sized the message layouts by)."""
    expected = stage_metas(st, "outputs")
    if len(outs) != len(expected) or any(
        len(o.shape) != len(e.shape) or o.dtype != e.dtype
        for o, e in zip(outs, expected, strict=False)
    ):
        raise ValueError(
            f"stage {st.stage_index} gives outputs {[(o.shape, o.dtype) for o in outs]} for "
            f"inputs {[tuple(x.shape) for x in ins]}, but "
            f"{[(tuple(e.shape), e.dtype) for e in expected]} for the first microbatch: "
            "microbatches may differ in their sizes, not in the number, rank or dtype of "
            "a stage's outputs"
        )


def specs_of(args: Sequence[Any]) -> Specs:
    """The specs of the tensors among ``args`` (other values are not received)."""
    return tuple(C.TensorSpec(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))


def input_key(ins: Specs, kwargs: Mapping[str, Any]) -> Hashable | None:
    """What a stage's output shapes may depend on: input shapes, keyword shapes and values.
    None when a keyword value cannot be a key (then the fake forward runs each time)."""
    kw = tuple(
        (k, C.TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
        for k, v in sorted(kwargs.items())
    )
    key = (ins, kw)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def peer(st: Any, stage_index: int) -> int:
    """The global rank that holds ``stage_index`` in ``st``'s pipeline group."""
    group_rank: int = st.stage_index_to_group_rank[stage_index]
    return dist.get_global_rank(st.group, group_rank) if st.group is not None else group_rank


def unpack_specs(dims: Sequence[int], metas: Sequence[Any], m: int) -> list[Specs]:
    """``m`` microbatches' input specs from a message's run of dimensions (each microbatch's
    inputs in order, each input's rank and dtype those of ``metas``, torch's inferred inputs)."""
    at, out = 0, []
    for _ in range(m):
        mb = []
        for meta in metas:
            n = len(meta.shape)
            mb.append(C.TensorSpec(tuple(dims[at : at + n]), meta.dtype))
            at += n
        out.append(tuple(mb))
    return out
