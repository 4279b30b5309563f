"""Per-rank body of ``test_meter_hand_counted``: the meter's live bytes after every compute action.

ZB-V on 2 ranks, m = 2 (every backward split into B and W), 4 chunks of
``relu(Linear(x) * scale)`` (``scale`` a learnable vector: a weight outside ``nn.Linear``),
MSE loss. Every activation is R x D float32, so each tensor the test counts by hand is one unit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

import zbpipe
from tests.schedules._losses import mse
from zbpipe.memory import SavedActivationMeter

# R != D: stage 0's rule for activation nodes reads shapes (docs/design/backward.md)
D, R, M = 8, 4, 2
UNIT = R * D * 4  # bytes of one activation


class Chunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x) * self.scale)


def live_after_each_action(rank: int, world: int, splits: list[str]) -> list[dict]:
    """Per engine: ``(kind, stage, mb, live bytes)`` after each compute action of a second step
    (the first infers shapes), and the step's ``StepMemory``."""
    return [_one_engine(rank, world, split) for split in splits]


def _one_engine(rank: int, world: int, split: str) -> dict:
    torch.manual_seed(0)
    chunks = [Chunk() for _ in range(2 * world)]
    mine = sorted(s for s, r in zbpipe.ScheduleZBV.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(chunks[s], s, 2 * world, torch.device("cpu")) for s in mine]
    # The plan for equal bytes, kept: the hand count below assumes its shape (every backward
    # split), which a re-plan for the measured bytes need not keep.
    sched = zbpipe.ScheduleZBV(stages, M, loss_fn=mse, split=split, measure_memory=False)
    meter = SavedActivationMeter()
    sched.attach_meter(meter)
    samples: list[tuple[str, int, int, int]] = []
    seam = sched.seam

    def sampled(kind, fn, mb_at=0):  # mb_at: where the microbatch is among the arguments
        def call(stage, *args, **kwargs):
            fn(stage, *args, **kwargs)
            samples.append((kind, stage.stage_index, args[mb_at], meter.live_bytes))

        return call

    seam.hand_forward = sampled("F", seam.hand_forward, mb_at=1)  # (stage, output, mb)
    seam.backward_input = sampled("B", seam.backward_input)
    seam.backward_weight = sampled("W", seam.backward_weight)
    seam.full_backward = sampled("BW", seam.full_backward)
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(R, D, generator=g),) for _ in range(M)]  # one storage per microbatch
    ys = [torch.randn(R, D, generator=g) for _ in range(M)]
    first, last = 0 in mine, 2 * world - 1 in mine
    for _ in range(2):
        samples.clear()
        meter.begin_step()
        sched.step(arg_mbs=xs if first else None, target_mbs=ys if last else None)
    s = meter.end_step()
    return {
        "split": split,
        "samples": list(samples),
        "peak": s.peak_bytes,
        "retained": s.retained_bytes,
        "live": meter.live_bytes,
    }
