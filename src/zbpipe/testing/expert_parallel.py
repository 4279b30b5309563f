"""A tiny mixture of experts whose experts are spread over an expert-parallel (EP) group: tokens
travel to their expert's rank and back by ``all_to_all_single`` with uneven splits, as
torchtitan's all-to-all token dispatcher moves them. For multi-rank tests of EP x PP.

:class:`ExpertParallelMoE` routes each token to one of ``n_experts`` experts (top-1, scaled by
its router score); rank ``r`` of the EP group holds experts ``r * n_local ... (r + 1) * n_local -
1`` as one 3-D weight. Its forward exchanges the token counts (an all-to-all without autograd),
sends each token to its expert's rank (:class:`AllToAll`, an ``autograd.Function`` whose backward
is the reverse exchange), runs the local experts, and sends the results back. Each EP rank sees
its own tokens; the router is replicated (its gradient is summed over the EP group afterwards, as
data parallelism does), every expert's gradient comes from the tokens of all EP ranks.

``reference=True`` builds the same layer with all ``n_experts`` experts and no group: the
unpipelined, single-process model the tests compute gradients on. Both draw their weights from
``seed``, so an EP rank's experts equal the reference's slice :meth:`local_slice` names.

Only public torch: ``torch.distributed.all_to_all_single`` (gloo supports uneven splits there,
``all_to_all`` of a list of unequal tensors it refuses).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its backward sends the gradients back."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelMoE(nn.Module):
    """``x + gate * expert(x)``: top-1 routing, experts spread over ``group`` (see the module)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        group: Any = None,
        *,
        seed: int = 0,
        reference: bool = False,
    ) -> None:
        super().__init__()
        self.group = None if reference else group
        self.ep_size = 1 if reference else dist.get_world_size(group)
        self.ep_rank = 0 if reference else dist.get_rank(group)
        if n_experts % self.ep_size:
            raise ValueError(f"n_experts={n_experts} must divide among {self.ep_size} EP ranks")
        self.n_experts, self.n_local = n_experts, n_experts // self.ep_size
        gen = torch.Generator().manual_seed(seed)
        self.router = nn.Linear(dim, n_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(n_experts, dim, generator=gen) * dim**-0.5)
        every = torch.randn(n_experts, dim, dim, generator=gen) * dim**-0.5
        self.experts = nn.Parameter(every[self.local_slice()].clone())

    def local_slice(self) -> slice:
        """The experts this rank holds, as a slice of all ``n_experts``."""
        return slice(self.ep_rank * self.n_local, (self.ep_rank + 1) * self.n_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = F.softmax(self.router(flat), dim=-1)
        gate, expert = scores.max(dim=-1, keepdim=True)  # top-1: the best score and its expert
        expert = expert.squeeze(-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.n_experts)
        routed = self._experts(flat[order], counts)
        out = torch.empty_like(routed).index_copy(0, order, routed)
        return x + (gate * out).reshape(x.shape)

    def _experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The expert outputs for ``tokens`` (sorted by expert, ``counts`` per expert)."""
        if self.group is None:
            return _apply(tokens, counts.tolist(), self.experts)
        with torch.no_grad():  # how many tokens each rank sends each of my experts
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(self.ep_size, self.n_local).sum(1).tolist()
        recv_by_rank = received.view(self.ep_size, self.n_local)
        recv = recv_by_rank.sum(1).tolist()
        arrived = AllToAll.apply(tokens, recv, send, self.group)
        # rank-major (each source rank's tokens, by local expert): one slice per (rank, expert)
        sizes = recv_by_rank.reshape(-1).tolist()
        weights = self.experts.repeat(self.ep_size, 1, 1)
        done = _apply(arrived, sizes, weights)
        back: torch.Tensor = AllToAll.apply(done, send, recv, self.group)
        return back


def _apply(tokens: torch.Tensor, sizes: list[int], weights: torch.Tensor) -> torch.Tensor:
    """Slice ``i`` of ``tokens`` (``sizes[i]`` rows) times ``weights[i]``, concatenated."""
    parts = [part @ w for part, w in zip(tokens.split(sizes), weights, strict=True)]
    return torch.cat(parts) if parts else tokens[:0]
