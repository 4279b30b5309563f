"""The split-backward engines: what B and W do to a stage's graph, behind one protocol.

The stage seam (:mod:`zbpipe.stage_seam`) owns what an action does to a torch ``PipelineStage``
(caches, hand-offs, FSDP preparation, torch's own path for ``dw_builder`` stages) and calls one
:class:`SplitEngine` for the part that differs between engines: what F must set up, how B
computes the input gradients while keeping the weight pass pending, and how W runs it.
docs/backward.md says when each engine is right:

* **deferred** (:mod:`zbpipe.engines.deferred`, its Linears in
  :mod:`zbpipe.engines.linear_patch`): B is one ordinary autograd pass in which patched
  ``nn.Linear`` modules queue their weight GEMMs; W runs them.
* **graph** (:mod:`zbpipe.engines.graph`, its algorithms in
  :mod:`zbpipe.engines.graph_backward` and :mod:`zbpipe.engines.graph_regions`): B asks autograd
  for the input edges only, W re-enters the graph per weight region. Every weight in W.

Both add weight gradients to ``.grad`` by one rule (:mod:`zbpipe.engines.accumulate`).
Keys are ``(stage_index, microbatch)``, the microbatch being whatever index the stage's caches
use (the step's for planned schedules, a global one for continuous).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

from torch import Tensor

from ..saved import Observer, SavedTensors
from ..validation import compiled_submodule
from .deferred import DeferredEngine
from .graph import GraphEngine
from .linear_patch import weight_census

logger = logging.getLogger(__name__)

EngineName = Literal["deferred", "graph"]
Split = Literal["auto", "deferred", "graph"]
SPLITS: tuple[str, ...] = ("auto", "deferred", "graph")
Key = tuple[int, int]

__all__ = ["SPLITS", "EngineName", "Key", "Split", "SplitEngine", "choose_engine"]


class SplitEngine(Protocol):
    """What the stage seam asks of a split-backward engine (one object per schedule and rank)."""

    @property
    def name(self) -> EngineName:
        """``"deferred"`` or ``"graph"``: what a schedule's ``split`` attribute reports."""

    @property
    def unshards_for_backward(self) -> bool:
        """Whether B and W need a stage's FSDP2 blocks unsharded (the seam unshards them)."""

    @property
    def uses_saved_holders(self) -> bool:
        """Whether B takes the holders of what a split key's forward saved (:mod:`zbpipe.saved`,
        installed by the seam) to free tensors before W."""

    @property
    def bw_through_store(self) -> bool:
        """Whether a fused BW (every one but a stage's first of the step) may run as this
        engine's B then W at once, cheaper than torch's fused backward (``StageSeam.assign``)."""

    def attach(self, stages: Sequence[Any]) -> None:
        """Prepare this rank's stages (once, when the seam is built)."""

    def claim_linears(self) -> None:
        """Take the stages' modules back from another schedule built on them (every step)."""

    def check_stages(self, owner: type, stages: Sequence[Any]) -> None:
        """Raise ``ValueError`` for stages this engine cannot split (at construction)."""

    def forward_scope(
        self, key: Key, meter: Observer | None, *, fused: bool
    ) -> AbstractContextManager[None]:
        """Around the forward of a key whose backward runs through the engine. ``meter``
        counts what the engine keeps until W; ``fused``: the backward is a fused BW run as B
        then W at once."""

    def backward_input(
        self,
        key: Key,
        outputs: Sequence[Any],
        output_grads: Sequence[Tensor | None] | None,
        inputs: Sequence[Any],
        params: Callable[[], list[Tensor]],
        saved: SavedTensors | None,
    ) -> tuple[Tensor | None, ...]:
        """B of ``key``: the gradients of ``inputs`` (``output_grads=None``: ``outputs`` is the
        loss), the weight pass kept pending. ``params``: the weights W computes (read when B
        needs them); ``saved``: the holders of what the forward saved, if any."""

    def backward_weight(self, key: Key) -> None:
        """W of ``key``: accumulate the weight gradients B left pending, once."""

    def pending_keys(self) -> list[Key]:
        """The keys whose B ran but whose W has not."""

    def clear(self) -> None:
        """Drop everything pending (a step ended, or failed midway)."""


def choose_engine(
    split: str, stages: Sequence[Any], owner: str, *, exact: bool = False
) -> SplitEngine:
    """The engine for ``split``: ``"auto"`` is deferred unless most weight work is not in Linears.

    ``auto`` counts weight elements (:func:`~zbpipe.engines.linear_patch.weight_census`): where
    matrix-like weights outside ``nn.Linear`` (convolutions, custom matmuls) outnumber the
    Linears', the deferred engine would leave most weight-gradient work in B, so the graph
    engine is chosen and a log line says why. A stage with a ``torch.compile``d submodule always
    gets the deferred engine: the graph engine cannot split a compiled region and refuses it.
    ``exact``: the deferred engine's W adds as a fused backward does, bit for bit
    (:class:`~zbpipe.engines.deferred.WeightGradStore`); the graph engine has no such option.
    """
    if split not in SPLITS:
        raise ValueError(f"{owner}: split must be one of {SPLITS}, got {split!r}")
    name = split if split != "auto" else _auto(stages, owner)
    if name == "graph":
        return GraphEngine()
    return DeferredEngine(exact=exact)


def _auto(stages: Sequence[Any], owner: str) -> EngineName:
    compiled = [
        getattr(st, "stage_index", i)
        for i, st in enumerate(stages)
        if compiled_submodule(st.submod) is not None
    ]
    if compiled:
        logger.info(
            "zbpipe %s: split='auto' chose the deferred engine: stage(s) %s hold torch.compile'd "
            "submodules, which the graph engine cannot split (their weight gradients come in B)",
            owner,
            compiled,
        )
        return "deferred"
    linear = other = 0
    for st in stages:
        a, b = weight_census(st.submod)
        linear, other = linear + a, other + b
    if other > linear:
        logger.info(
            "zbpipe %s: split='auto' chose the graph engine: %d weight elements are outside "
            "nn.Linear against %d inside, so deferring Linear GEMMs would leave most weight "
            "work in B; pass split='deferred' to override",
            owner,
            other,
            linear,
        )
        return "graph"
    return "deferred"
