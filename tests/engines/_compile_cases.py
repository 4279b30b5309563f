"""Per-rank bodies of the compiled-stage tests (module level: spawned processes import them).

The model is the issue's: pre-norm MLP blocks (LayerNorm -> Linear -> GELU -> Linear, plus the
residual), each compiled on its own with ``fullgraph=True`` as torchtitan compiles per block.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import zbpipe
from zbpipe import _compat as C


class MLPBlock(nn.Module):
    """The issue's pre-norm MLP block: LayerNorm -> Linear -> GELU -> Linear, plus residual."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mlp_stages(
    num_stages: int, blocks: int = 2, dim: int = 16, hidden: int = 32, seed: int = 0
) -> list[nn.Sequential]:
    torch.manual_seed(seed)
    return [
        nn.Sequential(*(MLPBlock(dim, hidden) for _ in range(blocks))) for _ in range(num_stages)
    ]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class Checkpointed(nn.Module):
    """A block under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return out


def compile_blocks(
    mod: nn.Sequential, how: str, backend: str, dp_mesh: Any = None
) -> nn.Sequential:
    """Compile every block of ``mod`` (``how``: "in-place" as torchtitan does, "wrapped" with
    ``torch.compile(block)``, "ac-in-place": checkpointed, then compiled in place, torchtitan's
    order; "fsdp-in-place": compiled in place, then each block and ``mod`` under FSDP2 on
    ``dp_mesh``, torchtitan's order; "eager" ("fsdp-eager": then under FSDP2): leave it)."""
    for i, block in enumerate(mod):
        if how in ("in-place", "fsdp-in-place"):
            block.compile(fullgraph=True, backend=backend)
        elif how == "wrapped":
            mod[i] = torch.compile(block, fullgraph=True, backend=backend)
        elif how == "ac-in-place":
            mod[i] = Checkpointed(block)
            mod[i].compile(fullgraph=True, backend=backend)
    if how.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for block in mod:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(mod, mesh=dp_mesh, reshard_after_forward=False)
    return mod


def _count_w_gemms(sched: Any) -> list[int]:
    """Wrap the deferred engine's W to record how many GEMMs each W runs (a fused BW run as B
    then W at once computes its GEMMs in B: it records 0)."""
    engine = sched.seam.engine
    counts: list[int] = []
    run_w = engine.backward_weight

    def counted(key: Any) -> None:
        counts.append(engine._pending[key].num_gemms)
        run_w(key)

    engine.backward_weight = counted
    return counts


def stages_and_reference(
    num_stages: int, m: int
) -> tuple[list[nn.Sequential], torch.Tensor, torch.Tensor, nn.Sequential]:
    """The stage modules, a batch and its targets (4 rows per microbatch), and an eager
    unpipelined copy after the step's backward (microbatch losses averaged, as
    ``scale_grads=True``)."""
    mods = mlp_stages(num_stages)
    torch.manual_seed(100)
    x, tgt = torch.randn(4 * m, 3, 16), torch.randn(4 * m, 3, 16)
    ref = copy.deepcopy(nn.Sequential(*mods))
    losses = [mse(ref(a), b) for a, b in zip(x.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    return mods, x, tgt, ref


def compiled_step_grads(
    rank: int, world: int, schedule: str, how: str, backend: str = "aot_eager", m: int = 4
) -> dict[str, Any]:
    """One ``step()`` of ``schedule`` over compiled blocks against an eager unpipelined reference
    (microbatch losses averaged, as ``scale_grads=True``); then two more steps on zeroed grads
    to count recompiles. Returns the largest difference, W's GEMMs per W, the graphs compiled
    in the first step and after it, and the graph breaks."""
    cls = getattr(zbpipe, schedule)
    num_stages = world * cls.stages_per_rank
    mods, x, tgt, ref = stages_and_reference(num_stages, m)

    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    torch.compiler.reset()
    counters = C.dynamo_counters()
    counters.clear()
    dp_mesh = group = None
    if how.startswith("fsdp"):  # FSDP2 on one rank per stage, as torchtitan's PP-only runs
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
        dp_mesh, group = mesh["dp"], mesh["pp"].get_group()
    stages = [
        PipelineStage(
            compile_blocks(mods[s], how, backend, dp_mesh),
            s,
            num_stages,
            torch.device("cpu"),
            group=group,
        )
        for s in mine
    ]
    # the plan for equal bytes, kept: the W-GEMM counts compare compiled and eager runs of the
    # same plan shape, which a re-plan for each run's measured bytes need not keep
    sched = cls(stages, m, loss_fn=mse, measure_memory=False)
    gemms = _count_w_gemms(sched)
    worst = 0.0
    graphs = []
    for _ in range(3):
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        sched.step(*((x,) if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None)
        graphs.append(counters["stats"]["unique_graphs"])
        for s in mine:
            for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
                assert p.grad is not None, f"{schedule} {how}: stage {s} {name} has no grad"
                grad = p.grad.full_tensor() if C.is_dtensor(p.grad) else p.grad  # FSDP2's
                # fp32; compiled code may fuse and reorder the norms' sums: rounding only.
                torch.testing.assert_close(
                    grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{schedule} {how} {s} {name}"
                )
                worst = max(worst, (grad - q.grad).abs().max().item())
    return {
        "worst": worst,
        "w_gemms": gemms,
        "graphs": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def compiled_cases(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[Any]:
    """Several ``(schedule, how, backend)`` cases in one process group (spawning is slow)."""
    return [compiled_step_grads(rank, world, s, h, b) for s, h, b in cases]


def several(rank: int, world: int, calls: list[tuple[Any, ...]]) -> list[Any]:
    """Several ``(name, *args)`` calls of this module's per-rank bodies in one process group:
    starting ranks and warming up dynamo in each is the slow part of a compiled test."""
    return [globals()[name](rank, world, *args) for name, *args in calls]


class Counted(nn.Module):
    """A block under non-reentrant ``torch.utils.checkpoint`` that counts its forward runs
    (the step's forwards and B's recomputes alike)."""

    def __init__(self, block: nn.Module, calls: list[int]) -> None:
        super().__init__()
        self.block, self.calls = block, calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._run, x, use_reentrant=False)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        return self.block(x)


def checkpointed_v_forwards(rank: int, world: int, split: str, m: int = 4) -> dict[str, Any]:
    """One rank holding a 2-stage V pipeline (ZBV; or torch's ScheduleZBVZeroBubble when
    ``split`` is "torch") of 2 checkpointed MLP blocks per stage: the block forwards one step
    runs (its second: the first also infers shapes), and the largest gradient difference from
    an uncheckpointed unpipelined reference."""
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    mods, x, tgt, ref = stages_and_reference(2, m)
    calls = [0]
    for mod in mods:
        for i, block in enumerate(mod):
            mod[i] = Counted(block, calls)
    stages = [PipelineStage(mods[s], s, 2, torch.device("cpu")) for s in range(2)]
    if split == "torch":
        sched: Any = ScheduleZBVZeroBubble(stages, m, loss_fn=mse)
    else:
        # the plan for equal bytes, kept: the counts above assume its B and W apart, which a
        # re-plan for the measured bytes (checkpointed blocks hold little) need not keep
        sched = zbpipe.ScheduleZBV(stages, m, loss_fn=mse, split=split, measure_memory=False)
    counts = []
    for _ in range(2):
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        calls[0] = 0
        sched.step(x, target=tgt)
        counts.append(calls[0])
    worst = max(
        (p.grad - q.grad).abs().max().item()
        for s in range(2)
        for p, q in zip(mods[s].parameters(), ref[s].parameters())
    )
    return {"forwards": counts[-1], "worst": worst}


def _compiled_stage(mod: nn.Sequential, what: str) -> nn.Sequential:
    if what == "stage":  # the whole stage module, in place
        mod.compile(fullgraph=True, backend="aot_eager")
        return mod
    return compile_blocks(mod, "in-place", "aot_eager")


def profiled_compiled_v(rank: int, world: int, what: str, m: int = 4) -> dict[str, Any]:
    """ZBV over compiled ``what`` ("blocks": each block; "stage": each stage module) with
    ``costs="profile"`` (1 warm-up step, its memory probed,
    then 2 timed steps): returns the bytes per memory unit the re-plan measured (None: the
    memory was not measured), the graphs dynamo compiled after the first step and at the end,
    and the largest gradient difference of the last step from an eager unpipelined reference."""
    from zbpipe.observe.profile import ProfileConfig

    mods = mlp_stages(2 * world)
    torch.manual_seed(100)
    x, tgt = torch.randn(4 * m, 3, 16), torch.randn(4 * m, 3, 16)
    ref = copy.deepcopy(nn.Sequential(*mods))
    losses = [mse(ref(a), b) for a, b in zip(x.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    mine = sorted(s for s, r in zbpipe.ScheduleZBV.stage_index_to_rank(world).items() if r == rank)
    torch.compiler.reset()
    counters = C.dynamo_counters()
    counters.clear()
    stages = [
        PipelineStage(_compiled_stage(mods[s], what), s, 2 * world, torch.device("cpu"))
        for s in mine
    ]
    profile = ProfileConfig(warmup_steps=1, profile_steps=2)
    sched = zbpipe.ScheduleZBV(stages, m, loss_fn=mse, costs="profile", profile=profile)
    graphs = []
    for _ in range(4):
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        sched.step(*((x,) if 0 in mine else ()), target=tgt if 2 * world - 1 in mine else None)
        graphs.append(counters["stats"]["unique_graphs"])
    worst = max(
        (p.grad - q.grad).abs().max().item()
        for s in mine
        for p, q in zip(mods[s].parameters(), ref[s].parameters())
    )
    return {"unit_bytes": sched.memory_unit_bytes, "graphs": graphs, "worst": worst}
