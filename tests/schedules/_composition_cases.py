"""Per-rank bodies of the composition tests: zbpipe schedules with FSDP2 or TP on a 2-D DeviceMesh.

Module level so spawned processes can import them. Four gloo processes, mesh ``(pp=2, x=2)``::

    ranks  [[0, 1],      pp groups are the columns {0, 2}, {1, 3}: the pipeline
            [2, 3]]      dp / tp groups are the rows    {0, 1}, {2, 3}

Every rank builds the whole model from one seed, keeps an unsharded deep copy as the reference,
then shards / parallelizes its own stages. The reference runs the same global batch through the
whole model in one process, so it is independent of the pipeline, FSDP and TP code under test.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

import zbpipe
from zbpipe import _compat as C
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

CPU = torch.device("cpu")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _my_stages(cls: type, pp_size: int, pp_rank: int) -> list[int]:
    return sorted(s for s, r in cls.stage_index_to_rank(pp_size).items() if r == pp_rank)


def _reference(
    mods: list[nn.Module], ids: torch.Tensor, tgt: torch.Tensor, n_chunks: int
) -> nn.Module:
    """The unpipelined, unsharded model; loss = mean over ``n_chunks`` equal microbatches' mean
    losses.

    With equal microbatches this is the mean over the global batch, which is what
    scale_grads=True (divide by n_microbatches) followed by FSDP's average over dp computes.
    """
    ref = copy.deepcopy(nn.Sequential(*mods))
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(n_chunks), tgt.chunk(n_chunks))]
    (torch.stack(losses).sum() / n_chunks).backward()
    return ref


# ---------------------------------------------------------------------------------------------
# PP x FSDP2


class _Events:
    """What happened on this rank, in order: W passes, REDUCE_GRAD windows, reduce-scatters."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current_reduce: int | None = None


def _instrument(sched: Any, stages: list[PipelineStage], ev: _Events) -> None:
    """Log weight passes, each stage's REDUCE_GRAD window, and every reduce-scatter FSDP issues.

    A weight pass is a W, or a fused BW (the runtime fuses a W that directly follows its B):
    both are logged as ("W", stage, mb).
    """
    for kind in (C.BACKWARD_WEIGHT, C.FULL_BACKWARD):
        run = sched._comp_type_to_function_map[kind]

        def logged(action: Any, ctx: Any, run: Any = run) -> None:
            run(action, ctx)
            ev.log.append(("W", action.stage_index, action.microbatch_index))

        sched.register_custom_function(kind, logged)
    for st in stages:
        reduce = st.perform_reduce_grad

        def logged_reduce(factor: int, st: PipelineStage = st, reduce: Any = reduce) -> None:
            ev.current_reduce = st.stage_index
            ev.log.append(("REDUCE_GRAD", st.stage_index))
            try:
                reduce(factor)
            finally:
                ev.current_reduce = None

        st.perform_reduce_grad = logged_reduce


class _CountCollectives:
    """Log FSDP2's reduce-scatters and count its all-gathers (its default collectives in torch 2.13:
    ``dist.reduce_scatter_single`` and ``dist.all_gather_single``, looked up at call time)."""

    def __init__(self, ev: _Events) -> None:
        self.ev = ev
        self.all_gathers = 0

    def __enter__(self) -> _CountCollectives:
        self.rs, self.ag = dist.reduce_scatter_single, dist.all_gather_single

        def rs(output, input, *args, **kwargs):
            self.ev.log.append(("RS", self.ev.current_reduce, input.numel()))
            return self.rs(output, input, *args, **kwargs)

        def ag(*args, **kwargs):
            self.all_gathers += 1
            return self.ag(*args, **kwargs)

        dist.reduce_scatter_single, dist.all_gather_single = rs, ag
        return self

    def __exit__(self, *exc: object) -> None:
        dist.reduce_scatter_single, dist.all_gather_single = self.rs, self.ag


