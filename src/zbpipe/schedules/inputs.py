"""A step's inputs: torch's whole ``step()`` contract, and batches that are dicts or TensorDicts.

**The contract.** torch 2.14's ``PipelineScheduleMulti.step`` takes either a whole batch
(``step(x, target=y)``, split into ``n_microbatches`` along dim 0) or the microbatches themselves
(``step(arg_mbs=[...], kwarg_mbs=[...], target_mbs=[...])``, which torchtitan 0.3's Trainer
passes), plus ``loss_kwargs`` (keywords given to every microbatch's ``loss_fn(output, target,
**loss_kwargs)``) and ``return_outputs``. torch 2.13 has only the whole-batch form. zbpipe's
schedules accept both forms on every torch they support: :func:`microbatch_inputs` turns either
into the lists torch's ``_step_microbatches`` takes, with checks that name the argument at fault,
and zbpipe's ``step`` runs those lists itself (:func:`zbpipe._compat.run_microbatches`), so no
torch version's ``step()`` decides which arguments exist.

**Structured batches.** What a user gets: **each microbatch has the structure of the batch passed
to ``step()``**. With ``sched.step(td, target=y)`` and a first stage written as ``def forward(self,
batch): ...``, the first stage is called once per microbatch with a ``TensorDict`` holding rows
``[i*b/m, (i+1)*b/m)`` of every entry (split along dim 0, its batch dimension; a plain dict of
tensors likewise gives a dict). Nested dicts/TensorDicts split the same way; keys and
``batch_size`` follow the split.

Why zbpipe has to help: torch 2.13's ``split_args_kwargs_into_chunks`` already splits a dict
(pytree) and a TensorDict (tensordict registers itself with pytree and fixes ``batch_size``), but
a ``PipelineStage`` rejects any positional input that is not a tensor ("All stage args must be
tensors. Use kwargs for non-tensor inputs"). So zbpipe passes such a batch to stage 0 *by keyword*,
named after the matching parameter of stage 0's ``forward`` (``batch=td``), which Python binds
exactly like the positional call. Torch hands keyword inputs to every stage on the rank, so on a
rank holding stage 0 and another stage (V placement: stages 0 and 2p-1) the other stage is kept
from seeing them.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _compat as C
from ..patching import Patch, patch, undo_all


def is_structured_batch(x: Any) -> bool:
    """A dict of tensors or a TensorDict (what a stage cannot take positionally in torch 2.13)."""
    if isinstance(x, Mapping):
        return True
    td = sys.modules.get("tensordict")  # never import tensordict for users who do not use it
    return td is not None and isinstance(x, td.TensorDictBase)


def _leaves(x: Any, prefix: str = "batch") -> list[tuple[str, Any]]:
    if isinstance(x, Mapping) or is_structured_batch(x):
        out = []
        for k in x.keys():
            out += _leaves(x[k], f"{prefix}[{k!r}]")
        return out
    return [(prefix, x)]


def check_batch(batch: Any, n_microbatches: int, name: str = "batch") -> None:
    """Every tensor of a dict/TensorDict batch can be split along dim 0 into ``n_microbatches``.

    torch would otherwise quietly make fewer microbatches (it takes the smallest dim 0) or fail
    inside its splitter with an assertion.
    """
    sizes = {
        path: t.shape[0]
        for path, t in _leaves(batch, name)
        if isinstance(t, torch.Tensor) and t.dim() > 0
    }
    scalars = [
        path for path, t in _leaves(batch, name) if isinstance(t, torch.Tensor) and t.dim() == 0
    ]
    if scalars:
        raise ValueError(
            f"{scalars[0]} is a 0-dim tensor and cannot be split into microbatches; "
            "give it a batch dimension "
            "or pass it as a non-tensor (Python number) so it is repeated for every microbatch"
        )
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"the tensors of {name} disagree on their batch size (dim 0): {sizes}; "
            "every entry must have "
            "the same dim 0, which is split into microbatches"
        )
    small = {p: s for p, s in sizes.items() if s < n_microbatches}
    if small:
        raise ValueError(
            f"{name} has batch size {next(iter(small.values()))} "
            f"< n_microbatches={n_microbatches}: "
            "pass a larger batch or fewer microbatches"
        )


class FirstStageKeywords:
    """Passes dict/TensorDict inputs of ``step()`` to stage 0 by keyword, and to no other stage.

    Built once per schedule from the rank's stages (a no-op on ranks without stage 0).
    """

    def __init__(self, stages: Sequence[Any]) -> None:
        self._first = next((s for s in stages if s.is_first), None)
        self._keys: frozenset[str] = frozenset()
        self._patches: list[Patch] = []
        if self._first is not None:
            for stage in stages:
                if stage is not self._first:
                    self._guard(stage)

    def bind(
        self, args: tuple, kwargs: dict[str, Any], n_microbatches: int
    ) -> tuple[tuple, dict[str, Any]]:
        """``step()``'s ``(args, kwargs)`` as torch's stage accepts them.

        Tensor-only positional inputs pass unchanged (torch's own path). If any positional input
        is a dict/TensorDict, every positional input becomes a keyword argument named after stage
        0's ``forward`` parameters.
        """
        if self._first is None or not any(is_structured_batch(a) for a in args):
            self._keys = frozenset()
            return args, kwargs
        module = self._first.submod
        sig = inspect.signature(module.forward)
        params = list(sig.parameters.values())
        for p, _ in zip(params, args):
            if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL):
                raise ValueError(
                    "step(): a dict/TensorDict batch is passed to stage 0 by keyword (torch stages "
                    f"take only tensors positionally), but {type(module).__name__}.forward's "
                    f"parameter {p.name!r} is "
                    f"{'positional-only' if p.kind == p.POSITIONAL_ONLY else '*args'}; "
                    "make it a normal "
                    "parameter, or call step(name=batch) with a keyword forward accepts"
                )
        try:
            bound = sig.bind_partial(*args, **kwargs)
        except TypeError as e:
            raise ValueError(
                "step(): cannot pass the positional inputs to "
                f"{type(module).__name__}.forward{sig} by name: {e}"
            ) from None
        names = [p.name for p, _ in zip(params, args)]
        for name, value in zip(names, args):
            if is_structured_batch(value):
                check_batch(value, n_microbatches, name)
        self._keys = frozenset(names)
        return (), {**kwargs, **{n: bound.arguments[n] for n in names}}

    def _drop(self, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if not kwargs or not self._keys:
            return kwargs
        return {k: v for k, v in kwargs.items() if k not in self._keys}

    def _guard(self, stage: Any) -> None:
        """Wrap this stage object's two entry points that receive ``step()``'s keywords."""
        forward = stage.forward_one_chunk

        def forward_one_chunk(
            mb: int, args: Any, kwargs: dict | None = None, *rest: Any, **kw: Any
        ) -> Any:
            return forward(mb, args, self._drop(kwargs), *rest, **kw)

        def shape_inference(prepare: Callable[..., Any]) -> Callable[..., Any]:
            def prepare_forward_infra(
                n: int, args: Any, kwargs: dict | None = None, *rest: Any, **kw: Any
            ) -> Any:
                return prepare(n, args, self._drop(kwargs), *rest, **kw)

            return prepare_forward_infra

        self._patches += [
            patch(stage, "forward_one_chunk", forward_one_chunk),
            C.wrap_shape_inference(stage, shape_inference),
        ]

    def undo(self) -> None:
        """Give the stages their own entry points back."""
        undo_all(self._patches)
        self._patches = []


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
