"""The graph engine's split backward: B (input gradients) now, W (weight gradients) later.

The graph work goes through public autograd: ``torch.autograd.grad`` with ``GradientEdge``
outputs and inputs, ``Node.register_prehook`` and ``Node.next_functions``. Two facts come from
private attributes, read through :mod:`zbpipe._compat`: the shapes of the gradients a node
receives (``Node._input_metadata``, in :mod:`zbpipe.engines.graph_regions`: stage 0's targets
and a target's slot count) and whether a gradient is a view (``Tensor._is_view``, in
:func:`zbpipe.engines.accumulate.accumulate`).

The engine only runs the part of the graph that leads to the requested inputs, and inside a node
it only computes the outputs whose edge leads there (``AddmmBackward`` computes ``grad @ W`` for
its input but not ``x.T @ grad`` for its weight when only the input is asked for). B and W are two
different requests on one graph.

Vocabulary used in the comments below (all about the autograd graph of one stage and microbatch):

* **targets**: where B stops. On a stage whose inputs require grad, the inputs' gradient edges. On
  the first stage (no input requires grad) the lowest *activation* nodes, see ``_stage0_targets``.
* **activation region A**: every node with a path to a target. B runs exactly these nodes.
* **weight region**: nodes outside A (and not targets) with a path to a parameter. W runs them.
* **boundary**: a node of A with an edge into the weight region, or a stage-0 target. B records
  the gradient that arrives at it (a prehook); W re-enters the graph there.

B is :func:`backward_input`: one ``autograd.grad`` call for the targets, with prehooks recording
what arrives at each boundary. W is the :class:`~zbpipe.engines.graph_weight.WeightGrad` it
returns (its own module; re-exported here, the documented import); the graph analysis both share
is :mod:`zbpipe.engines.graph_regions`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ..memory.saved import (
    ACTIVATION,
    KEEP,
    Holder,
    SavedTensors,
    mark_unpacking,
    param_storages,
    storage_ptr,
)
from .fused import valid_outputs
from .graph_recompute import RecomputeReplay
from .graph_regions import (
    _Boundary,
    _foldable,
    _Graph,
    _group_boundaries,
    _num_slots,
    _stage0_targets,
)
from .graph_weight import WeightGrad

logger = logging.getLogger(__name__)

__all__ = ["WeightGrad", "backward_input"]


def backward_input(
    outputs: Sequence[Tensor],
    output_grads: Sequence[Tensor | None] | None,
    inputs: Sequence[Any],
    params: Sequence[Tensor],
    saved: SavedTensors | None = None,
) -> tuple[tuple[Tensor | None, ...], WeightGrad]:
    """B: gradients of ``inputs`` (not accumulated into ``.grad``) and the pending W.

    ``saved``: the holders of what this microbatch's forward saved (:mod:`zbpipe.memory.saved`). B
    tags each unpack with the kind of node doing it and afterwards releases what only activation
    nodes used: W never runs those nodes, so their saved tensors need not live until W. Its
    ``observer`` (a memory meter) is also told about the gradients W keeps from B.

    ``outputs`` are the stage's output tensors, or ``[loss]`` on the last stage with
    ``output_grads=None`` (then every gradient is ones). Parameter gradients are not computed here;
    ``WeightGrad.run()`` computes and accumulates them. Gradients flow to ``params`` only: other
    leaves that require grad get none from W.

    Four steps, one function each: find the regions (:func:`_find_split`), run B's one call
    (:func:`_input_pass`), hand its results to the inputs and the boundaries
    (:func:`_input_grads`, :func:`_record`), then build the pending W (:func:`_pending_w`).
    """
    outs, grads = valid_outputs(outputs, output_grads)
    grad_params = _unique_params(params)
    param_nodes = [get_gradient_edge(p).node for p in grad_params]
    input_pos = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    input_edges = [get_gradient_edge(inputs[i]) for i in input_pos]
    if not outs:
        empty = WeightGrad([], [], [], grad_params, param_nodes, set())
        return tuple(None for _ in inputs), empty

    split = _find_split(outs, grads, input_edges, param_nodes)
    replay = RecomputeReplay(saved, param_storages(grad_params))
    res, recorded = _input_pass(split, outs, grads, saved, replay)
    result = _input_grads(split, res, input_pos, input_edges, len(inputs))
    boundaries = _record(split, res, recorded)
    wg = _pending_w(split, boundaries, grads, res, grad_params, param_nodes, saved, replay)
    return result, wg


@dataclass
class _Split:
    """Where B stops and W re-enters on one stage graph (vocabulary: the module docstring)."""

    g: _Graph
    reached_inputs: list[GradientEdge]  # the input edges the outputs reach: B asks for these
    targets: set[Node]  # where B stops: those inputs' nodes, or the stage-0 targets
    in_a: set[Node]  # the activation region: exactly the nodes B's call runs
    boundaries: list[_Boundary]  # in g.order, parents first
    root_seeds: list[tuple[Node, int, Tensor]]  # outputs starting in the weight region

    @property
    def stage0_targets(self) -> list[Node]:
        """Targets that are not input nodes (a stage none of whose inputs requires grad)."""
        return [n for n in self.g.order if n in self.targets and n not in self.g.input_nodes]


def _find_split(
    outs: list[Tensor],
    grads: list[Tensor],
    input_edges: list[GradientEdge],
    param_nodes: list[Node],
) -> _Split:
    """Walk the graph once: B's targets, the activation region A, the boundaries, the root seeds."""
    g = _Graph.build(outs, {e.node for e in input_edges}, set(param_nodes))
    reached_inputs = [e for e in input_edges if e.node in g.children]
    targets = {e.node for e in reached_inputs} if reached_inputs else _stage0_targets(g)
    in_a = g.reaching(targets)
    boundaries = _find_boundaries(g, in_a, targets)
    # Output edges that start directly in the weight region (an output computed from parameters
    # only) are seeds of W's weight-region call; B has nothing to do for them.
    root_seeds = []
    for t, gr in zip(outs, grads, strict=True):
        e = get_gradient_edge(t)
        if e.node not in in_a and e.node not in targets and g.reaches_param(e.node):
            root_seeds.append((e.node, e.output_nr, gr))
    return _Split(g, reached_inputs, targets, in_a, boundaries, root_seeds)


