"""Llama-style transformer blocks (RMSNorm, causal SDPA, SwiGLU) for the GPU benchmark.

No embedding or vocabulary head: a stage is a stack of blocks on a hidden-state tensor, so the
benchmark times the block work that dominates a real model's stages. The loss is the mean square
of the last stage's output (cheap, and every microbatch's gradient depends on every weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        ffn = 256 * ((8 * hidden // 3 + 255) // 256)  # Llama's SwiGLU width, rounded to 256
        self.heads = heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.ffn_norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        z = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(z)) * self.up(z))


def heads_for(hidden: int) -> int:
    """Head dimension 128 where the width allows it (Llama's), else 2 heads."""
    return hidden // 128 if hidden >= 256 else 2


def build_chunks(
    hidden: int, blocks: int, chunks: int, *, seed: int, dtype: torch.dtype, device: torch.device
) -> list[nn.Module]:
    """``blocks`` blocks split into ``chunks`` stages; the same seed gives the same weights."""
    if blocks % chunks:
        raise ValueError(f"{blocks} blocks do not split into {chunks} equal stages")
    torch.manual_seed(seed)
    all_blocks = [LlamaBlock(hidden, heads_for(hidden)) for _ in range(blocks)]
    per = blocks // chunks
    return [
        nn.Sequential(*all_blocks[i * per : (i + 1) * per]).to(device=device, dtype=dtype)
        for i in range(chunks)
    ]


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target.float()).pow(2).mean()
