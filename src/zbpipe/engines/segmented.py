"""A backward that stops at a stage's communication points, so another pass can run while each
point's collective is in flight (the backward half of an overlapped pair).

A *communication point* is a collective inside a stage's forward (an MoE layer's expert
all-to-all, dispatch or combine) whose backward is a collective too. The deferred engine's B is
one ``torch.autograd.backward`` call; a call cannot be paused, so a B that must let the other
half of a pair compute while its collectives are in flight is split into several calls, one per
*segment* between points:

* **The forward cuts the graph at each point.** Where the key's backward will run in segments,
  the point runs its collective outside autograd and hands on a fresh leaf (``y``) that requires
  grad: the segments' graphs are separate. A tensor computed before a point and used after it
  (the residual stream, the router's scores) would join them again; an alias mode
  (a ``TorchFunctionMode``, pushed at the first point, popped at the end of the forward) hands
  every op after a point a detached leaf alias of such a tensor instead, one per tensor and
  segment. The mode, pushed for the whole forward, notes which segment made each tensor that
  comes out of an op. A compiled region runs its ops out of the mode's sight: its output's
  segment is its inputs' (read from its graph node), and a compiled region that takes tensors
  from both sides of a point (which no alias can then separate) is refused with a
  ``RuntimeError``: compile the blocks between the points, not across them.
* **The backward runs the segments last to first.** Each segment is one ordinary
  ``autograd.backward`` from its outputs (the stage's outputs; the inputs of the point above it,
  seeded with that point's backward collective's result; the tensors later segments aliased,
  seeded with their aliases' gradients): parameters accumulate as in any B, the deferred
  engine's Linears queue their weight GEMMs, the leaves at its bottom collect their gradients.
  Between two segments the point's backward collective is started and the generator *yields*:
  the caller runs something else, then resumes it, and it waits for the collective.
* **Checkpointing**: the calls run inside one ``GraphExecGroup``, so a checkpointed region that
  spans several segments is recomputed once, not once per call. A recomputed point runs its
  collective as an ordinary differentiable op (selective checkpointing that saves the
  collective's output does not repeat it).

An op after a point that modifies in place a tensor made before it cannot be cut around: the
forward raises ``RuntimeError`` naming the op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .. import _compat as C
from .fused import valid_outputs


class Pending(Protocol):
    """A collective in flight."""

    def wait(self) -> Tensor:
        """Wait for the collective and return its result."""


class Collective(Protocol):
    """A communication point's collective, forward and backward (:class:`AllToAllSingle`)."""

    def start(self, x: Tensor) -> Pending:
        """Launch the forward's collective on ``x``."""

    def start_backward(self, grad: Tensor) -> Pending:
        """Launch the collective that carries the output's gradient back to the input's."""


class Exchange(torch.autograd.Function):
    """``y = collective(x)`` as an ordinary differentiable op; ``pending``: the collective,
    already started on ``x`` (else it starts here)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, collective: Collective, pending: Pending | None) -> Tensor:
        ctx.collective = collective
        return (pending if pending is not None else collective.start(x)).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.collective.start_backward(grad.contiguous()).wait(), None, None


@dataclass
class _Point:
    sent: Tensor
    """what the point's collective sent (its input in the forward)"""
    got: Tensor
    """the leaf it handed on (the collective's result)"""
    collective: Collective