def _find_boundaries(g: _Graph, in_a: set[Node], targets: set[Node]) -> list[_Boundary]:
    """The nodes of A with an edge into the weight region, and the stage-0 targets (W runs all of
    a stage-0 target), each with its level (see ``_group_boundaries``) and conflict flag."""
    boundaries: list[_Boundary] = []
    level: dict[Node, int] = {}  # boundaries strictly above a node of A
    for node in g.order:
        if node not in in_a and node not in targets:
            continue
        weight_edges, act_children = [], []
        for child, nr in node.next_functions:
            if child is None:
                continue
            if child in in_a or child in targets:
                act_children.append(child)
            elif g.reaches_param(child):
                weight_edges.append((child, nr))
        lvl = level.get(node, 0)
        if node in targets and node not in g.input_nodes:
            # A stage-0 target: B records what arrives at it; W runs all of it.
            boundaries.append(_Boundary(node, None, weight_edges, [], False, lvl))
        elif node in in_a and weight_edges:
            boundaries.append(_Boundary(node, None, weight_edges, act_children, False, lvl))
            lvl += 1
        for child in act_children:  # parents come first in g.order: lvl is final here
            if level.get(child, 0) < lvl:
                level[child] = lvl
    for b in boundaries:
        b.conflict = g.conflict(b)
    return boundaries


def _input_pass(
    split: _Split,
    outs: list[Tensor],
    grads: list[Tensor],
    saved: SavedTensors | None,
    replay: RecomputeReplay,
) -> tuple[tuple[Tensor | None, ...], dict[Node, tuple[Tensor | None, ...]]]:
    """B's one ``autograd.grad`` call: the gradients at the reached inputs, then at every input
    slot of every stage-0 target (in :attr:`_Split.stage0_targets` order), and what arrived at
    each boundary of A (recorded by prehooks). Frees the activation-only saved tensors after it;
    the checkpointed regions it recomputed replay that recompute to W (``replay``).
    """
    # Prehooks record what reaches each boundary of A (the node's full incoming gradient: all of
    # its parents are in A and the engine runs a node only after all of them).
    recorded: dict[Node, tuple[Tensor | None, ...]] = {}
    handles = [
        b.node.register_prehook(_recorder(recorded, b.node))
        for b in split.boundaries
        if b.node in split.in_a
    ]
    # Saved-tensor release (zbpipe.memory.saved): a prehook runs right before its node unpacks its
    # saved tensors, so tagging there tells which holders only activation nodes (never re-run by W)
    # used. A conflict boundary makes W re-run activation children, so then nothing is released
    # early.
    release_early = saved is not None and not any(b.conflict for b in split.boundaries)
    if release_early:
        keep = {b.node for b in split.boundaries}
        for node in split.in_a:
            handles.append(node.register_prehook(_tagger(KEEP if node in keep else ACTIVATION)))
    target_edges: list[GradientEdge] = list(split.reached_inputs)
    for n in split.stage0_targets:
        # Capture (not run) every input slot of a stage-0 target: asking for GradientEdge(n, i)
        # makes the engine stop at n and hand back the sum arriving at slot i.
        target_edges.extend(GradientEdge(n, i) for i in range(_num_slots(n)))
    try:
        with replay.recording():
            res = torch.autograd.grad(
                outs, target_edges, grad_outputs=grads, retain_graph=True, allow_unused=True
            )
    finally:
        mark_unpacking(None)
        for h in handles:
            h.remove()
        replay.replay()
    if release_early and saved is not None:
        saved.release_activation_only()
    return res, recorded


