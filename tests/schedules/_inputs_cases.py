"""Per-rank bodies for tests/schedules/test_inputs.py: a first stage that takes a dict or
TensorDict batch."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import zbpipe

VOCAB, HIDDEN, OUT = 16, 8, 4


class DictEmbed(nn.Module):
    """Stage 0: reads ids, a per-row scale and a nested per-row bias from one structured batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, batch) -> torch.Tensor:
        h = self.lin(self.emb(batch["ids"])) * batch["scale"].unsqueeze(-1)
        return torch.tanh(h + batch["extra"]["bias"])


class Mid(nn.Module):
    def __init__(self, out: int = HIDDEN) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def build(num_stages: int, seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [DictEmbed()] + [Mid() for _ in range(num_stages - 2)] + [Mid(OUT)]


def make_batch(kind: str, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows,), generator=g)
    scale = torch.rand(rows, generator=g) + 0.5
    bias = torch.randn(rows, HIDDEN, generator=g)
    target = torch.randn(rows, OUT, generator=g)
    plain = {"ids": ids, "scale": scale, "extra": {"bias": bias}}
    if kind == "dict":
        return plain, target
    from tensordict import TensorDict

    return TensorDict(plain, batch_size=[rows]), target


def one_case(rank: int, world: int, schedule: str, kind: str, m: int, seed: int) -> float:
    """One step of ``schedule`` with a ``kind`` batch.

    Its grads must equal the unpipelined reference's.
    """
    cls = getattr(zbpipe, schedule)
    num_stages = world * cls.stages_per_rank
    mods = build(num_stages, seed)
    batch, target = make_batch(kind, 2 * m, seed)

    # Reference: the whole model, microbatches cut by hand, loss averaged like scale_grads=True.
    ref = copy.deepcopy(mods)
    rows = torch.arange(2 * m).chunk(m)
    losses = []
    for idx in rows:
        mb = {
            "ids": batch["ids"][idx],
            "scale": batch["scale"][idx],
            "extra": {"bias": batch["extra"]["bias"][idx]},
        }
        x = mb
        for mod in ref:
            x = mod(x)
        losses.append(F.mse_loss(x, target[idx]))
    (torch.stack(losses).sum() / m).backward()

    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = cls(stages, m, loss_fn=F.mse_loss)
    got: list = []
    sched.step(
        *((batch,) if 0 in mine else ()),
        target=target if num_stages - 1 in mine else None,
        losses=got,
    )
    worst = 0.0
    for s in mine:
        for (name, p), q in zip(mods[s].named_parameters(), ref[s].parameters()):
            assert p.grad is not None, f"{schedule}/{kind}: stage {s} {name} has no grad"
            # fp32, same ops: only the order of summing microbatches differs.
            torch.testing.assert_close(
                p.grad,
                q.grad,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda e, s=s, name=name: f"{schedule}/{kind} stage {s} {name}: {e}",
            )
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    if num_stages - 1 in mine:
        torch.testing.assert_close(
            torch.stack(got), torch.stack([loss.detach() for loss in losses])
        )
    return worst


def cases(rank: int, world: int, todo: list[tuple[str, str, int]]) -> list[float]:
    """Several cases in one process group (spawning is the slow part)."""
    return [
        one_case(rank, world, sched, kind, m, seed=i) for i, (sched, kind, m) in enumerate(todo)
    ]
