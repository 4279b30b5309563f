"""The deferred engine's MoE experts: routed experts whose weight gradients wait for W.

In an MoE block the routed experts carry most of the weight-gradient work (Qwen3-30B-A3B: 8
experts x 3 weights x 2048 x 768 per token, twice attention's), held as 3-D parameters, not
``nn.Linear``\\ s, and multiplied in the model's own code: torchtitan 0.3's ``GroupedExperts``
through ``torch._grouped_mm`` over rows sorted by expert, torchtitan main's grouped linears
through the same op on a transposed weight, a Hugging Face port through ``F.linear`` on one
expert's slice in a loop, a padded model through ``torch.bmm`` or ``torch.einsum``.

zbpipe captures at the operation, not the module: a module that owns 3-D parameters (and whose
children own none: :func:`~zbpipe.engines.expert_matmuls.batched_modules`) is patched as a
Linear is (its class swapped for a subclass, :func:`patch_experts`) whose ``forward`` runs the
module's own ``forward``, whatever it is, inside the mode of
:mod:`zbpipe.engines.expert_matmuls`, during a zbpipe F or B and inside compiled code. That
mode defers every grouped GEMM, ``F.linear``, bmm, matmul or einsum whose weight operand derives
from one of those parameters through casts, transposes and integer selects
(:mod:`zbpipe.engines.derived_ops`); any other use of them gets its gradient in B, as autograd
computes it. No module's source is read or mirrored.

Left alone (their weight gradients come in B, logged): torchtitan ``GroupedExperts`` converted
by its Float8 / MXFP8 converters (they override ``_grouped_mm`` with a quantized grouped GEMM
whose backward is torchao's; the mode would not recognise it anyway, and the census must not
count it in W). Outside a zbpipe F or B (no store in the slot) a patched module runs its own
``forward`` untouched.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat as C
from .compiled_derived import route_compiled_experts
from .expert_matmuls import batched_modules, batched_weights, deferred_matmuls
from .linear_patch import StoreSlot

logger = logging.getLogger(__name__)

__all__ = [
    "StageExperts",
    "expert_modules",
    "patch_experts",
    "patched_experts",
    "unpatch_experts",
]

#: the module torchtitan's ``GroupedExperts`` lives in (read from ``sys.modules``: zbpipe never
#: imports torchtitan itself)
TORCHTITAN_MOE = "torchtitan.models.common.moe"


def _torchtitan_experts_class() -> type | None:
    moe = sys.modules.get(TORCHTITAN_MOE)
    return getattr(moe, "GroupedExperts", None)


def _converted(m: nn.Module, base: type | None) -> bool:
    """A torchtitan ``GroupedExperts`` whose ``_grouped_mm`` seam a converter replaced."""
    return (
        base is not None and isinstance(m, base) and type(m)._grouped_mm is not base._grouped_mm  # type: ignore[attr-defined]
    )


_WARNED: set[str] = set()


def expert_modules(module: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """Expert modules under ``module``: (the ones :func:`patch_experts` patches, whose GEMMs on
    their 3-D weights wait for W; the converted torchtitan ``GroupedExperts`` it leaves alone)."""
    base = _torchtitan_experts_class()
    found = [m for m in module.modules() if "_zbpipe_experts_kind" in m.__dict__]
    seen = {id(m) for m in found}
    found += [m for m in batched_modules(module) if id(m) not in seen]
    patchable = [m for m in found if not _converted(m, base)]
    left = [m for m in found if _converted(m, base)]
    return patchable, left


def patch_experts(module: nn.Module, slot: StoreSlot) -> int:
    """Make every patchable expert module under ``module`` (:func:`expert_modules`) defer its
    weight gradients through ``slot``; log the ones left alone. Returns how many are patched."""
    patchable, left = expert_modules(module)
    for m in patchable:
        if "_zbpipe_experts_kind" not in m.__dict__:
            cls: type = type(m)
            m._zbpipe_experts_unpatched = cls  # type: ignore[assignment]
            m._zbpipe_experts_kind = "ops"  # type: ignore[assignment]
            m.__class__ = _deferred_class(cls)
        m._zbpipe_slot = slot  # type: ignore[assignment]
    for m in left:
        name = type(m).__name__
        if name not in _WARNED:
            _WARNED.add(name)
            logger.warning(
                "zbpipe: %s computes its expert weight gradients in B (a converted grouped "
                "GEMM, whose backward is its converter's): correct, but W has none of them to "
                "fill the bubbles with",
                name,
            )
    return len(patchable)


def _batched_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, the GEMMs on its 3-D weights deferred
    (:mod:`zbpipe.engines.expert_matmuls`) during a zbpipe F or B and inside compiled code."""
    compiling = torch.compiler.is_compiling()
    # Compiled code never reads the slot: the graph must not depend on it (a guard on the store
    # would recompile between zbpipe's passes and everyone else's)
    store = None if compiling else self._zbpipe_slot.store
    if store is None and not compiling:
        return self._zbpipe_experts_unpatched.forward(self, *args, **kwargs)
    with deferred_matmuls(self, store, compiling):
        return self._zbpipe_experts_unpatched.forward(self, *args, **kwargs)


_CLASSES: dict[type, type] = {}


def _deferred_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Deferred{cls.__name__}", (cls,), {"forward": _batched_forward})
    return _CLASSES[cls]


def patched_experts(module: nn.Module) -> list[nn.Module]:
    """The expert modules under ``module`` that :func:`patch_experts` patched."""
    return [m for m in module.modules() if "_zbpipe_experts_kind" in m.__dict__]


def deferred_weight_names(expert: nn.Module) -> list[str]:
    """The names of the parameters whose GEMMs a patched (or patchable) ``expert`` defers."""
    return batched_weights(expert)


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