def _input_grads(
    split: _Split,
    res: tuple[Tensor | None, ...],
    input_pos: list[int],
    input_edges: list[GradientEdge],
    n_inputs: int,
) -> tuple[Tensor | None, ...]:
    """B's result per input (None for an input that needs no gradient or is not reached)."""
    got = res[: len(split.reached_inputs)]
    by_edge = dict(zip([(e.node, e.output_nr) for e in split.reached_inputs], got, strict=True))
    result: list[Tensor | None] = [None] * n_inputs
    for pos, e in zip(input_pos, input_edges, strict=True):
        result[pos] = by_edge.get((e.node, e.output_nr))
    return tuple(result)


def _record(
    split: _Split,
    res: tuple[Tensor | None, ...],
    recorded: dict[Node, tuple[Tensor | None, ...]],
) -> list[_Boundary]:
    """Give every boundary what B left for W there (a stage-0 target: its captured slots; a
    boundary of A: its recorded gradients); the boundaries that received some gradient."""
    slots = iter(res[len(split.reached_inputs) :])
    captured = {n: tuple(next(slots) for _ in range(_num_slots(n))) for n in split.stage0_targets}
    for b in split.boundaries:
        b.grads = captured[b.node] if b.node in captured else recorded.get(b.node)
    return [
        b for b in split.boundaries if b.grads is not None and any(x is not None for x in b.grads)
    ]


def _pending_w(
    split: _Split,
    boundaries: list[_Boundary],
    grads: list[Tensor],
    res: tuple[Tensor | None, ...],
    grad_params: list[Tensor],
    param_nodes: list[Node],
    saved: SavedTensors | None,
    replay: RecomputeReplay,
) -> WeightGrad:
    """W as B leaves it: the conflict boundaries alone, the others in groups (folded where their
    weight region is private), the root seeds, and the storages W must copy rather than steal."""
    known = _storages(grads) | _storages(res)
    for b in boundaries:
        known |= _storages(b.grads or ())
    conflicts = [b for b in boundaries if b.conflict]
    groups = _group_boundaries(split.g, [b for b in boundaries if not b.conflict])
    root_nodes = {n for n, _, _ in split.root_seeds}
    for group in groups:
        group.params = _foldable(split.g, group, root_nodes)
    held = _held(boundaries, split.root_seeds, saved)
    wg = WeightGrad(
        groups, conflicts, split.root_seeds, grad_params, param_nodes, known, held, replay
    )
    logger.debug(
        "B: %d nodes in A, %d targets, %d boundaries (%d with conflict) in %d groups (%d folded), "
        "%d root seeds, %d recomputes kept: W makes %d calls",
        len(split.in_a),
        len(split.targets),
        len(boundaries),
        len(conflicts),
        len(groups),
        sum(gr.params is not None for gr in groups),
        len(split.root_seeds),
        replay.regions,
        wg.num_calls,
    )
    return wg


def _held(
    boundaries: list[_Boundary],
    root_seeds: list[tuple[Node, int, Tensor]],
    saved: SavedTensors | None,
) -> list[Holder]:
    """Counters for the gradients W keeps from B (every boundary's, the root seeds'), told to
    whoever observes this microbatch's saved tensors: memory the graph engine holds and the
    deferred one does not."""
    observer = saved.observer if saved is not None else None
    if observer is None:
        return []
    grads = [g for b in boundaries for g in b.grads or () if g is not None]
    grads += [g for _, _, g in root_seeds if g is not None]
    return [Holder(g, observer, hold=False) for g in grads]


def _tagger(kind: str) -> Callable[[tuple[Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        mark_unpacking(kind)

    return hook


def _recorder(
    store: dict[Node, tuple[Tensor | None, ...]], node: Node
) -> Callable[[tuple[Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        store[node] = tuple(grad_outputs)

    return hook


# ---------------------------------------------------------------------------------------------
# small helpers


def _unique_params(params: Sequence[Tensor]) -> list[Tensor]:
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _storages(tensors: Iterable[Tensor | None]) -> set[int]:
    """The storages of ``tensors`` (W must copy, not steal, a gradient sharing one of them)."""
    return {ptr for t in tensors if t is not None and (ptr := storage_ptr(t)) is not None}
