"""Per-rank bodies for tests/continuous/test_continuous_varlen.py: ScheduleContinuous(mode="sync",
variable_shapes=True) on microbatches of drawn lengths, against a plain synchronous loop over the
unpipelined model (tests/schedules/_varlen_cases.py's layers) run in the rank itself: the
gradient of every mini-batch (recorded by the optimizer when it steps) and the parameters after
the last step. Also the same stream over blocks compiled in place (aot_eager), against the same
eager loop, with dynamo's graph count after every call."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from tests.schedules._varlen_cases import (
    BLOCKS,
    Block,
    Truncate,
    chunks,
    data,
    layers,
    square_loss,
    token_loss,
)
from tests.schedules._varlen_compiled_cases import MarkedEmbed
from zbpipe import _compat as C
from zbpipe.continuous import ScheduleContinuous

LR, MOMENTUM = 0.05, 0.9


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of each gradient it steps with: the gradients the schedule
    computed for each mini-batch, compared after the run."""

    def __init__(self, params, record: list) -> None:
        super().__init__(params, lr=LR, momentum=MOMENTUM)
        self.record = record

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        self.record.append([None if p.grad is None else p.grad.clone() for p in params])
        return super().step(closure)


def reference(mods: list[nn.Module], draws: list[list[int]]) -> tuple[list[list], list]:
    """A plain loop on the whole model: per mini-batch, every microbatch's token-summed loss
    divided by the mini-batch's token count, one backward, one SGD step. Returns each
    mini-batch's gradients and the final parameters."""
    ref = nn.Sequential(*copy.deepcopy(mods))
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    grads = []
    for k, lengths in enumerate(draws):
        ids, targets = data(lengths, seed=k)
        total = sum(t.numel() for t in targets)
        opt.zero_grad(set_to_none=True)
        loss = sum(token_loss(ref(x), t, total) for x, t in zip(ids, targets, strict=True))
        loss.backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in ref.parameters()]


def _stages(
    rank: int, world: int, mods: list[nn.Module], compiled: bool = False
) -> tuple[PipelineStage, list[int]]:
    """This rank's stage of ``mods``; ``compiled``: each block compiled in place (aot_eager,
    torchtitan's way) and the embedding's output length marked dynamic, as in
    tests/schedules/_varlen_compiled_cases.py."""
    parts = chunks(mods, world)
    if not compiled:
        mod = nn.Sequential(*(mods[i] for i in parts[rank]))
    else:
        mod = nn.Sequential(*(MarkedEmbed(mods[i]) if i == 0 else mods[i] for i in parts[rank]))
        for block in mod:
            if isinstance(block, Block):
                block.compile(backend="aot_eager", fullgraph=True)
    return PipelineStage(mod, rank, world, torch.device("cpu")), parts[rank]


def run_stream(
    rank: int, world: int, split: str, draws: list[list[int]], graphs: list | None = None
) -> float:
    """A mini-batch per draw, flushed after the second (a new stream then starts) and at the
    end; the largest difference to the reference. Also checks the header count: one per
    mini-batch per rank boundary, none per transfer. ``graphs`` (a list): the blocks are
    compiled, and dynamo's graph count is appended after every ``step()`` and ``flush()``."""
    mods = layers(seed=0)
    expected_grads, expected_params = reference(mods, draws)  # eager: before any compile
    if graphs is not None:
        torch.compiler.reset()
        counters = C.dynamo_counters()
        counters.clear()
    stage, mine = _stages(rank, world, mods, compiled=graphs is not None)
    record: list = []
    m = len(draws[0])
    sched = ScheduleContinuous(
        [stage],
        m,
        loss_fn=token_loss,
        scale_grads=False,
        optimizer=lambda ps: RecordingSGD(ps, record),
        split=split,
        variable_shapes=True,
    )
    first, last = rank == 0, rank == world - 1
    for k, lengths in enumerate(draws):
        ids, targets = data(lengths, seed=k)
        sched.step(
            arg_mbs=[(x,) for x in ids] if first else None,
            target_mbs=targets if last else None,
            loss_kwargs={"num_tokens": sum(t.numel() for t in targets)},
        )
        if graphs is not None:
            graphs.append(counters["stats"]["unique_graphs"])
        if k == 1:
            sched.flush()
    sched.flush()
    if graphs is not None:
        graphs.append(counters["stats"]["unique_graphs"])
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    shapes = sched._shapes
    assert shapes.headers_sent == (0 if last else len(draws)), shapes.headers_sent
    assert shapes.headers_received == (0 if first else len(draws)), shapes.headers_received
    # this rank's parameters, in the order of the whole model's (its layers are a slice of it)
    offsets = [0]
    for mod in mods:
        offsets.append(offsets[-1] + len(list(mod.parameters())))
    owned = [j for i in mine for j in range(offsets[i], offsets[i + 1])]
    assert len(record) == len(draws), (len(record), len(draws))
    worst = 0.0
    what = f"rank {rank}/{world} {split}"
    for k, got in enumerate(record):
        for j, g in zip(owned, got, strict=True):
            e = expected_grads[k][j]
            assert g is not None, f"{what}: mini-batch {k} param {j} got no gradient"
            # fp32: microbatches summed in another order than the reference's one backward
            torch.testing.assert_close(
                g, e, rtol=1e-4, atol=1e-6, msg=lambda s, k=k, j=j: f"{what} mb {k} p {j}: {s}"
            )
            worst = max(worst, (g - e).abs().max().item())
    for j, p in zip(owned, stage.submod.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), expected_params[j], rtol=1e-4, atol=1e-5)
        worst = max(worst, (p.detach() - expected_params[j]).abs().max().item())
    return worst


def data_dependent(rank: int, world: int) -> str:
    """Stage 0 truncates its output by a value it reads: every rank's first step raises before
    any activation is sent."""
    mods = layers(seed=0)
    stage, _ = _stages(rank, world, mods)
    if rank == 0:
        stage.submod.append(Truncate())
    sched = ScheduleContinuous(
        [stage],
        4,
        loss_fn=square_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        variable_shapes=True,
    )
    ids, targets = data([7, 29, 13, 50], seed=0)
    try:
        sched.step(
            arg_mbs=[(x,) for x in ids] if rank == 0 else None,
            target_mbs=targets if rank == world - 1 else None,
        )
    except ValueError as e:
        return str(e)
    return ""


def compiled_stream(rank: int, world: int, draws: list[list[int]]) -> dict:
    """The stream over compiled blocks (deferred engine: the graph engine refuses compiled
    blocks), from an empty compile cache: its largest difference to the eager loop, dynamo's
    graph count after every call, and how many blocks this rank compiled."""
    graphs: list[int] = []
    worst = run_stream(rank, world, "deferred", draws, graphs=graphs)
    blocks = sum(1 <= i <= BLOCKS for i in chunks([], world)[rank])  # layers 1..BLOCKS
    return {"worst": worst, "graphs": graphs, "blocks": blocks}


def all_cases(
    rank: int,
    world: int,
    splits: list[str],
    draws: list[list[int]],
    compiled_draws: list[list[int]] | None = None,
) -> dict:
    """Everything one launch checks: the error first (the group must still work after it), then a
    stream per engine, then (``compiled_draws``) the stream over compiled blocks."""
    out: dict = {"error": data_dependent(rank, world) if world == 2 else None}
    out["worst"] = [run_stream(rank, world, split, draws) for split in splits]
    if compiled_draws is not None:
        out["compiled"] = compiled_stream(rank, world, compiled_draws)
    return out
