"""Communication points: where a model's forward runs a collective whose backward is a collective
too, declared without editing the model, so an overlapped pair can interleave its halves there.

A point is a method of some object of the model (:class:`CommPoint`): the schedule replaces the
method on that object (:mod:`zbpipe.patching`, undone by :func:`restore`) with one that asks the
point for the tensor it exchanges and its :class:`~zbpipe.engines.segmented.Collective`, and
hands both to the pair runtime. Outside a pair the replacement computes what the method did: the
collective, differentiable. Inside a compiled region (``torch.compiler.is_compiling()``) it calls
the original method, so a compiled block keeps its collectives inside and the overlap happens
between blocks, not inside one.

:func:`find_points` finds torchtitan's: the ``token_dispatcher`` of its MoE layers
(``AllToAllTokenDispatcher`` and subclasses, torchtitan 0.3) exchanges tokens in two methods,
``_dispatch_token_exchange`` and ``_combine_token_exchange``, each one all-to-all with the
token splits it is given. zbpipe never imports torchtitan: it recognises the class by its
module and its methods. For another model, declare the points (docs/use/dualpipev.md)::

    CommPoint(owner=layer.moe, method="exchange",
              collective=lambda x: (x, AllToAllSingle(group=ep_group)))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat as C
from ..engines.segmented import Collective
from ..patching import Patch, patch

logger = logging.getLogger(__name__)

#: the module that defines torchtitan's token dispatchers, and their exchange methods
TORCHTITAN_DISPATCHERS = "torchtitan.models.common.token_dispatcher"
TORCHTITAN_METHODS = ("_dispatch_token_exchange", "_combine_token_exchange")


@dataclass(frozen=True, kw_only=True)
class CommPoint:
    """A method of a model object that runs one collective with a collective backward."""

    owner: object
    """The object whose method it is (a module, a dispatcher...)."""
    method: str
    """The method's name; the schedule replaces it on ``owner`` while it runs the model."""
    collective: Callable[..., tuple[Tensor, Collective]]
    """Given the method's arguments, the tensor it sends and how (its :class:`Collective`);
    the method's result must be that collective's result."""


@dataclass(frozen=True)
class AllToAllSingle:
    """``all_to_all_single`` over ``group`` as a :class:`Collective` (torch's functional one:
    launched at once, its result waited for later; on a GPU, NCCL runs it on its own stream)."""

    group: Any
    output_split_sizes: list[int] | None = None
    input_split_sizes: list[int] | None = None

    def start(self, x: Tensor) -> _InFlight:
        with torch.no_grad():
            t = C.all_to_all_single(
                x.contiguous(), self.output_split_sizes, self.input_split_sizes, self.group
            )
        return _InFlight(t)

    def start_backward(self, grad: Tensor) -> _InFlight:
        """The gradient goes back the way the tokens came: the splits swapped."""
        with torch.no_grad():
            t = C.all_to_all_single(
                grad.contiguous(), self.input_split_sizes, self.output_split_sizes, self.group
            )
        return _InFlight(t)


class _InFlight:
    __slots__ = ("_t",)

    def __init__(self, t: Tensor) -> None:
        self._t = t

    def wait(self) -> Tensor:
        return C.wait_tensor(self._t)


def find_points(modules: Iterable[nn.Module]) -> list[CommPoint]:
    """The communication points zbpipe recognises in ``modules``: torchtitan's MoE dispatchers
    (module docstring). Dispatchers inside a compiled module are left alone: dynamo traces
    their collectives into the compiled block."""
    points: list[CommPoint] = []
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is None or id(dispatcher) in seen or not _is_titan(dispatcher):
                continue
            seen.add(id(dispatcher))
            points.append(
                CommPoint(owner=dispatcher, method=TORCHTITAN_METHODS[0], collective=_dispatch)
            )
            points.append(
                CommPoint(owner=dispatcher, method=TORCHTITAN_METHODS[1], collective=_combine)
            )
    return points


def _is_titan(dispatcher: object) -> bool:
    return any(c.__module__ == TORCHTITAN_DISPATCHERS for c in type(dispatcher).__mro__) and all(
        callable(getattr(dispatcher, m, None)) for m in TORCHTITAN_METHODS
    )


def _dispatch(
    tokens: Tensor, group: Any, output_splits: list[int], input_splits: list[int]
) -> tuple[Tensor, Collective]:
    """torchtitan's ``_dispatch_token_exchange(routed_input, pg, output_splits, input_splits)``."""
    return tokens, AllToAllSingle(group, output_splits, input_splits)


def _combine(
    tokens: Tensor, group: Any, input_splits: list[int], output_splits: list[int]
) -> tuple[Tensor, Collective]:
    """torchtitan's ``_combine_token_exchange(routed_output, pg, input_splits, output_splits)``:
    the dispatch's all-to-all backwards (its output splits are the dispatch's input splits)."""
    return tokens, AllToAllSingle(group, input_splits, output_splits)


def install(
    points: Sequence[CommPoint], exchange: Callable[[Tensor, Collective], Tensor]
) -> list[Patch]:
    """Replace each point's method by one that runs its collective through ``exchange``."""
    patches = []
    for point in points:
        original = getattr(point.owner, point.method)
        patches.append(patch(point.owner, point.method, _replacement(point, original, exchange)))
    logger.debug("zbpipe: %d communication points installed", len(patches))
    return patches


def _replacement(
    point: CommPoint, original: Callable[..., Any], exchange: Callable[[Tensor, Collective], Tensor]
) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into a compiled block: the original op
            return original(*args, **kwargs)
        x, collective = point.collective(*args, **kwargs)
        return exchange(x, collective)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    return run


def restore(patches: Iterable[Patch]) -> None:
    """Put the points' original methods back."""
    for p in reversed(list(patches)):
        p.undo()
