"""The deferred engine's MoE experts: routed experts whose weight gradients wait for W.

In an MoE block the routed experts carry most of the weight-gradient work (Qwen3-30B-A3B: 8
experts x 3 weights x 2048 x 768 per token, twice attention's), held as 3-D parameters, not
``nn.Linear``\\ s. torchtitan 0.3's ``GroupedExperts`` computes them with ``torch._grouped_mm``
over the rows sorted by expert (``offs`` cuts them; how many rows each expert gets changes with
every microbatch). This module patches such a module as :mod:`~zbpipe.engines.linear_patch`
patches a Linear: its class is swapped for a subclass (:func:`patch_experts`) whose ``forward``
computes exactly what torchtitan's does, bit for bit, but through :class:`_GroupedLinear`, an
``autograd.Function`` that takes the *parameter* (not its bf16, transposed copy) and whose
backward computes the input gradient in B and, during a zbpipe B, queues ``(x, grad_output,
offs)`` in the stage's :class:`~zbpipe.engines.deferred.WeightGradStore` instead of the weight
gradient (and of its cast back to fp32, which costs more than the GEMM on a CPU). W computes
it in the weight's layout (:class:`~zbpipe.engines.expert_grads.GroupedProduct`).

Inside ``torch.compile``\\ d code the same forward runs
:func:`~zbpipe.engines.compiled_experts.compiled_grouped_linear` instead, whose weight GEMM is
one opaque op routed at run time (no graph break, no recompile when the tokens per expert
change: ``offs`` is a tensor, read by the op when it runs).

Which modules are patched: torchtitan's ``GroupedExperts`` (and subclasses that keep its
``forward`` and its ``_grouped_mm``) whose ``forward`` is the one this module mirrors, checked
by its source at patch time (:data:`MIRRORED_FORWARD`): another torchtitan's would not be
computed the same way, so it is left alone and its weight gradients come in B, logged. A
converted module (torchtitan's Float8 and MXFP8 converters override ``_grouped_mm`` with a
quantized grouped GEMM whose backward is torchao's) is left alone too: its weight gradients
come in B. Outside a zbpipe F or B (no store in the slot) a patched module runs torchtitan's own
``forward``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _compat as C
from .compiled_experts import compiled_grouped_linear, route_compiled_experts
from .expert_grads import GroupedProduct, WeightProduct
from .expert_matmuls import batched_modules, batched_weights, deferred_matmuls
from .linear_patch import StoreSlot

logger = logging.getLogger(__name__)

__all__ = [
    "EXPERT_WEIGHTS",
    "StageExperts",
    "MIRRORED_FORWARD",
    "expert_modules",
    "patch_experts",
    "patched_experts",
    "unpatch_experts",
]

#: the module torchtitan's ``GroupedExperts`` lives in (read from ``sys.modules``: zbpipe never
#: imports torchtitan itself)
TORCHTITAN_MOE = "torchtitan.models.common.moe"
#: the weights of a patched ``GroupedExperts``, in the order its forward uses them
EXPERT_WEIGHTS = ("w1_EFD", "w3_EFD", "w2_EDF")
#: sha256 of the source of the ``GroupedExperts.forward`` that :func:`_deferred_forward`
#: computes the same way (torchtitan 0.3.0's)
MIRRORED_FORWARD = "a59df6e1179ed286317737c74c46ec83a0d70264334516e71bd58242cb356cb9"


class ExpertQueue(Protocol):
    """What a patched expert module asks of the store in its slot."""

    deferring: bool

    def put(self, weight: Tensor, x: Tensor, g: Tensor, dtype: WeightProduct) -> None:
        """Queue ``weight``'s gradient, the product ``dtype`` names, for W."""


def _deferrable(weight: Tensor) -> bool:
    """As for a Linear: a leaf without ``register_hook`` hooks (a computed weight, or one whose
    hooks expect the gradient in B, gets its gradient in B)."""
    return weight.grad_fn is None and not C.has_grad_hooks(weight)