@dataclass
class SegmentRecord:
    """What one key's forward recorded at its points, for its segmented backward."""

    where: str
    points: list[_Point] = field(default_factory=list)
    #: (id(tensor), segment using it) -> (tensor, its alias, the segment that made it)
    aliases: dict[tuple[int, int], tuple[Tensor, Tensor, int]] = field(default_factory=dict)
    #: the segment of each leaf the record made (a point's output, an alias)
    made_in: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    #: the segment that made each autograd node the alias mode saw come out of an op (a
    #: tensor's segment is its ``grad_fn``'s), and of compiled regions' nodes (derived)
    node_segment: dict[Any, int] = field(default_factory=dict)
    mode: _AliasMode | None = None

    def open(self) -> None:
        """The forward begins: push the alias mode (it notes segments from here on)."""
        self.mode = _AliasMode(self)
        self.mode.__enter__()  # type: ignore[no-untyped-call]

    @property
    def segment(self) -> int:
        """The segment the forward is in now (the number of points it passed)."""
        return len(self.points)

    def segment_of(self, t: Tensor) -> int:
        """The segment that made ``t`` (0: before the first point, or outside the forward)."""
        node = t.grad_fn
        if node is None:  # a leaf: a point's output or an alias, else made outside
            seg = self.made_in.get(t)  # type: ignore[no-untyped-call]
            return 0 if seg is None else int(seg)
        seg = self.node_segment.get(node)
        return seg if seg is not None else self._derived(node)

    def _derived(self, node: Any) -> int:
        """A node the mode did not see (a compiled region's): its inputs' segment."""
        seg = self.node_segment.get(node)
        if seg is not None:
            return seg
        found = []
        for child, _ in node.next_functions:
            if child is None:
                continue
            if hasattr(child, "variable"):  # a leaf: a point's output or an alias, else foreign
                leaf_seg = self.made_in.get(child.variable)  # type: ignore[no-untyped-call]
                if leaf_seg is not None:
                    found.append(int(leaf_seg))
                continue
            found.append(self._derived(child))
        seg = max(found, default=0)
        if found and min(found) != seg:
            raise RuntimeError(
                f"zbpipe: overlapped pair, {self.where}: a compiled region takes tensors from "
                f"before and after communication point {min(found) + 1}, so the backward cannot "
                "be split there; compile the blocks between the points, not across them, or "
                "run this schedule with overlap=False"
            )
        self.node_segment[node] = seg
        return seg

    def cut(
        self, x: Tensor, collective: Collective, meanwhile: Callable[[], None] | None
    ) -> Tensor:
        """A point of this forward: the collective outside autograd, a fresh leaf handed on."""
        with torch.no_grad():
            pending = collective.start(x)
        if meanwhile is not None:
            meanwhile()
        with torch.no_grad():
            y = pending.wait()
        y = y.detach().requires_grad_(x.requires_grad)  # a leaf: never aliased
        self.points.append(_Point(x, y, collective))  # the next segment starts
        self.made_in[y] = self.segment
        return y

    def finish(self) -> None:
        """The forward ended: pop the alias mode."""
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def alias(self, t: Tensor) -> Tensor:
        """``t`` as the current segment sees it: an alias if an earlier segment made it."""
        segment = self.segment
        key = (id(t), segment)
        hit = self.aliases.get(key)
        if hit is None:  # (inside the mode's handler, the mode is off: no recursion)
            alias = t.detach().requires_grad_()
            self.made_in[alias] = segment
            hit = self.aliases[key] = (t, alias, self.segment_of(t))
        return hit[1]

    def crosses(self, t: object) -> bool:
        """Is ``t`` a tensor needing grad that a segment before the current one made?"""
        return (
            self.segment > 0
            and isinstance(t, Tensor)
            and t.requires_grad
            and t.grad_fn is not None
            and self.segment_of(t) < self.segment
        )

    def note(self, result: Any, segment: int) -> None:
        """Mark the autograd nodes of the tensors an op returned as made in ``segment`` (one
        dict entry per node: this runs after every op of the forward)."""
        if isinstance(result, Tensor):
            node = result.grad_fn
            if node is not None:
                self.node_segment.setdefault(node, segment)
        elif isinstance(result, (list, tuple)):
            for r in result:
                self.note(r, segment)


#: op names that write into their first argument (besides the ``name_`` convention)
_IN_PLACE_DUNDERS = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")


