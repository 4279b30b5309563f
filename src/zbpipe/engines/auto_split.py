"""Which engine a schedule's ``split`` option gives a rank's stages (``"auto"``: by their
weights)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .._compat import compiled_submodule
from .deferred import DeferredEngine
from .graph import GraphEngine
from .linear_patch import weight_census
from .protocol import SPLITS, EngineName, SplitEngine

logger = logging.getLogger(__name__)


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
