"""What W carries on a stage, per engine: the weight census behind ``split="auto"`` and its log.

Every parameter that requires a gradient is put in one class (:func:`census`), and each engine
defers some classes to W and leaves the rest in B:

* **deferred**: patchable ``nn.Linear`` weights (and biases: their sums ride in B, cheap) and
  the 3-D weights of patchable MoE experts (torchtitan's ``GroupedExperts``; a module's own 3-D
  weights in its ``bmm`` / ``einsum``: :mod:`zbpipe.engines.expert_patch`) go to W. In B stay:
  norms and other 1-D weights, embeddings (a scatter of rows), Linears that override
  ``forward`` (torchtitan's Float8 / MXFP8 Linears), converted experts (Float8 / MXFP8
  ``GroupedExperts``), expert weights that are DTensors (expert parallelism) inside compiled
  code (dynamo does not show the mode their ``to_local()``: :mod:`zbpipe.engines.expert_matmuls`),
  convolutions and any other weight.
* **graph**: every weight goes to W; it refuses compiled regions (a stage holding one cannot
  use it), and selective activation checkpointing only on a torch whose recompute its W cannot
  replay (2.11; :func:`zbpipe._compat.checkpoint_recompute_replayable`).

Shares are given in weight elements and in estimated weight-gradient FLOPs per token: a
Linear's or any matrix's ``2 x elements``, an expert weight's ``2 x elements x k / E`` (each token
visits ``k`` of ``E`` experts: ``k`` read from the module's token dispatcher or router where the
model has one, else 1), a 1-D weight's ``elements`` (an elementwise product and a sum), an
embedding's none (rows added, no multiply).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .. import _compat as C
from .expert_patch import deferred_weight_names, expert_modules
from .linear_patch import _linears as linear_modules

__all__ = ["EngineShare", "WeightClass", "census", "engine_shares", "describe"]


@dataclass(frozen=True, kw_only=True)
class WeightClass:
    """Parameters of one kind on a stage."""

    kind: str
    """"linear", "experts", "embedding", "vector" (1-D), "converted experts", "compiled EP
    experts", "other\""""
    elements: int
    flops_per_token: float
    n_modules: int
    """modules of this kind (Linears, expert modules); 0 where it does not apply"""
    in_w: tuple[str, ...]
    """the engines that compute these gradients in W"""


@dataclass(frozen=True, kw_only=True)
class EngineShare:
    """What one engine leaves to W on a set of stages."""

    engine: str
    elements: float
    """share of weight elements whose gradient W computes (0 to 1)"""
    flops: float
    """share of estimated weight-gradient FLOPs W computes (0 to 1)"""
    refused: bool = False
    """the engine refuses these stages (the graph engine, on compiled ones, and on selectively
    checkpointed ones where torch's recompute cannot be replayed: 2.11)"""


def _top_k(expert: nn.Module, parents: dict[int, nn.Module]) -> tuple[int, int]:
    """(k, E): how many experts a token visits, and how many there are."""
    n_experts = int(getattr(expert, "num_experts", 0)) or 1
    parent = parents.get(id(expert))
    for holder in (parent, getattr(parent, "token_dispatcher", None)):
        k = getattr(holder, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k, n_experts
    return 1, n_experts


def _expert_classes(module: nn.Module) -> tuple[dict[int, tuple[str, float]], int, int]:
    """{id(parameter): (kind, flops per token)} of the experts' weights; (patchable, left)."""
    patchable, left = expert_modules(module)
    parents = {id(c): m for m in module.modules() for c in m.children()}
    compiled = {id(e) for m in module.modules() if C.is_compiled(m) for e in m.modules()}
    found: dict[int, tuple[str, float]] = {}
    for kind, mods in (("experts", patchable), ("converted experts", left)):
        for m in mods:
            k, n = _top_k(m, parents)
            for name in deferred_weight_names(m):
                p = C.own_parameter(m, name)
                if p is None:
                    continue
                mine = kind
                if kind == "experts" and id(m) in compiled and C.is_dtensor(p):
                    mine = "compiled EP experts"  # its gradient comes in B
                found[id(p)] = (mine, 2.0 * p.numel() * k / n)
    return found, len(patchable), len(left)


def census(module: nn.Module) -> list[WeightClass]:
    """The stage's parameters that require a gradient, by class (see the module docstring).
    Counts what the deferred engine *would* patch, whether or not it has yet."""
    linear_mods = linear_modules(module)  # patched or patchable: the rule patch_linears applies
    linear = {id(p) for lin in linear_mods for p in lin.parameters()}
    experts, n_experts, n_left = _expert_classes(module)
    embedding = {
        id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    sums: dict[str, list[float]] = {}
    for p in module.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        if id(p) in experts:
            kind, flops = experts[id(p)]
        elif id(p) in linear:
            kind, flops = "linear", 2.0 * n if p.dim() >= 2 else float(n)
        elif id(p) in embedding:
            kind, flops = "embedding", 0.0
        elif p.dim() <= 1:
            kind, flops = "vector", float(n)
        else:
            kind, flops = "other", 2.0 * n
        acc = sums.setdefault(kind, [0, 0.0])
        acc[0] += n
        acc[1] += flops
    counts = {"linear": len(linear_mods), "experts": n_experts, "converted experts": n_left}
    deferred_kinds = ("linear", "experts")
    return [
        WeightClass(
            kind=kind,
            elements=int(e),
            flops_per_token=f,
            n_modules=counts.get(kind, 0),
            in_w=("deferred", "graph") if kind in deferred_kinds else ("graph",),
        )
        for kind, (e, f) in sums.items()
    ]


def engine_shares(stages: list[Any]) -> dict[str, EngineShare]:
    """Each engine's share of the weight work of ``stages`` (their ``submod``\\ s together)."""
    classes = [c for st in stages for c in census(st.submod)]
    # the graph engine refuses compiled regions, and selective checkpointing where its W cannot
    # replay B's recompute (GraphEngine.check_stages)
    sac_refused = not C.checkpoint_recompute_replayable()
    compiled = any(
        C.compiled_submodule(st.submod) is not None
        or (sac_refused and C.selective_checkpoint_submodule(st.submod) is not None)
        for st in stages
    )
    total_e = sum(c.elements for c in classes) or 1
    total_f = sum(c.flops_per_token for c in classes) or 1.0
    out = {}
    for engine in ("deferred", "graph"):
        mine = [c for c in classes if engine in c.in_w]
        out[engine] = EngineShare(
            engine=engine,
            elements=sum(c.elements for c in mine) / total_e,
            flops=sum(c.flops_per_token for c in mine) / total_f,
            refused=engine == "graph" and compiled,
        )
    return out


def describe(stage_index: Any, classes: list[WeightClass], shares: dict[str, EngineShare]) -> str:
    """One log line: what W carries on the stage under each engine, and what stays in B."""
    parts = []
    for s in shares.values():
        if s.refused:
            parts.append(
                f"nothing under the {s.engine} engine (it refuses compiled stages, and "
                "selectively checkpointed ones on this torch)"
            )
            continue
        what = ""
        if s.engine == "deferred":
            kinds = [
                f"{c.n_modules} {'Linears' if c.kind == 'linear' else 'expert modules'}"
                for c in sorted(classes, key=lambda c: c.kind != "linear")
                if c.n_modules and c.kind in ("linear", "experts")
            ]
            what = f" [{', '.join(kinds)}]" if kinds else ""
        parts.append(
            f"{s.elements:.2%} of weight elements ({s.flops:.2%} of est. weight-gradient FLOPs) "
            f"under the {s.engine} engine{what}"
        )
    in_b = [
        f"{_NAMES.get(c.kind, c.kind)} ({c.elements} elements)"
        for c in classes
        if "deferred" not in c.in_w and c.elements
    ]
    return (
        f"stage {stage_index}: W would carry "
        + ", ".join(parts)
        + "; in B under the deferred engine: "
        + (", ".join(in_b) or "nothing")
    )


_NAMES = {
    "vector": "1-D weights (norms, biases)",
    "embedding": "embeddings",
    "converted experts": "converted experts",
    "compiled EP experts": "DTensor (expert-parallel) experts in compiled code",
    "other": "other weights (convolutions, Linears with their own forward...)",
}
