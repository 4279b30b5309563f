"""Per-rank bodies for tests/schedules/test_varlen.py: microbatches of different sequence lengths
through a tiny GPT-like model of our own (token and position embeddings, causal attention
blocks, a vocabulary head), so every activation's shape follows its microbatch's length."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from zbpipe.schedules import classes

VOCAB, DIM, HEADS, MAX_LEN, BLOCKS = 32, 16, 2, 64, 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP: the attention mixes positions, so a wrong length
    anywhere changes every gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class Truncate(nn.Module):
    """A stage whose output length depends on its input's values, not its shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = int(x.detach().abs().sum().item() * 1000) % x.shape[1] + 1
        return x[:, :keep]


def layers(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Embed(), *(Block() for _ in range(BLOCKS)), Head()]


def chunks(mods: list[nn.Module], num_stages: int) -> list[list[int]]:
    """Which layers each stage holds: the embedding with the first block, the head with the last."""
    if num_stages == 2:
        return [[0, 1, 2], [3, 4, 5]]
    return [[0, 1], [2], [3], [4, 5]]


def token_loss(logits: torch.Tensor, target: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Cross-entropy summed over a microbatch's tokens, divided by the step's token count: the
    microbatches' losses add up to the mean over every token of the step (docs/use/varlen.md)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / num_tokens


def mean_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def square_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that takes outputs of any length (the truncating model's)."""
    return out.pow(2).mean()


def data(lengths: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]
    targets = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]
    return ids, targets


def reference(
    mods: list[nn.Module], ids: list[torch.Tensor], targets: list[torch.Tensor], tokens: bool
) -> list[torch.Tensor]:
    """The unpipelined step: the whole model on each sequence; the mean over every token of the
    step (``tokens``), or the mean of the per-microbatch means (``scale_grads=True``)."""
    ref = nn.Sequential(*copy.deepcopy(mods))
    per_mb = []
    for x, t in zip(ids, targets):
        per_mb.append(F.cross_entropy(ref(x).flatten(0, 1), t.flatten(), reduction="sum"))
    total = sum(t.numel() for t in targets)
    loss = (
        sum(per_mb) / total
        if tokens
        else sum(p / t.numel() for p, t in zip(per_mb, targets)) / len(ids)
    )
    loss.backward()
    return [p.grad for p in ref.parameters()]


def my_stages(rank: int, world: int, cls: type) -> tuple[list, list[int], list, list, int]:
    """This rank's ``PipelineStage``s of the model (:func:`layers`, seed 0) split into ``cls``'s
    stages under its placement: ``(stages, stage indices, layers, parts, num_stages)``."""
    num_stages = world * cls.stages_per_rank
    mods = layers(seed=0)
    parts = chunks(mods, num_stages)
    stage_mods = [nn.Sequential(*(mods[i] for i in part)) for part in parts]
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(stage_mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    return stages, mine, mods, parts, num_stages


def steps(rank: int, world: int, schedule: str, split: str, draws: list[list[int]]) -> float:
    """One schedule, one process group: a step per draw of lengths, each against the unpipelined
    model. Draws alternate the two loss contracts. Returns the largest gradient difference."""
    cls = getattr(classes, schedule)
    stages, mine, mods, parts, num_stages = my_stages(rank, world, cls)
    m = len(draws[0])
    token_sched = cls(
        stages, m, loss_fn=token_loss, scale_grads=False, split=split, variable_shapes=True
    )
    worst = 0.0
    for i, lengths in enumerate(draws):
        tokens = i % 2 == 0
        ids, targets = data(lengths, seed=i)
        expected = reference(mods, ids, targets, tokens)
        for p in mods:
            p.zero_grad(set_to_none=True)
        first, last = 0 in mine, num_stages - 1 in mine
        kwargs = {
            "arg_mbs": [(x,) for x in ids] if first else None,
            "target_mbs": targets if last else None,
        }
        if tokens:
            kwargs["loss_kwargs"] = {"num_tokens": sum(t.numel() for t in targets)}
            token_sched.step(**kwargs)
        else:
            if i == 1:  # the same stages under the default contract (mean of means)
                mean_sched = cls(stages, m, loss_fn=mean_loss, split=split, variable_shapes=True)
            mean_sched.step(**kwargs)
        owned = {id(p) for s in mine for i in parts[s] for p in mods[i].parameters()}
        params = list(nn.Sequential(*mods).parameters())
        worst = max(
            worst, owned_grads_close(params, expected, owned, f"{schedule}/{split}", lengths)
        )
    return worst


def owned_grads_close(
    params: list, expected: list, owned: set[int], what: str, lengths: list[int]
) -> float:
    """Each parameter this rank holds (``id`` in ``owned``) has a gradient close to the
    unpipelined model's (fp32; microbatches summed in another order than the reference's);
    returns the largest difference."""
    worst = 0.0
    for j, (p, e) in enumerate(zip(params, expected, strict=True)):
        if id(p) not in owned:
            continue
        assert p.grad is not None, f"{what}: parameter {j} got no gradient"
        torch.testing.assert_close(
            p.grad,
            e,
            rtol=1e-4,
            atol=1e-6,
            msg=lambda e_, j=j: f"{what} lengths {lengths} param {j}: {e_}",
        )
        worst = max(worst, (p.grad - e).abs().max().item())
    return worst


def grads_cases(rank: int, world: int, todo: list[tuple[str, str]], draws: list[list[int]]) -> list:
    return [steps(rank, world, sched, split, draws) for sched, split in todo]


def data_dependent_case(rank: int, world: int, schedule: str) -> str:
    """A stage whose output length depends on values: every rank raises, before any send."""
    cls = getattr(classes, schedule)
    num_stages = world * cls.stages_per_rank
    mods = layers(seed=0)
    parts = chunks(mods, num_stages)
    stage_mods = [nn.Sequential(*(mods[i] for i in part)) for part in parts]
    stage_mods[0].append(Truncate())
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(stage_mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = cls(stages, 4, loss_fn=square_loss, variable_shapes=True)
    ids, targets = data([7, 29, 13, 50], seed=0)
    try:
        sched.step(
            arg_mbs=[(x,) for x in ids] if 0 in mine else None,
            target_mbs=targets if num_stages - 1 in mine else None,
        )
    except ValueError as e:
        return str(e)
    return ""