class _GroupedLinear(torch.autograd.Function):
    """``torch._grouped_mm(x, weight.to(dtype).transpose(-2, -1), offs=offs)``, the weight
    gradient queued during a zbpipe B (``leaf``: the parameter W adds into, ``weight`` itself or
    the DTensor whose local shard ``weight`` is)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        offs: Tensor,
        dtype: torch.dtype,
        store: ExpertQueue,
        leaf: Tensor,
    ) -> Tensor:
        cast = weight if weight.dtype == dtype else weight.to(dtype)
        ctx.save_for_backward(x, cast, offs)
        # the store and the leaf apart from the saved tensors: non-reentrant checkpointing hands
        # B detached copies from its recompute in place of each saved tensor
        ctx.state = (store, leaf, _deferrable(leaf), weight.dtype)
        return C.grouped_mm(x, cast.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, cast, offs = ctx.saved_tensors
        store, leaf, deferrable, weight_dtype = ctx.state
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        if need_x:
            grad_x = C.grouped_mm(grad_out, cast, offs)
        if need_w:
            product = GroupedProduct(offs)
            if deferrable and store.deferring and not torch.is_grad_enabled():
                store.put(leaf, x, grad_out, product)  # W computes it
            else:  # a fused backward, or create_graph=True: torch's own result
                grad_w = product.compute(x, grad_out).to(weight_dtype)
        return grad_x, grad_w, None, None, None, None


_apply_grouped = C.autograd_function_apply(_GroupedLinear)


def _deferred_forward(self: Any, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
    """torchtitan 0.3.0's ``GroupedExperts.forward`` (the same ops, in the same order: the
    bits are the same), its three grouped GEMMs through :class:`_GroupedLinear` (eager, during
    a zbpipe F or B) or the compiled op (inside ``torch.compile``, always)."""
    # Compiled code never reads the slot: the graph must not depend on it (a guard on the store
    # would recompile between zbpipe's passes and everyone else's)
    compiling = torch.compiler.is_compiling()
    store = None if compiling else self._zbpipe_slot.store
    if (store is None and not compiling) or _spmd_checking():
        own: Tensor = self._zbpipe_experts_unpatched.forward(self, x, num_tokens_per_expert)
        return own
    leaves = [getattr(self, name) for name in EXPERT_WEIGHTS]
    weights = [C.local_tensor(w) if C.is_dtensor(w) else w for w in leaves]
    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)

    def grouped(rows: Tensor, i: int) -> Tensor:
        if compiling:
            return compiled_grouped_linear(rows, weights[i], offs)
        out: Tensor = _apply_grouped(rows, weights[i], offs, torch.bfloat16, store, leaves[i])
        return out

    # x cast twice, as torchtitan does: the two input gradients then add in fp32, after their
    # casts back (one cast would add them in bf16 and round differently)
    h = F.silu(grouped(x.bfloat16(), 0))
    h = h * grouped(x.bfloat16(), 1)
    return grouped(h, 2).type_as(x)


def _spmd_checking() -> bool:
    """torchtitan's SPMD type checking is on (its forward then retypes the offsets: run it)."""
    moe = sys.modules.get(TORCHTITAN_MOE)
    if moe is None or moe.get_spmd_backend() != "spmd_types":
        return False
    return bool(moe.spmd.is_type_checking())


def _source_hash(fn: Any) -> str:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return ""


def _torchtitan_experts_class() -> type | None:
    moe = sys.modules.get(TORCHTITAN_MOE)
    return getattr(moe, "GroupedExperts", None)


_CHECKED: dict[Any, bool] = {}
_WARNED: set[str] = set()


def _mirrors(base: type) -> bool:
    """Whether ``base.forward`` is the forward :func:`_deferred_forward` mirrors (cached)."""
    fn = base.forward  # type: ignore[attr-defined]
    if fn not in _CHECKED:
        _CHECKED[fn] = _source_hash(fn) == MIRRORED_FORWARD
    return _CHECKED[fn]


def expert_modules(module: nn.Module) -> tuple[list[nn.Module], list[nn.Module], list[nn.Module]]:
    """Expert modules under ``module``: (torchtitan ``GroupedExperts`` :func:`patch_experts`
    patches, modules whose own 3-D weights it defers in their matmuls and einsums
    (:func:`~zbpipe.engines.expert_matmuls.batched_modules`), torchtitan ``GroupedExperts`` it
    leaves alone: converted, or another forward than the mirrored one)."""
    base = _torchtitan_experts_class()
    grouped: list[nn.Module] = []
    batched: list[nn.Module] = []
    left: list[nn.Module] = []
    for m in module.modules():
        kind = m.__dict__.get("_zbpipe_experts_kind")
        if kind is not None:
            (grouped if kind == "grouped" else batched).append(m)
        elif base is not None and isinstance(m, base):
            cls = type(m)
            same = cls.forward is base.forward and cls._grouped_mm is base._grouped_mm  # type: ignore[attr-defined]
            (grouped if same and _mirrors(base) else left).append(m)
    seen = {id(m) for m in grouped + batched + left}
    batched += [m for m in batched_modules(module) if id(m) not in seen]
    return grouped, batched, left


def patch_experts(module: nn.Module, slot: StoreSlot) -> int:
    """Make every patchable expert module under ``module`` (:func:`expert_modules`) defer its
    weight gradients through ``slot``; log the ones left alone. Returns how many are patched."""
    grouped, batched, left = expert_modules(module)
    for kind, found in (("grouped", grouped), ("batched", batched)):
        for m in found:
            if "_zbpipe_experts_kind" not in m.__dict__:
                cls: type = type(m)
                m._zbpipe_experts_unpatched = cls  # type: ignore[assignment]
                m._zbpipe_experts_kind = kind  # type: ignore[assignment]
                m.__class__ = _deferred_class(cls, kind)
            m._zbpipe_slot = slot  # type: ignore[assignment]
    for m in left:
        name = type(m).__name__
        if name not in _WARNED:
            _WARNED.add(name)
            logger.warning(
                "zbpipe: %s computes its expert weight gradients in B (a converted grouped GEMM, "
                "or a forward other than torchtitan 0.3.0's, which zbpipe mirrors): correct, "
                "but W has none of them to fill the bubbles with",
                name,
            )
    return len(grouped) + len(batched)