class _AliasMode(TorchFunctionMode):
    """After a point: every op gets aliases of the tensors earlier segments made (module doc)."""

    def __init__(self, record: SegmentRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a compiled region is one op to its callers
            return func(*args, **kwargs)
        rec = self.record
        segment = len(rec.points)
        if segment == 0:  # before the first point nothing can cross: note, nothing else
            result = func(*args, **kwargs)
            rec.note(result, 0)
            return result
        name = getattr(func, "__name__", "")
        writes = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
        if (writes and args and rec.crosses(args[0])) or rec.crosses(kwargs.get("out")):
            raise RuntimeError(
                f"zbpipe: overlapped pair, {rec.where}: {name} modifies in place a tensor "
                f"computed before communication point {rec.segment}, so the backward cannot "
                "be split there; compute it out of place, or run this schedule with "
                "overlap=False"
            )
        result = func(*_aliased(rec, args), **{k: _aliased(rec, v) for k, v in kwargs.items()})
        rec.note(result, segment)
        return result


def _aliased(rec: SegmentRecord, value: Any) -> Any:
    if isinstance(value, Tensor):
        return rec.alias(value) if rec.crosses(value) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_aliased(rec, v) for v in value)
    return value


def segmented_backward(
    record: SegmentRecord,
    outputs: Sequence[Any],
    output_grads: Sequence[Tensor | None] | None,
    inputs: Sequence[Any],
) -> Generator[None, None, tuple[Tensor | None, ...]]:
    """The backward of the forward ``record`` cut, one segment per call, last to first; yields
    while each point's backward collective is in flight; returns the gradients of ``inputs``.

    Long because it is the one loop over the segments, with the seeds of each beside it.
    """
    outs, grads = valid_outputs(outputs, output_grads)
    roots: dict[int, list[tuple[Tensor, Tensor]]] = {len(record.points): list(zip(outs, grads))}
    by_segment: dict[int, list[tuple[Tensor, Tensor]]] = {}
    for t, alias, made_in in record.aliases.values():
        by_segment.setdefault(made_in, []).append((t, alias))
    group = C.backward_group()
    with _input_grads(inputs) as result:
        for j in range(len(record.points), -1, -1):
            seeds = roots.pop(j, [])
            seeds += [(t, a.grad) for t, a in by_segment.get(j, []) if a.grad is not None]
            if seeds:
                with group:
                    torch.autograd.backward([t for t, _ in seeds], [g for _, g in seeds])
            if j == 0:
                break
            point = record.points[j - 1]
            got = point.got
            grad = got.grad if got.grad is not None else torch.zeros_like(got)
            pending = point.collective.start_backward(grad.contiguous())
            yield
            grad_x = pending.wait()
            x = point.sent
            if not x.requires_grad:
                continue
            if x.grad_fn is None:  # a leaf (a stage input, an alias): it collects the gradient
                x.grad = grad_x if x.grad is None else x.grad + grad_x
            else:
                roots.setdefault(record.segment_of(x), []).append((x, grad_x))
    return tuple(result)


@contextlib.contextmanager
def _input_grads(inputs: Sequence[Any]) -> Iterator[list[Tensor | None]]:
    """The gradients the stage inputs receive inside the body (``backward_full``'s way: a leaf's
    ``.grad`` read and restored, a non-leaf observed by a hook)."""
    result: list[Tensor | None] = [None] * len(inputs)
    saved: dict[int, Tensor | None] = {}
    handles = []
    for i, x in enumerate(inputs):
        if not (isinstance(x, Tensor) and x.requires_grad):
            continue
        if x.grad_fn is None:
            saved[i], x.grad = x.grad, None
        else:

            def hook(g: Tensor, i: int = i) -> None:
                before = result[i]
                result[i] = g if before is None else before + g

            handles.append(x.register_hook(hook))  # type: ignore[no-untyped-call]
    try:
        yield result
    finally:
        for h in handles:
            h.remove()
        for i, old in saved.items():
            result[i], inputs[i].grad = inputs[i].grad, old