def _param_groups(root: nn.Module) -> int:
    """FSDP modules under ``root`` that own parameters not owned by a nested FSDP module."""
    n = 0
    for mod in root.modules():
        if not isinstance(mod, FSDPModule):
            continue
        nested = {
            id(p)
            for sub in mod.modules()
            if sub is not mod and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        n += any(id(p) not in nested for p in mod.parameters())
    return n


def _shard_stage(mod: nn.Sequential, dp_mesh: Any, reshard_after_forward: bool) -> nn.Module:
    """torchtitan's recipe: each transformer block, then the stage root (embedding / head)."""
    for layer in mod:
        if isinstance(layer, zbpipe.testing.models.Block):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # The root is not resharded after forward (FSDP2 keeps the root unsharded for backward anyway).
    fully_shard(mod, mesh=dp_mesh, reshard_after_forward=False)
    return mod


def pp_fsdp_case(
    rank: int,
    world: int,
    schedule: str,
    m: int,
    options: dict,
    reshard_after_forward: bool,
    seed: int = 11,
) -> dict[str, Any]:
    """One step of ``schedule`` on pp=2 x dp=2 with FSDP2; compare full grads with the reference.

    Returns what the test checks: gradient mismatches (empty when all match), the worst
    difference, this rank's event log (W, REDUCE_GRAD, RS), the FSDP param groups per stage and
    the all-gather count.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_size, dp_size = mesh["pp"].size(), mesh["dp"].size()
    cls = getattr(zbpipe, schedule)
    num_stages = pp_size * cls.stages_per_rank
    cfg = TinyGPTConfig(tricky=True, blocks_per_stage=2)
    mods = build_stages(cfg, num_stages, seed=seed)
    # Global batch: dp_size halves, each cut into m microbatches of 2 sequences.
    ids, tgt = synthetic_batch(cfg, batch=2 * m * dp_size, step=seed)
    ref = _reference(mods, ids, tgt, m * dp_size)
    my_ids, my_tgt = ids.chunk(dp_size)[dp_rank], tgt.chunk(dp_size)[dp_rank]

    mine = _my_stages(cls, pp_size, pp_rank)
    pp_group = mesh["pp"].get_group()
    stages = [
        PipelineStage(
            _shard_stage(mods[s], mesh["dp"], reshard_after_forward),
            s,
            num_stages,
            CPU,
            group=pp_group,
        )
        for s in mine
    ]
    sched = cls(stages, m, loss_fn=lm_loss, **options)
    ev = _Events()
    _instrument(sched, stages, ev)
    with _CountCollectives(ev) as counts:
        sched.step(
            *((my_ids,) if 0 in mine else ()), target=my_tgt if num_stages - 1 in mine else None
        )

    worst, mismatches = 0.0, []
    for s in mine:
        for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
            if p.grad is None:
                mismatches.append(f"stage {s} {name}: no grad")
                continue
            g = _full(p.grad)  # collective over dp: every rank checks every parameter
            # fp32. The pipeline sums microbatch gradients one by one and gloo averages the two dp
            # halves, where the reference does one backward over the global batch: rounding of a
            # few ulps of gradients below 1 (seen: < 3e-8). rtol=1e-5/atol=1e-6 is torch's fp32
            # default tolerance; a missing or doubled microbatch is off by > 1e-3.
            try:
                torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6)
            except AssertionError as e:
                mismatches.append(f"stage {s} {name}: {str(e).splitlines()[2:4]}")
            worst = max(worst, (g - q.grad).abs().max().item())
    return {
        "split": sched.split,
        "mismatches": mismatches,
        "worst": worst,
        "log": ev.log,
        "mine": mine,
        "m": m,
        "groups": {s: _param_groups(mods[s]) for s in mine},
        "all_gathers": counts.all_gathers,
    }


def fsdp_cases(
    rank: int, world: int, cases: list[tuple[str, int, dict, bool]]
) -> list[dict[str, Any]]:
    """Several ``(schedule, m, options, reshard_after_forward)`` cases in one process group."""
    return [pp_fsdp_case(rank, world, s, m, o, r) for s, m, o, r in cases]


# ---------------------------------------------------------------------------------------------
# PP x TP


def _tensor_parallel_stage(
    mod: nn.Sequential, tp_mesh: Any, dtensor_boundary: bool, first: bool, last: bool
) -> nn.Module:
    """Megatron MLP in every block: ``fc`` column-parallel, ``out`` row-parallel over ``tp_mesh``.

    ``dtensor_boundary``: the stage's output leaves as a Replicate DTensor and the next stage's
    first layer takes a DTensor in, so the pipeline ships DTensor activations and gradients.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    for layer in mod:
        if isinstance(layer, zbpipe.testing.models.Block):
            parallelize_module(layer, tp_mesh, {"fc": ColwiseParallel(), "out": RowwiseParallel()})
    if dtensor_boundary:
        plan = {}
        if not last:
            plan[str(len(mod) - 1)] = PrepareModuleOutput(
                output_layouts=Replicate(),
                desired_output_layouts=Replicate(),
                use_local_output=False,
            )
        if not first:
            plan["0"] = PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=True
            )
        parallelize_module(mod, tp_mesh, plan)
    return mod


