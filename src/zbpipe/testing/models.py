"""A tiny GPT-style model cut into pipeline stages, for tests, the demo and benchmarks.

``TinyGPTConfig(tricky=True)`` adds what a split backward must get right: a Linear applied
twice in one block, a custom ``torch.autograd.Function`` and a registered buffer, on top of an
embedding and LayerNorms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class TinyGPTConfig:
    vocab: int = 64
    """Vocabulary size."""
    hidden: int = 32
    """Model width."""
    seq: int = 8
    """Sequence length."""
    heads: int = 2
    """Attention heads."""
    blocks_per_stage: int = 1
    """Transformer blocks in each pipeline stage."""
    tricky: bool = False
    """Add a reused Linear, a custom autograd.Function and a buffer to every block."""


class ScaledSiLU(torch.autograd.Function):
    """x * sigmoid(x), with a hand-written backward (a custom Function in the graph)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        x, s = ctx.saved_tensors
        return grad * (s * (1 + x * (1 - s)))


class Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.out = nn.Linear(4 * h, h)
        if cfg.tricky:
            self.mix = nn.Linear(h, h)  # applied twice below
            self.register_buffer("gain", torch.linspace(0.5, 1.5, h))
        mask = torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        nh = self.cfg.heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, nh, h // nh).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (h // nh) ** 0.5
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, h))
        y = self.ln2(x)
        if self.cfg.tricky:
            y = self.mix(ScaledSiLU.apply(self.mix(y))) * self.gain
        return x + self.out(F.gelu(self.fc(y)))


class Embed(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Head(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.lm = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def build_stages(cfg: TinyGPTConfig, num_stages: int, seed: int = 0) -> list[nn.Module]:
    """The model as ``num_stages`` modules: embedding + blocks, blocks, ..., blocks + head.

    The same seed gives the same weights whatever the rank, so every rank can build the whole
    model, keep its own stages, and compare against the unpipelined ``nn.Sequential`` of all.
    """
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    for s in range(num_stages):
        layers: list[nn.Module] = [Embed(cfg)] if s == 0 else []
        layers += [Block(cfg) for _ in range(cfg.blocks_per_stage)]
        if s == num_stages - 1:
            layers.append(Head(cfg))
        stages.append(nn.Sequential(*layers))
    return stages


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over one microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def synthetic_batch(
    cfg: TinyGPTConfig, batch: int, step: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: each sequence counts up by a per-sequence stride (mod vocab).

    Returns ``(ids, targets)`` with targets the next token, so the loss falls as the model learns.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
