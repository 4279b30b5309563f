"""A tiny mixture-of-experts GPT with a real expert all-to-all, for the overlapped-pair tests and
benchmarks: each block is attention, then an MoE layer whose tokens go to other ranks' experts
and come back (expert parallelism over a process group, gloo's ``all_to_all_single`` with even
splits).

The MoE layer: ``s = sigmoid(score(ln(h)))``; **dispatch** ``y = all_to_all(ln(h) * s)`` (row
block ``j`` of every rank's tokens goes to rank ``j``); each rank's experts mix softly,
``sum_e softmax(gate(y))_e * expert_e(y)``; **combine** ``z = all_to_all(...)`` brings the rows
home (with even splits the exchange is its own inverse); the block returns ``h + z * s``. The
residual ``h`` and the scores ``s`` are used on both sides of the collectives, as in a real MoE.

:class:`EvenAllToAll` is the collective: ``start(x)`` launches it (``async_op=True``) and
returns a handle whose ``wait()`` returns the result; ``latency`` makes every exchange take at
least that many seconds from its start, waited by sleeping (a slow network, not a slow CPU).
It is what the model's own differentiable exchange (``MoE.exchange(x, a2a)``) runs, and it has
the shape zbpipe's overlapped pairs take as a collective (``start``, ``start_backward``), so a
schedule can be told the model's communication points without changing the model: each MoE
layer's ``exchange`` method, its collective the ``a2a`` argument.

This module imports nothing of zbpipe (the testing layer sits below the schedules).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .models import Embed, Head

#: where a model records what it does, for tests that check the order: (event, name)
Log = list[tuple[str, str]]


@dataclass(frozen=True, kw_only=True)
class TinyMoEConfig:
    vocab: int = 64
    """Vocabulary size."""
    hidden: int = 32
    """Model width."""
    seq: int = 8
    """Sequence length (tokens of a microbatch: a multiple of the expert-parallel size)."""
    heads: int = 2
    """Attention heads."""
    experts: int = 2
    """Experts on each rank."""
    blocks_per_stage: int = 1
    """Transformer blocks (attention + MoE) in each pipeline stage."""


class EvenAllToAll:
    """``all_to_all_single`` over ``group`` with even splits, started now and waited later."""

    def __init__(
        self, group: Any, latency: float = 0.0, log: Log | None = None, name: str = ""
    ) -> None:
        self.group, self.latency, self.log, self.name = group, latency, log, name

    def __deepcopy__(self, memo: dict[int, Any]) -> EvenAllToAll:
        return self  # a copied model exchanges over the same group

    def start(self, x: torch.Tensor, what: str = "") -> _Exchanging:
        x = x.contiguous()
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=self.group, async_op=True)
        name = self.name + what
        if self.log is not None:
            self.log.append(("start", name))
        return _Exchanging(work, out, time.perf_counter() + self.latency, self.log, name)

    def start_backward(self, grad: torch.Tensor) -> _Exchanging:
        """The gradient goes back the same way (with even splits the exchange is its inverse)."""
        return self.start(grad, " backward")


class _Exchanging:
    def __init__(
        self, work: Any, out: torch.Tensor, ready: float, log: Log | None, name: str
    ) -> None:
        self.work, self.out, self.ready, self.log, self.name = work, out, ready, log, name

    def wait(self) -> torch.Tensor:
        self.work.wait()
        left = self.ready - time.perf_counter()
        if left > 0:
            time.sleep(left)  # the network's latency: no CPU used
        if self.log is not None:
            self.log.append(("wait", self.name))
        return self.out


class _Exchange(torch.autograd.Function):
    """The model's own differentiable exchange: the all-to-all forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a2a: EvenAllToAll) -> torch.Tensor:
        ctx.a2a = a2a
        return a2a.start(x).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.a2a.start_backward(grad).wait(), None


class Expert(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Experts(nn.Module):
    """This rank's experts, mixed softly by a local gate."""

    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.experts)
        self.experts = nn.ModuleList(Expert(cfg.hidden) for _ in range(cfg.experts))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        w = self.gate(y).softmax(-1)
        return sum(w[:, e : e + 1] * ex(y) for e, ex in enumerate(self.experts))  # type: ignore[return-value]


