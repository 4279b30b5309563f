"""Per-rank bodies of the every-schedule compiled tests (module level: spawned processes import
them).

Each case builds the issue's pre-norm MLP blocks (tests/engines/_compile_cases.py), compiles
every block of its stages (``how``: in place, or checkpointed then compiled, torchtitan's
order) and runs a zbpipe schedule with its defaults (the first step's memory probe and re-plan
included). Its gradients are compared with two unpipelined references computed here: the same
blocks compiled the same way (a separate deep copy), and eager.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

import zbpipe
from tests.continuous import _continuous_cases as cc
from tests.engines._compile_cases import _count_w_gemms, compile_blocks, mlp_stages, mse
from zbpipe import _compat as C
from zbpipe.integrations.names import SCHEDULE_CLASSES

M = 4  # microbatches per step
SHAPE = (4 * M, 3, 16)  # a step's batch: 4 rows per microbatch


def batch(k: int, m: int = M) -> tuple[torch.Tensor, torch.Tensor]:
    """Step (mini-batch) ``k``'s input and target."""
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def reference_grads(mods: list[nn.Module], how: str, backend: str) -> list[list[torch.Tensor]]:
    """Per stage, the parameters' gradients of one step of the unpipelined model (a deep copy of
    ``mods``, its blocks compiled as ``how`` says; "eager": not compiled), microbatch losses
    averaged as ``scale_grads=True`` does."""
    ref = [compile_blocks(copy.deepcopy(mod), how, backend) for mod in mods]
    model = nn.Sequential(*ref)
    x, tgt = batch(0)
    losses = [mse(model(a), b) for a, b in zip(x.chunk(M), tgt.chunk(M))]
    (torch.stack(losses).sum() / M).backward()
    return [[p.grad.detach().clone() for p in mod.parameters()] for mod in ref]


def _worst(mine: list[int], mods: list[nn.Module], want: list[list[torch.Tensor]]) -> float:
    # fp32; compiled code may fuse and reorder the norms' sums, the split backward adds a
    # microbatch's weight-gradient parts in another order: rounding only (checked at 1e-5 / 1e-6)
    worst = 0.0
    for s in mine:
        for (name, p), q in zip(mods[s].named_parameters(), want[s]):
            assert p.grad is not None, f"stage {s} {name} has no grad"
            torch.testing.assert_close(p.grad, q, rtol=1e-5, atol=1e-6, msg=f"{s} {name}")
            worst = max(worst, (p.grad - q).abs().max().item())
    return worst


