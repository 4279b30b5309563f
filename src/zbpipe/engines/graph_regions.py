"""Graph analysis for the graph engine's split backward (:mod:`zbpipe.engines.graph_backward`):
walk a stage's autograd graph once, find the activation region, the boundaries where W re-enters,
the stage-0 targets, and the groups of boundaries one W call can serve. Vocabulary: see
:mod:`zbpipe.engines.graph_backward`'s docstring.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge

from .. import _compat as C


@dataclass
class _Boundary:
    """Where W re-enters the graph: ``node`` receives ``grads`` (recorded during B)."""

    node: Node
    grads: tuple[Tensor | None, ...] | None
    weight_edges: list[tuple[Node, int]]  # (child, input_nr) edges into the weight region
    act_children: list[Node]  # children B already handled (in A, or targets)
    conflict: bool  # a weight edge's child is also reachable through an activation child
    level: int = 0  # the most boundaries on a path from the outputs down to it (for grouping)


@dataclass
class _Group:
    """Boundaries W re-enters in one ``autograd.grad`` call (see ``_group_boundaries``)."""

    members: list[_Boundary]
    edges: list[tuple[Node, int]]  # their weight edges, each once (a shared child is captured once)
    params: list[Node] | None = None  # folded: ask for these parameters directly (``_foldable``)


# ---------------------------------------------------------------------------------------------
# graph analysis


@dataclass
class _Graph:
    """The stage's autograd graph below its outputs, walked once."""

    order: list[Node]  # parents before children (topological)
    children: dict[Node, list[Node]]  # distinct non-None children, walk stopped at terminals
    input_nodes: set[Node]
    param_nodes: set[Node]
    params_below: dict[Node, frozenset[Node]]  # parameter AccumulateGrads reachable from a node
    parents: dict[Node, int]  # number of distinct parents

    @classmethod
    def build(cls, outs: list[Tensor], input_nodes: set[Node], param_nodes: set[Node]) -> _Graph:
        roots = [get_gradient_edge(t).node for t in outs]
        children: dict[Node, list[Node]] = {}
        post: list[Node] = []
        # Iterative DFS (graphs of deep stages exceed Python's recursion limit). The walk stops
        # at the stage inputs: what lies behind them belongs to an earlier stage.
        for root in roots:
            if root in children:
                continue
            children[root] = []
            stack = [(root, iter(_kids(root, input_nodes)))]
            while stack:
                node, it = stack[-1]
                for ch in it:
                    if ch not in children[node]:
                        children[node].append(ch)
                    if ch not in children:
                        children[ch] = []
                        stack.append((ch, iter(_kids(ch, input_nodes))))
                        break
                else:
                    stack.pop()
                    post.append(node)
        params_below: dict[Node, frozenset[Node]] = {}
        parents: dict[Node, int] = {}
        for node in post:  # children first
            below = {node} if node in param_nodes else set()
            for ch in children[node]:
                below |= params_below[ch]
                parents[ch] = parents.get(ch, 0) + 1
            params_below[node] = frozenset(below)
        return cls(post[::-1], children, input_nodes, param_nodes, params_below, parents)

    def reaches_param(self, node: Node) -> bool:
        return bool(self.params_below.get(node))

    def reaching(self, targets: set[Node]) -> set[Node]:
        """Nodes with a path to a target (targets themselves excluded)."""
        hit: set[Node] = set()
        for node in reversed(self.order):  # children first
            if any(ch in targets or ch in hit for ch in self.children[node]):
                hit.add(node)
        return hit - targets

    def conflict(self, b: _Boundary) -> bool:
        """Is one of b's weight-edge children also reachable through b's activation children?"""
        shared = {c for c, _ in b.weight_edges if self.parents.get(c, 0) >= 2}
        if not shared or not b.act_children:
            return False
        seen: set[Node] = set()
        stack = list(b.act_children)
        while stack:
            n = stack.pop()
            if n in shared:
                return True
            if n in seen:
                continue
            seen.add(n)
            stack.extend(self.children.get(n, ()))
        return False


def _group_boundaries(g: _Graph, boundaries: list[_Boundary]) -> list[_Group]:
    """Split the (non-conflict) boundaries into groups W can run in one call each.

    One call seeded at the members of a group and asking for their weight edges runs exactly the
    members (and computes exactly what one call per member would) when, for all members b and m:
    (1) nothing reachable from b's activation children is m or one of m's weight-edge children
    (else the engine would run that activation path: recomputation and double counting), and
    (2) nothing strictly below b's weight-edge children is one of m's weight-edge children (else
    that weight node would run here and again in the weight-region pass). A member's activation
    children are then never run (they lead to no requested edge), and a weight-edge child shared
    by several members is captured once, holding the sum of their contributions.

    Candidates: boundaries at the same ``level`` (the most boundaries on a path through A from the
    outputs down to it), e.g. q/k/v or gate/up projections reading one activation. A boundary is
    never on a level with one it reaches, so (1) can only fail through a weight-region node shared
    with a lower boundary, and (2) through a weight node shared below; both need a weight-edge
    child with two parents, and are then checked exactly with reachability bit masks. A chain
    (one boundary per level) gains nothing: W still makes one call per boundary there.

    Long because it is one union-find pass over the graph, commented step by step.
    """
    buckets: dict[int, list[_Boundary]] = {}
    for b in boundaries:
        buckets.setdefault(b.level, []).append(b)
    # Within a level, a violation needs a weight-edge child X of m that is also reached from
    # another node (in b's activation path, or below b's weight edges) than m: X has two parents.
    multi = [bk for bk in buckets.values() if len(bk) > 1]
    shared = {c for bk in multi for b in bk for c, _ in b.weight_edges if g.parents.get(c, 0) > 1}
    if not shared:  # a chain, or siblings with their own weights (q/k/v, gate/up): no check
        return [
            _Group(bk, _unique(e for b in bk for e in b.weight_edges)) for bk in buckets.values()
        ]

    # Bit i marks candidate i's shared weight-edge children; reach[n] = the marks below n.
    bit: dict[int, int] = {}
    marks: dict[Node, int] = {}
    for bk in multi:
        for b in bk:
            bit[id(b)] = mask = 1 << len(bit)
            for c, _ in b.weight_edges:
                if c in shared:
                    marks[c] = marks.get(c, 0) | mask
    reach: dict[Node, int] = {}
    for node in reversed(g.order):  # children first
        m = marks.get(node, 0)
        for ch in g.children[node]:
            m |= reach[ch]
        reach[node] = m

    groups: list[_Group] = []
    for bk in buckets.values():
        subs: list[tuple[list[_Boundary], int, int]] = []  # members, their bits, what they reach
        for b in bk:
            mine = bit.get(id(b), 0)
            below = 0  # (1) and (2) for b: what its activation children and weight edges reach
            for ch in b.act_children:
                below |= reach.get(ch, 0)
            for c, _ in b.weight_edges:
                for cc in g.children.get(c, ()):
                    below |= reach.get(cc, 0)
            for i, (members, bits, reached) in enumerate(subs):
                if not below & (bits | mine) and not reached & mine:
                    subs[i] = (members + [b], bits | mine, reached | below)
                    break
            else:
                subs.append(([b], mine, below))
        for members, _, _ in subs:
            groups.append(_Group(members, _unique(e for b in members for e in b.weight_edges)))
    return groups


