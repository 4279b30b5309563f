"""torch's whole ``step()`` contract: a whole batch, or microbatches already split.

torch 2.14's ``PipelineScheduleMulti.step`` takes either a whole batch (``step(x, target=y)``,
split into ``n_microbatches`` along dim 0) or the microbatches themselves (``step(arg_mbs=[...],
kwarg_mbs=[...], target_mbs=[...])``, which torchtitan 0.3's Trainer passes), plus
``loss_kwargs`` (keywords given to every microbatch's ``loss_fn(output, target, **loss_kwargs)``)
and ``return_outputs``. torch 2.13 has only the whole-batch form. zbpipe's schedules accept both
forms on every torch they support: :func:`microbatch_inputs` turns either into the lists torch's
``_step_microbatches`` takes, with checks that name the argument at fault, and zbpipe's ``step``
runs those lists itself (:func:`zbpipe._compat.run_microbatches`), so no torch version's
``step()`` decides which arguments exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class MicrobatchInputs:
    """One step's inputs, split: ``n_microbatches`` entries each."""

    arg_mbs: list[tuple]
    """Positional inputs per microbatch (empty tuples on ranks without stage 0)."""
    kwarg_mbs: list[dict[str, Any]]
    """Keyword inputs per microbatch (torch hands them to every stage on the rank)."""
    target_mbs: list[Any] | None
    """The loss targets per microbatch, on the rank holding the last stage; else None."""


def _as_list(value: Any, name: str, m: int, owner: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{owner}.step(): {name} must be a list with one entry per microbatch, got {type(value).__name__}"
        )
    if len(value) != m:
        raise ValueError(
            f"{owner}.step(): {name} has {len(value)} entries but the schedule runs n_microbatches={m}; "
            f"pass exactly {m} (or pass the whole batch positionally and let step() split it)"
        )
    return list(value)


def microbatch_inputs(
    sched: Any,
    args: tuple,
    kwargs: dict[str, Any],
    target: Any,
    arg_mbs: list | None,
    kwarg_mbs: list | None,
    target_mbs: list | None,
) -> MicrobatchInputs:
    """Either form of ``step()``'s inputs as per-microbatch lists.

    A role (positional inputs, keyword inputs, target) comes whole or split, never both: mixing
    would leave it ambiguous which one the model sees. Whole inputs are split by torch's own
    splitter (the schedule's ``args_chunk_spec`` / ``kwargs_chunk_spec``), a whole target along
    dim 0 like torch.
    """
    owner, m = type(sched).__name__, sched._n_microbatches
    for given_whole, split, what in (
        (bool(args), arg_mbs, "positional inputs and arg_mbs"),
        (bool(kwargs), kwarg_mbs, "keyword inputs and kwarg_mbs"),
        (target is not None, target_mbs, "target and target_mbs"),
    ):
        if given_whole and split is not None:
            raise ValueError(
                f"{owner}.step(): got both {what}; pass the whole batch or its microbatches, not both"
            )
    if arg_mbs is None and kwarg_mbs is None:
        arg_split, kwarg_split = sched._split_inputs(args, kwargs)
    else:
        arg_split = (
            [
                tuple(a) if isinstance(a, (tuple, list)) else (a,)
                for a in _as_list(arg_mbs, "arg_mbs", m, owner)
            ]
            if arg_mbs is not None
            else None
        )
        kwarg_split = (
            [dict(k or {}) for k in _as_list(kwarg_mbs, "kwarg_mbs", m, owner)]
            if kwarg_mbs is not None
            else None
        )
        if arg_split is None and args:
            arg_split = sched._split_inputs(args, {})[0]
        if kwarg_split is None and kwargs:
            kwarg_split = sched._split_inputs((), kwargs)[1]
    arg_split = arg_split if arg_split is not None else [()] * m
    kwarg_split = kwarg_split if kwarg_split is not None else [{} for _ in range(m)]
    if target_mbs is not None:
        targets = _as_list(target_mbs, "target_mbs", m, owner)
    elif target is not None:
        targets = list(torch.tensor_split(target, m, 0))
    else:
        targets = None
    return MicrobatchInputs(
        arg_mbs=list(arg_split), kwarg_mbs=list(kwarg_split), target_mbs=targets
    )
