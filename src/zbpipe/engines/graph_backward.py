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

W makes one ``autograd.grad`` call per *group* of boundaries (seeded with the recorded gradients,
asking only for the group's weight-region edges, so the engine runs just those nodes and computes
only their weight outputs), then one call over the weight region from those edges to the
parameters. A group holds boundaries none of whose activation paths lead to another member's
weight edges (siblings such as q/k/v projections; ``_group_boundaries``); a group whose weight
region is private asks for its parameters directly and runs that region itself (``_foldable``).
One call seeded at every boundary would instead recompute the activation chain between
boundaries (boundary k's activation edge leads to boundary k-1's parameters): twice the
activation work. So a chain of layers still costs one call per boundary.

Long because the graph surgery of B and W is explained step by step beside the code that does it,
as in torch's ``_backward.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ..memory.saved import ACTIVATION, KEEP, Holder, SavedTensors, mark_unpacking, storage_ptr
from .accumulate import accumulate
from .fused import valid_outputs
from .graph_regions import (
    _Boundary,
    _foldable,
    _Graph,
    _Group,
    _group_boundaries,
    _num_slots,
    _stage0_targets,
)

logger = logging.getLogger(__name__)

__all__ = ["WeightGrad", "backward_input"]


class WeightGrad:
    """The pending weight pass W of one (stage, microbatch); ``run()`` it exactly once."""

    def __init__(
        self,
        groups: list[_Group],
        conflicts: list[_Boundary],
        root_seeds: list[tuple[Node, int, Tensor]],
        params: list[Tensor],
        param_nodes: list[Node],
        known_storages: set[int],
        held: Sequence[Holder] = (),
    ) -> None:
        self._groups: list[_Group] | None = groups
        self._conflicts = conflicts
        self._root_seeds = root_seeds
        self._params = params
        self._param_nodes = param_nodes
        self._known_storages = known_storages
        # A memory meter's count of the recorded gradients this W keeps
        # (zbpipe.memory.saved.Holder).
        self._held = list(held)

    @property
    def done(self) -> bool:
        return self._groups is None

    @property
    def num_calls(self) -> int:
        """``autograd.grad`` calls ``run()`` will make (before it runs; for tests and logs)."""
        if self._groups is None:
            return 0
        unfolded = any(gr.params is None for gr in self._groups)
        final = bool(self._root_seeds or self._conflicts or unfolded)
        return len(self._groups) + len(self._conflicts) + final

    def run(self) -> None:
        """Compute the parameter gradients and accumulate them into ``p.grad`` like autograd.

        Long because it is W's one pass over the recorded regions, with its error paths beside it.
        """
        if self._groups is None:
            raise RuntimeError(
                "WeightGrad.run() was called twice: the weight pass of a microbatch runs once and "
                "frees its graph; run backward_input again on a new forward to get a new WeightGrad"
            )
        groups, conflicts, root_seeds = self._groups, self._conflicts, self._root_seeds
        # Drop our references first, so that an exception midway still leaves no graph alive.
        self._groups, self._conflicts, self._root_seeds = None, [], []
        param_index = {n: i for i, n in enumerate(self._param_nodes)}
        contributions: list[list[Tensor]] = [[] for _ in self._params]
        # Seeds of the weight-region call, keyed by edge. A dict keeps insertion order, so the
        # summation order (hence the rounding) is deterministic.
        seeds: dict[tuple[Node, int], list[Tensor]] = {}

        def collect(child: Node, nr: int, g: Tensor | None) -> None:
            if g is None:
                return
            if child in param_index:  # a parameter's AccumulateGrad: the gradient is final
                contributions[param_index[child]].append(g)
            else:
                seeds.setdefault((child, nr), []).append(g)

        for child, nr, seed in root_seeds:
            collect(child, nr, seed)
        # Conflict calls run the activation children again (with undefined gradients), so nothing
        # may be freed until they are done: they go first, all with retain_graph=True.
        any_conflict = bool(conflicts)
        for b in conflicts:
            grads = self._boundary_pass(b, retain=True)
            for (child, nr), g in zip(b.weight_edges, grads, strict=True):
                collect(child, nr, g)
            b.grads = None
        del conflicts
        for gr in groups:
            if gr.params is not None:
                res = _group_pass(gr.members, [GradientEdge(n, 0) for n in gr.params], any_conflict)
                for n, g in zip(gr.params, res, strict=True):
                    if g is not None:
                        contributions[param_index[n]].append(g)
            else:
                res = _group_pass(
                    gr.members, [GradientEdge(c, nr) for c, nr in gr.edges], any_conflict
                )
                for (child, nr), g in zip(gr.edges, res, strict=True):
                    collect(child, nr, g)
            for b in gr.members:
                b.grads = None
        del groups

        if seeds:
            self._weight_region_pass(seeds, contributions, retain=any_conflict)
        seeds.clear()

        with torch.no_grad():
            for p, parts in zip(self._params, contributions, strict=True):
                if parts:
                    accumulate(p, _sum(parts), self._known_storages)
        self._params, self._param_nodes = [], []
        for h in self._held:
            h.release()
        self._held = []

    @staticmethod
    def _boundary_pass(b: _Boundary, retain: bool) -> tuple[Tensor | None, ...]:
        """Re-run one conflict boundary node, asking only for its weight-region edges."""
        assert b.grads is not None
        outs = [GradientEdge(b.node, i) for i, g in enumerate(b.grads) if g is not None]
        seeds = [g for g in b.grads if g is not None]
        if not outs:
            return tuple(None for _ in b.weight_edges)
        handles = []
        try:
            # A weight-region node below this boundary is also reachable through one of its
            # activation children (e.g. a bias AccumulateGrad shared by two uses of one
            # Linear). The engine will then compute the activation edge too; clamping every
            # activation child's incoming gradient to "undefined" makes that path contribute
            # nothing (built-in formulas skip undefined gradients), so each contribution is
            # counted once: its own boundary's call delivers it.
            for child in b.act_children:
                handles.append(child.register_prehook(lambda go: tuple(None for _ in go)))
            return torch.autograd.grad(
                outs,
                [GradientEdge(c, nr) for c, nr in b.weight_edges],
                grad_outputs=seeds,
                retain_graph=retain,
                allow_unused=True,
            )
        finally:
            for h in handles:
                h.remove()

    def _weight_region_pass(
        self,
        seeds: dict[tuple[Node, int], list[Tensor]],
        contributions: list[list[Tensor]],
        retain: bool,
    ) -> None:
        """One call from every weight-region entry edge not handled by a folded group.

        The weight region has no path back into A (a node with one would be in A), so this call
        runs only weight-only work (a TBackward, a weight-norm, an EmbeddingBackward, ...). A node
        reached from several entries (a weight shared by two boundaries) sums them in its input
        buffer, as in a fused backward.
        """
        edges = [GradientEdge(n, nr) for n, nr in seeds]
        grads = [_sum(parts) for parts in seeds.values()]
        res = torch.autograd.grad(
            edges,
            [GradientEdge(n, 0) for n in self._param_nodes],
            grad_outputs=grads,
            retain_graph=retain,
            allow_unused=True,
        )
        for i, g in enumerate(res):
            if g is not None:
                contributions[i].append(g)