def _foldable(g: _Graph, gr: _Group, root_nodes: set[Node]) -> list[Node] | None:
    """The parameters a group's call can ask for directly, or None (it asks for its edges).

    Folding runs the group's weight region R (the non-parameter nodes below its weight edges) in
    the group's own call instead of the final weight-region call. That is the same computation
    if (a) every parent of a node of R is a member or in R (no other call feeds R, so each node of
    R runs once with its whole incoming gradient, and no other call reaches R), (b) no output
    starts in R (a root seed), and (c) no member's activation children lead to a parameter the
    call asks for (else the engine would run the activation path to it). A parameter below
    several groups (a tied weight) is fine: each call captures only what arrives in that call.
    """
    members = {b.node for b in gr.members}
    region: set[Node] = set()
    found: dict[Node, None] = {}  # the parameters below, in a deterministic order
    stack = []
    for c, _ in gr.edges:
        (found.setdefault(c) if c in g.param_nodes else stack.append(c))
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for ch in g.children[n]:
            (found.setdefault(ch) if ch in g.param_nodes else stack.append(ch))
    if region & root_nodes:
        return None
    fed: dict[Node, int] = {}
    for p in (*members, *region):
        for ch in g.children[p]:
            if ch in region:
                fed[ch] = fed.get(ch, 0) + 1
    if any(fed.get(n, 0) != g.parents.get(n, 0) for n in region):
        return None
    params = set(found)  # a set: isdisjoint then walks the smaller side
    for b in gr.members:
        if any(not params.isdisjoint(g.params_below[ch]) for ch in b.act_children):
            return None
    return list(found)


def _unique(edges: Iterable[tuple[Node, int]]) -> list[tuple[Node, int]]:
    return list(dict.fromkeys(edges))


def _kids(node: Node, input_nodes: set[Node]) -> list[Node]:
    if node in input_nodes:
        return []
    return [ch for ch, _ in node.next_functions if ch is not None]


def _stage0_targets(g: _Graph) -> set[Node]:
    """Where B stops on a stage none of whose inputs requires grad (typically stage 0).

    With no input to reach, "activation" cannot be defined by reachability. A node is taken as
    activation work when it leads to two or more distinct parameters (it mixes several weights'
    paths, e.g. a layer's AddmmBackward reaching W and b, or anything above two layers), or when
    the gradient arriving at it is not shaped like any parameter it leads to (an activation-shaped
    gradient: GeluBackward, EmbeddingBackward, an mm without bias). A transposed weight's
    TBackward (one parameter, weight-shaped) is weight work. B stops at the *lowest* activation
    nodes (none of whose children is activation) and records what arrives there; W runs them.
    Targets must not lie below one another (B would not run the upper one, and the lower would
    miss its contribution), so only the topmost of a chain is kept.

    This is a heuristic on shapes: it changes how work splits between B and W, never the result.
    """
    act: set[Node] = set()
    for node in g.order:
        below = g.params_below.get(node, frozenset())
        if node in g.param_nodes or not below:
            continue
        if len(below) >= 2 or not _param_shaped(node, below):
            act.add(node)
    frontier = {n for n in act if not any(ch in act for ch in g.children[n])}
    under: set[Node] = set()
    for node in g.order:  # parents first: mark everything strictly below a frontier node
        if node in frontier or node in under:
            under.update(g.children[node])
    return {n for n in frontier if n not in under}


def _param_shaped(node: Node, below: frozenset[Node]) -> bool:
    try:
        shapes = [tuple(m.shape) for m in C.node_input_metadata(node)]
    except (AttributeError, RuntimeError):  # no metadata: assume weight work (safe for results)
        return True
    param_shapes = {tuple(sorted(_acc_shape(p))) for p in below}
    return all(tuple(sorted(s)) in param_shapes for s in shapes)


def _acc_shape(acc: Node) -> tuple[int, ...]:
    return tuple(acc.variable.shape)  # type: ignore[attr-defined]  # an AccumulateGrad node


def _num_slots(node: Node) -> int:
    # No fallback: guessing 1 would silently drop the gradients of a multi-output target's other
    # slots.
    return len(C.node_input_metadata(node))
