"""The graph engine's weight pass W: re-enter a stage graph where B recorded the gradients.

:func:`zbpipe.engines.graph_backward.backward_input` (B) leaves one :class:`WeightGrad` per (stage,
microbatch): the boundaries where the activation region A meets the weight region, each with the
gradient B recorded there, grouped (``zbpipe.engines.graph_regions._group_boundaries``), and the
output edges that start in the weight region (root seeds). Vocabulary: the module docstring of
:mod:`zbpipe.engines.graph_backward`.

W makes one ``autograd.grad`` call per *group* of boundaries (seeded with the recorded gradients,
asking only for the group's weight-region edges, so the engine runs just those nodes and computes
only their weight outputs), then one call over the weight region from those edges to the
parameters. A group holds boundaries none of whose activation paths lead to another member's
weight edges (siblings such as q/k/v projections); a group whose weight region is private asks
for its parameters directly and runs that region itself (``_foldable``). One call seeded at every
boundary would instead recompute the activation chain between boundaries (boundary k's
activation edge leads to boundary k-1's parameters): twice the activation work. So a chain of
layers still costs one call per boundary. A *conflict* boundary (a weight node also reachable
through its activation children) gets a call of its own with those children's gradients clamped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from ..memory.saved import Holder
from .accumulate import accumulate
from .graph_recompute import RecomputeReplay
from .graph_regions import _Boundary, _Group

__all__ = ["WeightGrad"]


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
        replay: RecomputeReplay | None = None,
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
        # B's recomputes of checkpointed regions, replayed by W's calls (graph_recompute)
        self._replay = replay

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
        """Compute the parameter gradients and accumulate them into ``p.grad`` like autograd."""
        if self._groups is None:
            raise RuntimeError(
                "WeightGrad.run() was called twice: the weight pass of a microbatch runs once and "
                "frees its graph; run backward_input again on a new forward to get a new WeightGrad"
            )
        try:
            self._run()
        finally:
            if self._replay is not None:
                self._replay.release()
                self._replay = None

    def _run(self) -> None:
        """W's calls. Long because it is W's one pass over the recorded regions, with its error
        paths beside it."""
        assert self._groups is not None
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


def _sum(parts: list[Tensor]) -> Tensor:
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total