def _batched_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, its 3-D weights' matmuls and einsums deferred
    (:mod:`zbpipe.engines.expert_matmuls`) during a zbpipe F or B and inside compiled code."""
    compiling = torch.compiler.is_compiling()
    store = None if compiling else self._zbpipe_slot.store  # (as in _deferred_forward)
    if store is None and not compiling:
        return self._zbpipe_experts_unpatched.forward(self, *args, **kwargs)
    with deferred_matmuls(self, store, compiling):
        return self._zbpipe_experts_unpatched.forward(self, *args, **kwargs)


_CLASSES: dict[tuple[type, str], type] = {}


def _deferred_class(cls: type, kind: str) -> type:
    if (cls, kind) not in _CLASSES:
        forward = _deferred_forward if kind == "grouped" else _batched_forward
        _CLASSES[cls, kind] = type(f"Deferred{cls.__name__}", (cls,), {"forward": forward})
    return _CLASSES[cls, kind]


def patched_experts(module: nn.Module) -> list[nn.Module]:
    """The expert modules under ``module`` that :func:`patch_experts` patched."""
    return [m for m in module.modules() if "_zbpipe_experts_kind" in m.__dict__]


def deferred_weight_names(expert: nn.Module) -> list[str]:
    """The names of the parameters whose gradients a patched (or patchable) ``expert`` defers."""
    return list(EXPERT_WEIGHTS) if _is_grouped(expert) else batched_weights(expert)


def _is_grouped(expert: nn.Module) -> bool:
    kind = expert.__dict__.get("_zbpipe_experts_kind")
    if kind is not None:
        return bool(kind == "grouped")
    base = _torchtitan_experts_class()
    return base is not None and isinstance(expert, base)


def expert_weights(experts: list[nn.Module]) -> list[Tensor]:
    """The parameters whose gradients the patched ``experts`` defer."""
    return [
        p
        for m in experts
        for name in deferred_weight_names(m)
        if (p := C.own_parameter(m, name)) is not None
    ]


def unpatch_experts(module: nn.Module) -> int:
    """Give every expert module :func:`patch_experts` patched under ``module`` its class back."""
    n = 0
    for m in patched_experts(module):
        m.__class__ = m.__dict__.pop("_zbpipe_experts_unpatched")
        m.__dict__.pop("_zbpipe_experts_kind")
        m.__dict__.pop("_zbpipe_slot", None)
        n += 1
    return n


class StageExperts:
    """The patched expert modules of one engine's stages: what the deferred engine does with
    them besides what it does with its Linears (patched at attach, routed at the first step when
    compiled, re-pointed at the engine's slots every step, their post-accumulate hooks parked
    around B)."""

    def __init__(self) -> None:
        self._experts: dict[int, list[nn.Module]] = {}

    def attach(self, stage_index: int, submod: nn.Module, slot: StoreSlot) -> int:
        n = patch_experts(submod, slot)
        self._experts[stage_index] = patched_experts(submod)
        return n

    def route_compiled(self, stage_index: int, submod: nn.Module) -> list[Any]:
        experts = self._experts.get(stage_index, [])
        return route_compiled_experts(submod, experts, deferred_weight_names)

    def claim(self, slots: dict[int, StoreSlot]) -> None:
        for idx, experts in self._experts.items():
            for m in experts:
                m._zbpipe_slot = slots[idx]  # type: ignore[assignment]

    def parked(self, stage_index: int) -> AbstractContextManager[frozenset[int]]:
        """Around B: the experts' weights' post-accumulate hooks held back until W (as for the
        Linears: ``linear_patch.post_accumulate_hooks_parked``)."""
        return hooks_parked(expert_weights(self._experts.get(stage_index, [])))


@contextlib.contextmanager
def hooks_parked(weights: list[Tensor]) -> Iterator[frozenset[int]]:
    """Empty the post-accumulate hook dicts of ``weights`` for the block, then restore them;
    yields the ids of the weights that had some (their W must fire them)."""
    parked, ids = [], set()
    for w in weights:
        hooks = C.post_accumulate_grad_hooks(w)
        if hooks:  # the dict autograd's C++ hook reads at call time: emptied in place
            parked.append((hooks, dict(hooks)))
            ids.add(id(w))
            hooks.clear()
    try:
        yield frozenset(ids)
    finally:
        for hooks, saved in parked:
            hooks.update(saved)