class MoE(nn.Module):
    """Dispatch, experts, combine (module docstring); ``exchange`` is its communication point."""

    def __init__(self, cfg: TinyMoEConfig, a2a: Callable[[str], EvenAllToAll]) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.score = nn.Linear(cfg.hidden, 1)
        self.experts = Experts(cfg)
        self.dispatch_a2a, self.combine_a2a = a2a("dispatch"), a2a("combine")
        self.log: Log | None = self.dispatch_a2a.log

    def exchange(self, x: torch.Tensor, a2a: EvenAllToAll) -> torch.Tensor:
        """The all-to-all: the method a schedule may declare as a communication point."""
        return _Exchange.apply(x, a2a)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        x = self.ln(h).reshape(b * t, d)
        s = torch.sigmoid(self.score(x))
        y = self.exchange(x * s, self.dispatch_a2a)
        out = self.experts(y)
        self._note(out)
        z = self.exchange(out, self.combine_a2a)
        return h + (z * s).reshape(b, t, d)

    def _note(self, out: torch.Tensor) -> None:
        """Log the experts' forward now, and their backward when the gradient reaches ``out``
        (``("compute", "stage S forward")``, ``("compute", "stage S backward")``)."""
        if self.log is None:
            return
        log, stage = self.log, self.dispatch_a2a.name.rsplit(" ", 1)[0]
        log.append(("compute", f"{stage} forward"))
        if out.requires_grad:
            out.register_hook(lambda g: log.append(("compute", f"{stage} backward")))  # type: ignore[arg-type, func-returns-value]


class Attention(nn.Module):
    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        mask = torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        nh = self.cfg.heads
        q, k, v = self.qkv(self.ln(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, nh, h // nh).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (h // nh) ** 0.5
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return x + self.proj((att @ v).transpose(1, 2).reshape(b, t, h))


class MoEBlock(nn.Module):
    def __init__(self, cfg: TinyMoEConfig, a2a: Callable[[str], EvenAllToAll]) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.moe = MoE(cfg, a2a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.attn(x))


def build_moe_stages(
    cfg: TinyMoEConfig,
    num_stages: int,
    ep_group: Any,
    ep_rank: int = 0,
    *,
    latency: float = 0.0,
    log: Log | None = None,
    seed: int = 0,
) -> list[nn.Module]:
    """The model as ``num_stages`` modules (embedding + blocks, blocks, ..., blocks + head),
    its experts those of expert-parallel rank ``ep_rank`` of ``ep_group``.

    Everything but the experts is the same on every rank (``seed``); each stage's experts are
    seeded by (stage, ``ep_rank``), so the ranks of one expert-parallel group hold different
    experts and every pipeline row holds the same ones.
    """
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for s in range(num_stages):

        def a2a(name: str, s: int = s) -> EvenAllToAll:
            return EvenAllToAll(ep_group, latency, log, f"stage {s} {name}")

        layers: list[nn.Module] = [Embed(_gpt(cfg))] if s == 0 else []
        layers += [MoEBlock(cfg, a2a) for _ in range(cfg.blocks_per_stage)]
        if s == num_stages - 1:
            layers.append(Head(_gpt(cfg)))
        mods.append(nn.Sequential(*layers))
    for s, mod in enumerate(mods):  # the experts: per stage and expert-parallel rank
        gen = torch.Generator().manual_seed(10_007 * (seed + 1) + 101 * s + ep_rank)
        for experts in (m for m in mod.modules() if isinstance(m, Experts)):
            for p in experts.parameters():
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return mods


def moe_layers(mod: nn.Module) -> list[MoE]:
    """The MoE layers of a stage module, in order."""
    return [m for m in mod.modules() if isinstance(m, MoE)]


def _gpt(cfg: TinyMoEConfig) -> Any:
    from .models import TinyGPTConfig

    return TinyGPTConfig(vocab=cfg.vocab, hidden=cfg.hidden, seq=cfg.seq, heads=cfg.heads)
