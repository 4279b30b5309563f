"""Per-rank bodies for tests/schedules/test_packed_grads.py: a packed batch split by document
(zbpipe.schedules.packed) through a tiny attention model whose every stage takes the
microbatch's positions and document ids by keyword (SDPA with a block-diagonal causal mask)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from tests.schedules._varlen_cases import Head, owned_grads_close
from zbpipe.schedules import classes
from zbpipe.schedules.packed import document_mask, split_packed

VOCAB, DIM, HEADS, MAX_LEN = 32, 16, 2, 64


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LEN, DIM)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(positions)


class Block(nn.Module):
    """Attention within each document only: a token that saw another document's tokens (the
    whole row's mask, or positions not restarted) changes every gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        mask = document_mask(document_ids)[:, None]  # (b, 1, n, n): every head
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Chunk(nn.Module):
    """Some of the model's layers; every chunk takes the microbatch's metadata by keyword."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor:
        for layer in self.layers:
            if isinstance(layer, Embed):
                x = layer(x, positions)
            elif isinstance(layer, Block):
                x = layer(x, document_ids)
            else:
                x = layer(x)
        return x


def layers(n_blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embed(), *(Block() for _ in range(n_blocks)), Head()]


def token_loss(logits: torch.Tensor, target: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / num_tokens


def packed_batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """One packed row of documents of ``lengths``: tokens, labels, cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.randint(0, VOCAB, (1, total), generator=g)
    labels = torch.randint(0, VOCAB, (1, total), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return tokens, labels, cu


def reference(mods: list[nn.Module], lengths: list[int], seed: int) -> list[torch.Tensor]:
    """The unpipelined model on the whole packed row, with the row's own metadata (positions
    restarting at every document, one document mask over the row), loss summed over the row's
    tokens and divided by their count."""
    tokens, labels, _ = packed_batch(lengths, seed)
    model = Chunk(copy.deepcopy(mods))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    logits = model(tokens, positions=positions, document_ids=doc_ids)
    token_loss(logits, labels, labels.numel()).backward()
    return [p.grad for p in model.parameters()]


def packed_steps(
    rank: int, world: int, todo: list[tuple[str, str, bool]], batches: list[list[int]], m: int
) -> float:
    """Each (schedule, engine, cost-ordered) over every packed batch, one step each, gradients
    against :func:`reference`; returns the largest difference."""
    worst = 0.0
    for schedule, split, ordered in todo:
        cls = getattr(classes, schedule)
        num_stages = world * cls.stages_per_rank
        mods = layers(n_blocks=num_stages)
        per = len(mods) // num_stages
        parts = [list(range(s * per, (s + 1) * per)) for s in range(num_stages)]
        parts[-1] += list(range(num_stages * per, len(mods)))
        mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
        stages = [
            PipelineStage(Chunk([mods[i] for i in parts[s]]), s, num_stages, torch.device("cpu"))
            for s in mine
        ]
        sched = cls(
            stages, m, loss_fn=token_loss, scale_grads=False, split=split, variable_shapes=True
        )
        first, last = 0 in mine, num_stages - 1 in mine
        for seed, lengths in enumerate(batches):
            expected = reference(mods, lengths, seed)
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            tokens, labels, cu = packed_batch(lengths, seed)
            # every rank splits the same batch: the metadata reaches every stage by keyword
            mbs = split_packed(
                tokens, m, cu_seqlens=cu, labels=labels, metadata=("positions", "document_ids")
            )
            sched.step(
                arg_mbs=mbs.arg_mbs if first else None,
                kwarg_mbs=mbs.kwarg_mbs,
                target_mbs=mbs.target_mbs if last else None,
                loss_kwargs={"num_tokens": mbs.num_tokens},
                microbatch_costs=mbs.costs if ordered and first else None,
            )
            owned = {id(p) for s in mine for i in parts[s] for p in mods[i].parameters()}
            params = list(Chunk(mods).parameters())
            what = f"{schedule}/{split}"
            worst = max(worst, owned_grads_close(params, expected, owned, what, lengths))
    return worst