def planned_case(
    rank: int, world: int, name: str, how: str, backend: str, options: dict[str, Any]
) -> dict[str, Any]:
    """Two steps of the schedule ``name`` (a key of ``SCHEDULE_CLASSES``) over blocks compiled as
    ``how`` says. Returns the largest gradient difference from the compiled and from the eager
    reference (each step's gradients are checked against both), the graphs compiled in this
    process after each step and the graph breaks so far (dynamo's cache is the process's: a
    case compiles only the graphs no earlier case did), the W GEMMs the steps deferred, the
    bytes per memory unit the default re-plan measured and the plan's name and order."""
    cls = SCHEDULE_CLASSES[name]
    num_stages = world * cls.stages_per_rank
    mods = mlp_stages(num_stages)
    counters = C.dynamo_counters()
    compiled_ref = reference_grads(mods, how, backend)
    eager_ref = reference_grads(mods, "eager", "")
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [
        PipelineStage(compile_blocks(mods[s], how, backend), s, num_stages, torch.device("cpu"))
        for s in mine
    ]
    sched = cls(stages, M, loss_fn=mse, **options)
    gemms = _count_w_gemms(sched) if sched.split == "deferred" else []
    worst_compiled = worst_eager = 0.0
    graphs = []
    x, tgt = batch(0)
    for _ in range(2):  # the first step compiles, probes memory and re-plans; the second does not
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        sched.step(*((x,) if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None)
        graphs.append(counters["stats"]["unique_graphs"])
        worst_compiled = max(worst_compiled, _worst(mine, mods, compiled_ref))
        worst_eager = max(worst_eager, _worst(mine, mods, eager_ref))
    return {
        "worst_compiled": worst_compiled,
        "worst_eager": worst_eager,
        "graphs": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "w_gemms": sum(gemms),
        "unit_bytes": sched.memory_unit_bytes,
        "plan": (sched.plan.name, str(sched.plan.order)),
        "split": sched.split,
    }


N_CONTINUOUS = 3  # mini-batches of a continuous run (then flush)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return cc.make_optimizer("sgd", params)


def continuous_case(rank: int, world: int, mode: str, how: str, backend: str) -> dict[str, Any]:
    """``ScheduleContinuous`` (``mode``) over compiled blocks, N_CONTINUOUS mini-batches then
    flush; returns this rank's parameters and those the compiled and the eager reference
    (:func:`continuous_reference`) give its stage (numpy), the graphs compiled in this process
    after each mini-batch and after the flush, the graph breaks so far, the GEMMs each of its
    W passes ran, and the stage's Linears."""
    mods = mlp_stages(world)
    counters = C.dynamo_counters()
    stage = PipelineStage(
        compile_blocks(mods[rank], how, backend), rank, world, torch.device("cpu")
    )
    sched = zbpipe.ScheduleContinuous([stage], M, loss_fn=mse, mode=mode, optimizer=_sgd)
    gemms = _count_w_gemms(sched)
    graphs = []
    for k in range(N_CONTINUOUS):
        x, tgt = batch(k)
        sched.step(*((x,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
        graphs.append(counters["stats"]["unique_graphs"])
    sched.flush()
    graphs.append(counters["stats"]["unique_graphs"])
    # The references here, where the blocks' graphs are compiled already (numpy: torch tensors
    # would travel back through shared memory the exiting rank tears down).
    refs = {
        ref_how: continuous_reference(world, mode, ref_how, backend) for ref_how in (how, "eager")
    }
    return {
        "params": [p.detach().numpy().copy() for p in mods[rank].parameters()],
        "references": {k: [t.detach().numpy().copy() for t in v[rank]] for k, v in refs.items()},
        "graphs": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "w_gemms": list(gemms),
        "linears": sum(isinstance(m, nn.Linear) for m in mods[rank].modules()),
    }


def continuous_reference(world: int, mode: str, how: str, backend: str) -> list[list[torch.Tensor]]:
    """Per stage, the parameters a continuous run in ``mode`` must end with: its version rule
    replayed on the unpipelined model (tests/continuous/_continuous_cases.reference), the
    blocks compiled as ``how`` says ("eager": not compiled)."""
    mods = [compile_blocks(mod, how, backend) for mod in mlp_stages(world)]
    if mode == "sync":
        rule = lambda s, g: g // M  # noqa: E731
    elif mode == "2bw":
        rule = lambda s, g: max(g // M - 1, 0)  # noqa: E731
    else:
        rule = cc.stash_versions(world, M, N_CONTINUOUS)
    params, _ = cc.reference(
        world, M, N_CONTINUOUS, "sgd", rule, mods=mods, batches=batch, loss_fn=mse
    )
    return [list(ps.values()) for ps in params]


def run_cases(rank: int, world: int, cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Several cases in one process group (starting processes and importing torch is the slow
    part): ``("planned", name, how, backend, options)`` or ``("continuous", mode, how,
    backend)``. The cases share one compile cache, emptied here first: the blocks' code is the
    same in every case, so the first case compiles the graphs and the others reuse them."""
    torch.compiler.reset()
    C.dynamo_counters().clear()
    out = []
    for kind, *args in cases:
        body = planned_case if kind == "planned" else continuous_case
        out.append(body(rank, world, *args))
    return out


def run_groups(
    rank: int, world: int, groups: list[list[tuple[Any, ...]]]
) -> list[list[dict[str, Any]]]:
    """:func:`run_cases` for each group in turn, in one process group: each group starts from an
    empty compile cache as it would in a process of its own (its first case compiles the graphs
    its others reuse; dynamo's recompile limit counts per group), and the ranks start once."""
    return [run_cases(rank, world, cases) for cases in groups]