def _group_pass(
    members: list[_Boundary], wanted: list[GradientEdge], retain: bool
) -> tuple[Tensor | None, ...]:
    """One call seeded at every member's recorded gradient, capturing ``wanted``.

    ``_group_boundaries`` guarantees that nothing below a member's activation children leads to
    a captured node, so the engine runs exactly the members (and, folded, their private weight
    region): each gets only its own seed, as in a call of its own.
    """
    outs, seeds = [], []
    for b in members:
        assert b.grads is not None
        for i, g in enumerate(b.grads):
            if g is not None:
                outs.append(GradientEdge(b.node, i))
                seeds.append(g)
    if not outs:
        return tuple(None for _ in wanted)
    return torch.autograd.grad(
        outs, wanted, grad_outputs=seeds, retain_graph=retain, allow_unused=True
    )


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

    Long because each step of the graph surgery is commented where it happens; split, the comments
    would lose the state they describe.
    """
    outs, grads = valid_outputs(outputs, output_grads)
    grad_params = _unique_params(params)
    param_nodes = [get_gradient_edge(p).node for p in grad_params]
    input_pos = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    input_edges = [get_gradient_edge(inputs[i]) for i in input_pos]
    result: list[Tensor | None] = [None] * len(inputs)
    if not outs:
        return tuple(result), WeightGrad([], [], [], grad_params, param_nodes, set())

    g = _Graph.build(outs, {e.node for e in input_edges}, set(param_nodes))
    reached_inputs = [e for e in input_edges if e.node in g.children]
    if reached_inputs:
        targets = {e.node for e in reached_inputs}
    else:
        targets = _stage0_targets(g)
    in_a = g.reaching(targets)  # the activation region: exactly the nodes B's call will run

    boundaries: list[_Boundary] = []
    level: dict[Node, int] = {}  # boundaries strictly above a node of A (see _group_boundaries)
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

    # Output edges that start directly in the weight region (an output computed from parameters
    # only) are seeds of W's weight-region call; B has nothing to do for them.
    root_seeds = []
    for t, gr in zip(outs, grads, strict=True):
        e = get_gradient_edge(t)
        if e.node not in in_a and e.node not in targets and g.reaches_param(e.node):
            root_seeds.append((e.node, e.output_nr, gr))

    # --- B: one call; prehooks record what reaches each boundary of A (the node's full incoming
    # gradient: all of its parents are in A and the engine runs a node only after all of them).
    recorded: dict[Node, tuple[Tensor | None, ...]] = {}
    handles = []
    for b in boundaries:
        if b.node in in_a:
            handles.append(b.node.register_prehook(_recorder(recorded, b.node)))
    # Saved-tensor release (zbpipe.memory.saved): a prehook runs right before its node unpacks its
    # saved tensors, so tagging there tells which holders only activation nodes (never re-run by W)
    # used. A conflict boundary makes W re-run activation children, so then nothing is released
    # early.
    release_early = saved is not None and not any(b.conflict for b in boundaries)
    if release_early:
        keep = {b.node for b in boundaries}
        for node in in_a:
            handles.append(node.register_prehook(_tagger(KEEP if node in keep else ACTIVATION)))
    stage0_targets = [n for n in g.order if n in targets and n not in g.input_nodes]
    target_edges: list[GradientEdge] = list(reached_inputs)
    slots: list[tuple[Node, int]] = []
    for n in stage0_targets:
        # Capture (not run) every input slot of a stage-0 target: asking for GradientEdge(n, i)
        # makes the engine stop at n and hand back the sum arriving at slot i.
        for i in range(_num_slots(n)):
            target_edges.append(GradientEdge(n, i))
            slots.append((n, i))
    try:
        res = torch.autograd.grad(
            outs, target_edges, grad_outputs=grads, retain_graph=True, allow_unused=True
        )
    finally:
        mark_unpacking(None)
        for h in handles:
            h.remove()
    if release_early and saved is not None:
        saved.release_activation_only()

    by_edge = dict(zip([(e.node, e.output_nr) for e in reached_inputs], res[: len(reached_inputs)]))
    for pos, e in zip(input_pos, input_edges, strict=True):
        result[pos] = by_edge.get((e.node, e.output_nr))
    captured: dict[Node, list[Tensor | None]] = {n: [None] * _num_slots(n) for n in stage0_targets}
    for (n, i), gr in zip(slots, res[len(reached_inputs) :], strict=True):
        captured[n][i] = gr
    for b in boundaries:
        b.grads = tuple(captured[b.node]) if b.node in captured else recorded.get(b.node)
    boundaries = [
        b for b in boundaries if b.grads is not None and any(x is not None for x in b.grads)
    ]

    known = _storages(grads) | _storages(res)
    for b in boundaries:
        known |= _storages(b.grads or ())
    conflicts = [b for b in boundaries if b.conflict]
    groups = _group_boundaries(g, [b for b in boundaries if not b.conflict])
    root_nodes = {n for n, _, _ in root_seeds}
    for group in groups:
        group.params = _foldable(g, group, root_nodes)
    wg = WeightGrad(
        groups,
        conflicts,
        root_seeds,
        grad_params,
        param_nodes,
        known,
        _held(boundaries, root_seeds, saved),
    )
    logger.debug(
        "B: %d nodes in A, %d targets, %d boundaries (%d with conflict) in %d groups (%d folded), "
        "%d root seeds: W makes %d calls",
        len(in_a),
        len(targets),
        len(boundaries),
        len(conflicts),
        len(groups),
        sum(gr.params is not None for gr in groups),
        len(root_seeds),
        wg.num_calls,
    )
    return tuple(result), wg


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


def _sum(parts: list[Tensor]) -> Tensor:
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _storages(tensors: Iterable[Tensor | None]) -> set[int]:
    """The storages of ``tensors`` (W must copy, not steal, a gradient sharing one of them)."""
    return {ptr for t in tensors if t is not None and (ptr := storage_ptr(t)) is not None}
