"""Weight-gradient capture at the operation: a GEMM whose weight operand derives from a parameter.

An expert weight reaches its GEMM through a few views and casts, written differently by every
model: torchtitan 0.3's ``torch._grouped_mm(x, w.bfloat16().transpose(-2, -1), offs=offs)``,
torchtitan main's grouped linears ``grouped_mm(x, w.transpose(-2, -1), offs)``, a Hugging Face
expert loop's ``F.linear(x, w[e])``, a padded model's ``torch.bmm(x, w)``. zbpipe does not read
the module's code: :mod:`zbpipe.engines.expert_matmuls` watches the ops its forward runs,
records each tensor derived from one of its 3-D parameters (:class:`Derivation`: the steps,
casts, transposes and integer selects, from the parameter to the operand) and replaces the GEMM
that takes such an operand by :class:`_DerivedGemm` (eager; compiled:
:mod:`zbpipe.engines.compiled_derived`), whose backward computes the input gradient in B and
queues the weight's for W.

W computes what autograd's fused backward computes, bit for bit: the operand's gradient by the
same product, then each step undone in reverse order (a transpose back, a cast back, a select
scattered into zeros), then the add into ``.grad`` (:class:`DerivedProduct`). Two shortcuts give
the same bits cheaper: a grouped GEMM whose operand ends in a transpose of its last two dims
computes its product in the parameter's layout (``g^T @ x`` per group, no transpose to undo),
and a product of one selected expert is added into that expert's slice of ``.grad`` rather than
into a zero-padded copy the size of the parameter.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _compat as C
from .accumulate import accumulate, as_param_grad
from .expert_grads import WeightProduct, _add_converted

__all__ = [
    "Derivation",
    "DerivedProduct",
    "derived_gemm",
    "gradient_equations",
    "spec_of",
    "split_equation",
]

#: a step from a parameter towards an operand: ("cast", dtype name), ("t", dim0, dim1) with
#: dims counted from 0, ("select", dim, index)
Step = tuple[Any, ...]


class Derivation:
    """A tensor derived from the parameter ``leaf`` through ``steps``, taken from ``source``:
    the tensor the GEMM's weight edge hangs on, the parameter itself, or for a DTensor
    parameter the local alias its ``to_local()`` returned (eager: autograd carries the gradient
    from it to the DTensor; compiled: the local shard, which AOTAutograd flattens the DTensor
    into). The steps start from the local shape: a DTensor's shard's."""

    __slots__ = ("leaf", "steps", "source")

    def __init__(
        self, leaf: Tensor, steps: tuple[Step, ...] = (), source: Tensor | None = None
    ) -> None:
        self.leaf, self.steps = leaf, steps
        self.source = leaf if source is None else source

    def then(self, step: Step) -> Derivation:
        return Derivation(self.leaf, (*self.steps, step), self.source)


def split_equation(eq: str) -> tuple[str, str, str] | None:
    """``(a, b, out)`` of a two-operand einsum whose gradients are einsums again: explicit
    output, no ellipsis, no index repeated within an operand, every index of each operand found
    in the other one or in the output."""
    m = re.fullmatch(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]*)", eq.replace(" ", ""))
    if m is None:
        return None
    a, b, out = m.groups()
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return None
    if not (set(a) <= set(b) | set(out) and set(b) <= set(a) | set(out)):
        return None
    return a, b, out


def gradient_equations(eq: str, weight_first: bool) -> tuple[str, str]:
    """(the input gradient's equation over ``(grad, weight)``, the weight gradient's over
    ``(x, grad)``) of a two-operand einsum :func:`split_equation` accepts."""
    parts = split_equation(eq)
    if parts is None:
        raise ValueError(f"zbpipe: einsum {eq!r} has no einsum gradients")
    a, b, out = parts
    x_sub, w_sub = (b, a) if weight_first else (a, b)
    return f"{out},{w_sub}->{x_sub}", f"{x_sub},{out}->{w_sub}"


def spec_of(kind: str, steps: tuple[Step, ...], eq: str = "", weight_first: bool = False) -> str:
    """The string the compiled weight-gradient op carries (a custom op takes no tuples)."""
    parts = [kind, eq, str(int(weight_first))]
    parts += [":".join(str(s) for s in step) for step in steps]
    return ";".join(parts)


@functools.cache
def parse_spec(spec: str) -> tuple[str, str, bool, tuple[Step, ...]]:
    kind, eq, first, *raw = spec.split(";")
    steps: list[Step] = []
    for s in raw:
        name, *args = s.split(":")
        steps.append((name, args[0]) if name == "cast" else (name, *map(int, args)))
    return kind, eq, first == "1", tuple(steps)


class DerivedProduct(WeightProduct):
    """The gradient of a parameter reaching a GEMM through ``steps`` (see the module docstring).

    ``kind``: ``grouped`` (``torch._grouped_mm(x, operand, offs=offs)``), ``linear``
    (``F.linear(x, operand)``) or ``einsum`` (``torch.einsum(eq, x, operand)``, or ``(operand,
    x)`` when ``weight_first``)."""

    __slots__ = ("kind", "eq", "weight_first", "steps", "offs")

    def __init__(
        self,
        kind: str,
        steps: tuple[Step, ...],
        offs: Tensor | None = None,
        eq: str = "",
        weight_first: bool = False,
    ) -> None:
        self.kind, self.steps, self.offs = kind, steps, offs
        self.eq, self.weight_first = eq, weight_first

    def _operand_grad(self, x: Tensor, g: Tensor, ndim: int) -> tuple[Tensor, int]:
        """The operand's gradient and how many trailing steps it already undid."""
        steps = self.steps
        if self.kind == "grouped":
            assert self.offs is not None
            if steps and steps[-1] == ("t", ndim - 2, ndim - 1):  # the parameter's layout
                return C.grouped_mm(g.t(), x, self.offs), 1
            return C.grouped_mm(x.t(), g, self.offs), 0
        if self.kind == "linear":
            g2d = g if g.dim() == 2 else g.reshape(-1, g.shape[-1])
            x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            return g2d.t().mm(x2d), 0
        _, eq_w = gradient_equations(self.eq, self.weight_first)
        return torch.einsum(eq_w, x, g), 0

    def _undo(self, weight: Tensor, x: Tensor, g: Tensor, keep_select: bool) -> Tensor:
        """The gradient pulled back through the steps (all but a first select when
        ``keep_select``; never the cast back to the parameter's dtype, which :meth:`grad` and
        :meth:`add` do)."""
        local = C.local_tensor(weight) if C.is_dtensor(weight) else weight
        shapes, dtypes = [tuple(local.shape)], [local.dtype]
        for step in self.steps:  # the shape and dtype before each step
            shape = list(shapes[-1])
            if step[0] == "t":
                shape[step[1]], shape[step[2]] = shape[step[2]], shape[step[1]]
            elif step[0] == "select":
                del shape[step[1]]
            shapes.append(tuple(shape))
            dtypes.append(getattr(torch, step[1]) if step[0] == "cast" else dtypes[-1])
        d, done = self._operand_grad(x, g, len(shapes[-1]))
        for i in range(len(self.steps) - 1 - done, -1, -1):
            step = self.steps[i]
            if step[0] == "t":
                d = d.transpose(step[1], step[2])
            elif step[0] == "cast":
                if i:
                    d = d.to(dtypes[i])
            elif i or not keep_select:
                full = torch.zeros(shapes[i], dtype=d.dtype, device=d.device)
                full.select(step[1], step[2]).copy_(d)
                d = full
        return d

    def compute(self, x: Tensor, g: Tensor) -> Tensor:
        raise NotImplementedError("DerivedProduct needs the weight: grad() or add()")

    def local_grad(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor:
        """The gradient in the weight's dtype, of its local shape (a DTensor's: its shard's)."""
        dw = self._undo(weight, x, g, keep_select=False)
        if dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
        return dw

    def grad(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor:
        return as_param_grad(weight, self.local_grad(weight, x, g))

    def add(self, weight: Tensor, x: Tensor, g: Tensor) -> Tensor | None:
        grad = weight.grad
        sliced = bool(self.steps) and self.steps[0][0] == "select"
        plain = grad is not None and type(grad) is Tensor and not C.is_dtensor(weight)
        if C.has_post_accumulate_grad_hooks(weight) or not plain:
            dw = self.grad(weight, x, g)
            if C.has_post_accumulate_grad_hooks(weight):
                return dw
            accumulate(weight, dw)
            return None
        assert grad is not None
        if sliced:  # one expert: its slice of .grad, not a zero-padded copy
            grad = grad.select(self.steps[0][1], self.steps[0][2])
        dw = self._undo(weight, x, g, keep_select=sliced)
        if dw.dtype == grad.dtype:
            grad.add_(dw)
        elif dw.dim() >= 1:
            _add_converted(grad, dw)
        else:
            grad.add_(dw.to(grad.dtype))
        return None


def _gemm(kind: str, eq: str, weight_first: bool, x: Tensor, w: Tensor, offs: Any) -> Tensor:
    if kind == "grouped":
        return C.grouped_mm(x, w, offs)
    if kind == "linear":
        return F.linear(x, w)
    return torch.einsum(eq, w, x) if weight_first else torch.einsum(eq, x, w)


def _input_grad(kind: str, eq: str, weight_first: bool, g: Tensor, w: Tensor, offs: Any) -> Tensor:
    if kind == "grouped":
        return C.grouped_mm(g, w.transpose(-2, -1), offs)
    if kind == "linear":
        return g.matmul(w)
    eq_x, _ = gradient_equations(eq, weight_first)
    return torch.einsum(eq_x, g, w)


class _DerivedGemm(torch.autograd.Function):
    """The GEMM on ``operand`` (already derived from ``source``, the parameter ``leaf``), its
    weight gradient queued during a zbpipe B."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        source: Tensor,
        operand: Tensor,
        offs: Tensor | None,
        spec: tuple[str, str, bool, tuple[Step, ...]],
        store: Any,
        leaf: Tensor,
    ) -> Tensor:
        kind, eq, first, _ = spec
        ctx.save_for_backward(x, operand, offs)
        # the store and the leaf apart from the saved tensors: non-reentrant checkpointing hands
        # B detached copies from its recompute in place of each saved tensor
        ctx.state = (spec, store, leaf, leaf.grad_fn is None and not C.has_grad_hooks(leaf))
        return _gemm(kind, eq, first, x, operand, offs)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, operand, offs = ctx.saved_tensors
        (kind, eq, first, steps), store, leaf, deferrable = ctx.state
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        if need_x:
            grad_x = _input_grad(kind, eq, first, grad_out, operand, offs)
        if need_w:
            product = DerivedProduct(kind, steps, offs, eq, first)
            if deferrable and store.deferring and not torch.is_grad_enabled():
                store.put(leaf, x, grad_out, product)  # W computes it
            else:  # a fused backward, or create_graph=True: autograd's result (for the
                # source: a DTensor's to_local alias gets its local gradient)
                grad_w = product.local_grad(leaf, x, grad_out)
        return grad_x, grad_w, None, None, None, None, None


def derived_gemm(
    kind: str,
    x: Tensor,
    operand: Tensor,
    how: Derivation,
    offs: Tensor | None,
    store: Any,
    eq: str = "",
    weight_first: bool = False,
) -> Tensor:
    """Eager: the GEMM ``kind`` of ``x`` and ``operand`` (derived from a parameter as ``how``
    says) whose weight gradient waits for W in ``store``, the stage's (compiled:
    :func:`~zbpipe.engines.compiled_derived.compiled_gemm`)."""
    spec_t = (kind, eq, weight_first, how.steps)
    res: Tensor = _DerivedGemm.apply(x, how.source, operand.detach(), offs, spec_t, store, how.leaf)  # type: ignore[no-untyped-call]
    return res
