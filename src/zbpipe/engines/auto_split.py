"""Which engine a schedule's ``split`` option gives a rank's stages (``"auto"``: by the weight work
each would defer, never the graph engine where it cannot keep the schedule's memory promise), and
the log line per stage that says what W carries."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .. import _compat as C
from .deferred import DeferredEngine
from .graph import GraphEngine
from .protocol import SPLITS, EngineName, SplitEngine
from .weight_share import EngineShare, census, describe, engine_shares

logger = logging.getLogger(__name__)

#: ``auto`` takes the graph engine only where the deferred one would leave more of the
#: estimated weight-gradient FLOPs in B than it defers
GRAPH_BELOW = 0.5


def choose_engine(
    split: str,
    stages: Sequence[Any],
    owner: str,
    *,
    exact: bool = False,
    promise: str | None = None,
) -> SplitEngine:
    """The engine for ``split``: ``"auto"`` is the one that defers the most weight work at the
    least cost (:func:`_auto`).

    ``promise``: the schedule's memory promise in words (``"1F1B's peak"``), where its plan
    splits the backward and keeps one; None otherwise. On activation-checkpointed stages the
    graph engine holds from B to W each region's recomputed saved tensors, which the promise
    against a fused-backward 1F1B does not allow (docs/results/memory-promise.md): ``"auto"``
    then never takes it (INFO), and an explicit ``"graph"`` runs with one WARNING naming
    ``split="deferred"``.

    Each stage's share of weight elements and of estimated weight-gradient FLOPs that W carries
    under each engine is logged (INFO; :mod:`zbpipe.engines.weight_share` says how it counts).
    ``exact``: the deferred engine's W adds as a fused backward does, bit for bit
    (:class:`~zbpipe.engines.deferred.WeightGradStore`); the graph engine has no such option.
    """
    if split not in SPLITS:
        raise ValueError(f"{owner}: split must be one of {SPLITS}, got {split!r}")
    for st in stages:
        one = engine_shares([st])
        logger.info(
            "zbpipe %s: %s",
            owner,
            describe(getattr(st, "stage_index", "?"), census(st.submod), one),
        )
    checkpointed = _checkpointed(stages) if promise is not None else None
    name: str
    if split == "auto":
        name = _auto(engine_shares(list(stages)), owner, checkpointed, promise)
    else:
        name = split
        if name == "graph" and checkpointed is not None:
            _warn_graph(checkpointed, promise, owner)
    if name == "graph":
        return GraphEngine()
    return DeferredEngine(exact=exact)


def _warn_graph(checkpointed: str, promise: str | None, owner: str) -> None:
    """An explicit ``split="graph"`` on checkpointed stages with a promise: it runs, said once."""
    logger.warning(
        "zbpipe %s: split='graph' will not keep this schedule's memory promise (%s): %s "
        "is activation-checkpointed, and the graph engine keeps each region's "
        "recomputed saved tensors from B to W. split='deferred' keeps only its Linears' "
        "and experts' GEMM inputs (the least a split backward holds there); a "
        "fused-backward schedule (Schedule1F1B) holds a fused 1F1B's peak",
        owner,
        promise,
        checkpointed,
    )


def _log_promise_kept(owner: str, checkpointed: str, promise: str | None, flops: float) -> None:
    """``"auto"`` left the graph engine for the promise's sake: why, and how to override."""
    logger.info(
        "zbpipe %s: split='auto' chose the deferred engine: %s is activation-checkpointed, "
        "and there the graph engine keeps each region's recomputed saved tensors from B "
        "to W, more than this schedule's memory promise (%s) allows; the deferred engine "
        "defers %.1f%% of the est. weight-gradient FLOPs (the rest stays in B); pass "
        "split='graph' to override",
        owner,
        checkpointed,
        promise,
        100 * flops,
    )


def _checkpointed(stages: Sequence[Any]) -> str | None:
    """Where the first checkpoint wrapper is, in words ("stage 1's submodule 'layers.0'"), or None:
    what can be known before the first step (a checkpoint call inside a forward is not)."""
    for st in stages:
        name = C.checkpointed_submodule(st.submod)
        if name is not None:
            where = f"submodule {name!r}" if name else "module"
            return f"stage {getattr(st, 'stage_index', '?')}'s {where}"
    return None


def _auto(
    shares: dict[str, EngineShare],
    owner: str,
    checkpointed: str | None = None,
    promise: str | None = None,
) -> EngineName:
    """The deferred engine unless it would leave most weight-gradient work in B.

    It costs what a fused backward costs (one autograd pass, then GEMMs), where the graph engine
    walks the graph in Python in B and again per weight region in W (1.1x-3x a fused backward,
    docs/design/backward.md): it is worth that only where it defers much more. It also refuses
    compiled regions (and, on torch 2.11 only, selective activation checkpointing), so a rank
    with one always gets the deferred engine. Selective checkpointing on torch 2.13 and later
    does not decide it: the graph engine's W replays B's recompute
    (:mod:`zbpipe.engines.graph_recompute`). Where ``checkpointed`` names a checkpoint wrapper
    and the schedule keeps a memory ``promise``, the graph engine is never taken: between B
    and W it holds each region's recomputed saved tensors (:func:`choose_engine`).
    """
    deferred, graph = shares["deferred"], shares["graph"]
    if graph.refused:
        logger.info(
            "zbpipe %s: split='auto' chose the deferred engine: these stages hold torch.compile'd "
            "submodules (or, on this torch, selectively checkpointed ones), which the graph "
            "engine cannot split; W carries %.1f%% of the est. weight-gradient FLOPs",
            owner,
            100 * deferred.flops,
        )
        return "deferred"
    if deferred.flops < GRAPH_BELOW and checkpointed is not None:
        _log_promise_kept(owner, checkpointed, promise, deferred.flops)
        return "deferred"
    if deferred.flops < GRAPH_BELOW:
        logger.info(
            "zbpipe %s: split='auto' chose the graph engine: the deferred engine would defer only "
            "%.1f%% of the est. weight-gradient FLOPs (%.1f%% of weight elements; what it leaves "
            "in B: modules other than nn.Linear and MoE experts), the graph engine all of them; "
            "pass split='deferred' to override",
            owner,
            100 * deferred.flops,
            100 * deferred.elements,
        )
        return "graph"
    logger.info(
        "zbpipe %s: split='auto' chose the deferred engine: it defers %.2f%% of the est. "
        "weight-gradient FLOPs (%.2f%% of weight elements) at the cost of a fused backward; "
        "the graph engine would defer %.2f%% more, at the cost of walking the graph in Python "
        "in B and again in W",
        owner,
        100 * deferred.flops,
        100 * deferred.elements,
        100 * (graph.flops - deferred.flops),
    )
    return "deferred"
