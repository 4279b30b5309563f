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

import warnings
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
    if not isinstance(value, list):
        raise TypeError(
            f"{owner}.step(): {name} must be a list with one entry per microbatch, "
            f"got {type(value).__name__}"
        )
    if len(value) != m:
        raise ValueError(
            f"{owner}.step(): {name} has {len(value)} entries but the schedule runs "
            f"n_microbatches={m}; "
            f"pass exactly {m} (or pass the whole batch positionally and let step() split it)"
        )
    return value


def drop_inputs_off_stage0(
    sched: Any, args: tuple, arg_mbs: list | None, warned: bool
) -> tuple[tuple, list | None, bool]:
    """``(args, arg_mbs, warned)`` with positional inputs dropped on a rank without stage 0.

    torch's ``step()`` splits whatever it is given and only stage 0 reads the positional
    inputs, so code written for torch often calls ``step(x, target=y)`` on every rank. zbpipe
    accepts that too: the inputs are dropped before they are split (a rank without stage 0 never
    reads them) and one warning per schedule says so (``warned`` is the schedule's flag, returned
    set). Keyword inputs are kept: torch hands them to every stage.
    """
    if any(st.is_first for st in sched._stages):
        return args, arg_mbs, warned
    given = bool(args) or (
        isinstance(arg_mbs, list) and any(isinstance(a, tuple) and a for a in arg_mbs)
    )
    if not given:
        return args, arg_mbs, warned
    if not warned:
        warnings.warn(
            f"{type(sched).__name__}.step(): rank {sched.rank} does not hold stage 0, so its "
            "positional inputs are ignored (as torch's schedules ignore them); pass them only on "
            "the rank holding stage 0 to skip this warning (shown once per schedule)",
            UserWarning,
            stacklevel=3,
        )
    return (), ([()] * len(arg_mbs) if isinstance(arg_mbs, list) else arg_mbs), True


def microbatch_inputs(
    sched: Any,
    args: tuple,
    kwargs: dict[str, Any],
    target: Any,
    arg_mbs: list | None,
    kwarg_mbs: list | None,
    target_mbs: list | None,
) -> MicrobatchInputs:
    """Either form of ``step()``'s inputs as per-microbatch lists, with torch 2.14's rules.

    Giving any of ``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs`` selects the split form: then no
    whole-batch input may be given (which one the model should see would be ambiguous), the
    missing lists mean "nothing" (``()`` / ``{}`` / no target), ``arg_mbs`` holds tuples and
    ``kwarg_mbs`` dicts. Otherwise the whole inputs are split by torch's own splitter (the
    schedule's ``args_chunk_spec`` / ``kwargs_chunk_spec``) and the target along dim 0.
    """
    owner, m = type(sched).__name__, sched._n_microbatches
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        arg_split, kwarg_split = sched._split_inputs(args, kwargs)
        targets = list(torch.tensor_split(target, m, 0)) if target is not None else None
        return MicrobatchInputs(
            arg_mbs=list(arg_split), kwarg_mbs=list(kwarg_split), target_mbs=targets
        )
    for given, what in (
        (bool(args), "positional inputs (use arg_mbs)"),
        (bool(kwargs), f"keyword inputs {sorted(kwargs)} (use kwarg_mbs)"),
        (target is not None, "target (use target_mbs)"),
    ):
        if given:
            raise ValueError(
                f"{owner}.step(): got microbatch lists and whole-batch {what}; "
                "pass the whole batch or its microbatches, not both"
            )
    arg_split = _as_list(arg_mbs, "arg_mbs", m, owner) if arg_mbs is not None else [()] * m
    kwarg_split = _as_list(kwarg_mbs, "kwarg_mbs", m, owner) if kwarg_mbs is not None else [{}] * m
    for i, (a, k) in enumerate(zip(arg_split, kwarg_split)):
        if not isinstance(a, tuple):
            raise TypeError(
                f"{owner}.step(): arg_mbs[{i}] is a {type(a).__name__}; each entry is the tuple of "
                "one microbatch's positional inputs, e.g. arg_mbs=[(x0,), (x1,)]"
            )
        if not isinstance(k, dict):
            raise TypeError(
                f"{owner}.step(): kwarg_mbs[{i}] is a {type(k).__name__}; each entry is the dict "
                "of "
                "one microbatch's keyword inputs"
            )
    targets = _as_list(target_mbs, "target_mbs", m, owner) if target_mbs is not None else None
    return MicrobatchInputs(
        arg_mbs=list(arg_split), kwarg_mbs=list(kwarg_split), target_mbs=targets
    )