def pp_tp_case(
    rank: int,
    world: int,
    schedule: str,
    m: int,
    options: dict,
    dtensor_boundary: bool,
    seed: int = 13,
) -> dict[str, Any]:
    """One step of ``schedule`` on pp=2 x tp=2; compare full grads with the reference."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_rank, pp_size = mesh["pp"].get_local_rank(), mesh["pp"].size()
    cls = getattr(zbpipe, schedule)
    num_stages = pp_size * cls.stages_per_rank
    cfg = TinyGPTConfig(tricky=True, blocks_per_stage=2)
    mods = build_stages(cfg, num_stages, seed=seed)
    # Both tp ranks of a pipeline see the whole batch (TP splits the weights, not the data).
    ids, tgt = synthetic_batch(cfg, batch=2 * m, step=seed)
    ref = _reference(mods, ids, tgt, m)
    mine = _my_stages(cls, pp_size, pp_rank)
    stages = [
        PipelineStage(
            _tensor_parallel_stage(
                mods[s], mesh["tp"], dtensor_boundary, s == 0, s == num_stages - 1
            ),
            s,
            num_stages,
            CPU,
            group=mesh["pp"].get_group(),
            # A stage receiving a DTensor rebuilds it on the mesh named in the shipped metadata.
            get_mesh=lambda names, layout: mesh[names],
        )
        for s in mine
    ]
    received: list[bool] = []  # per forward of a non-first stage: did a DTensor arrive?
    for st in stages:
        if not st.is_first:
            st.submod.register_forward_pre_hook(
                lambda _, args: received.append(isinstance(args[0], DTensor))
            )
    sched = cls(stages, m, loss_fn=lm_loss, **options)
    losses: list = []
    sched.step(
        *((ids,) if 0 in mine else ()),
        target=tgt if num_stages - 1 in mine else None,
        losses=losses,
    )
    worst, n_dtensor = 0.0, 0
    for s in mine:
        for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
            assert p.grad is not None, f"{schedule}: stage {s} {name} has no grad"
            if isinstance(p, DTensor):
                n_dtensor += 1
                # Sharded like its parameter (an optimizer steps shard by shard), not Partial.
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, (
                    f"{schedule} stage {s} {name}: "
                    f"grad placements {getattr(p.grad, 'placements', None)}"
                )
            g = _full(p.grad)
            # fp32; a row-parallel layer sums two partial products (all-reduce) where the reference
            # does one matmul, and microbatches are summed in plan order: a few ulps.
            torch.testing.assert_close(
                g,
                q.grad,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda e, s=s, name=name: f"{schedule} rank {rank} stage {s} {name}: {e}",
            )
            worst = max(worst, (g - q.grad).abs().max().item())
    return {
        "split": sched.split,
        "worst": worst,
        "dtensor_params": n_dtensor,
        "dtensor_inputs": received,
        "mine": mine,
        "losses": [loss.item() for loss in losses],
    }


def tp_cases(
    rank: int, world: int, cases: list[tuple[str, int, dict, bool]]
) -> list[dict[str, Any]]:
    return [pp_tp_case(rank, world, s, m, o, d) for s, m, o, d in cases]


def fsdp_and_tp_cases(
    rank: int, world: int, fsdp: list[tuple[str, int, dict, bool]], tp: list[tuple]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`fsdp_cases`, then :func:`tp_cases`, in one process group (starting 4 ranks is
    the slow part on 2 cores)."""
    return fsdp_cases(rank, world, fsdp), tp_cases(rank, world, tp)
