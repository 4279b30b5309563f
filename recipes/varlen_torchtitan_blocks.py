"""Train torchtitan's llama3 debug model on packed documents of different lengths with a zbpipe
schedule: 2 pipeline stages (ZB-H1; ZB-V: 4 chunks) on 2 gloo CPU ranks, no padding.

    python recipes/varlen_torchtitan_blocks.py --schedule ZBH1 --steps 10      # spawns 2 ranks
    torchrun --nproc-per-node 2 recipes/varlen_torchtitan_blocks.py --schedule ZBV

Why a script of our own and not torchtitan's Trainer: torchtitan 0.3.0's text dataset yields rows
of exactly ``seq_len`` tokens, no attention of its own takes a document mask on CPU, and zbpipe's
torchtitan names cannot ask for ``variable_shapes=True`` (docs/use/varlen.md, "torchtitan's
Trainer"). So this script uses torchtitan's model classes directly and does the rest itself:

* the model is ``torchtitan.models.llama3.llama3_configs["debugmodel"]`` (dim 256, 16 heads,
  vocab 2048, 6 layers; ``--layers`` keeps the first N, which the test uses to stay cheap), its
  init, RoPE, fused QKV, SwiGLU and RMSNorm. One change: every layer's inner attention is
  :class:`DocumentMaskedSDPA`, a subclass of torchtitan's ``ScaledDotProductAttention`` that
  passes the document mask to SDPA (the parent raises on any mask; its FlexAttention has no
  backward on CPU), swapped in the config as recipes/torchtitan/llama3_debug_cpu.py swaps in
  causal SDPA;
* each step packs one row of ``--row-tokens`` tokens from documents whose lengths are drawn from
  a log-normal distribution (median ``--median-doc``, sigma 1: long-tailed, a tenth of the
  documents over 3.6 x the median), seeded by (``--seed``, step) so every rank draws the same
  row, capped at ``row_tokens / microbatches`` (so every microbatch gets one);
* ``zbpipe.split_packed`` cuts the row into microbatches of whole documents with each one's own
  positions and document ids; every stage builds the causal block-diagonal mask from them
  (``zbpipe.schedules.packed.document_mask``), so no token attends across documents;
* the schedule runs with ``variable_shapes=True`` and the loss contract of docs/use/varlen.md:
  torchtitan's ``cross_entropy_loss`` (summed over tokens) divided by the row's token count,
  ``scale_grads=False``; microbatches run in the order their costs suggest (``--data-order``
  turns that off).

The rank holding the last stage prints, per step, the loss (mean over the row's tokens), the
step time and real tokens per second (every token is real: nothing is padded).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.attention import sdpa_kernel
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs

import zbpipe
from zbpipe import split_packed
from zbpipe.schedules.packed import document_mask

SCHEDULES = ("ZBH1", "ZBV")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--schedule", choices=SCHEDULES, default="ZBH1", help="zbpipe schedule")
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--row-tokens", type=int, default=1024, help="tokens in each step's row")
    p.add_argument("--median-doc", type=int, default=48, help="median document length")
    p.add_argument("--layers", type=int, default=6, help="the debug model's first N layers")
    p.add_argument("--lr", type=float, default=8e-4, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed")
    p.add_argument("--data-order", action="store_true", help="no cost ordering of microbatches")
    args = p.parse_args(argv)
    if args.row_tokens < args.microbatches:
        p.error(
            f"--row-tokens {args.row_tokens} < --microbatches {args.microbatches}: every "
            "microbatch needs at least one document of at least one token"
        )
    return args


class DocumentMaskedSDPA(ScaledDotProductAttention):
    """torchtitan's SDPA attention, taking a boolean mask ``(b, 1, n, n)`` (True: attend) as
    ``attention_masks``; without one it is the parent's causal attention."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_masks is None:
            return super().forward(
                q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal
            )
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        return out.transpose(1, 2)


def build_model(n_layers: int, seed: int) -> nn.Module:
    """torchtitan's llama3 debug model (its first ``n_layers`` layers), document-masked SDPA,
    initialised by torchtitan's own init from ``seed`` (the same weights on every rank)."""
    config = llama3_configs["debugmodel"](attn_backend="flex")
    if not 1 <= n_layers <= len(config.layers):
        raise ValueError(f"--layers must be in 1..{len(config.layers)}, got {n_layers}")
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = DocumentMaskedSDPA.Config()
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        model.init_states(buffer_device=None)
    return model


class Stage(nn.Module):
    """A pipeline stage: torchtitan's model with the layers of other stages removed (its own
    ``Decoder.forward`` passes through a missing embedding, norm or head, as torchtitan's
    pipeline split does), taking each microbatch's positions and document ids by keyword."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor:
        mask = document_mask(document_ids)[:, None]  # (1, 1, n, n): every head, causal
        return self.model(x, positions, mask)


def split_model(model: nn.Module, num_stages: int, keep: list[int]) -> dict[int, Stage]:
    """The stages in ``keep`` of ``model`` cut into ``num_stages`` runs of consecutive layers
    (the first stages take one more where they do not divide). Parameter names inside
    ``Stage.model`` are the whole model's."""
    names = list(model.layers.keys())
    if len(names) < num_stages:
        raise ValueError(f"--layers {len(names)} < {num_stages} stages: give every stage a layer")
    per, extra = divmod(len(names), num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + per + (1 if s < extra else 0))
    stages = {}
    for s in keep:
        part = copy.deepcopy(model)
        for name in names[: bounds[s]] + names[bounds[s + 1] :]:
            del part.layers[name]
        if s > 0:
            part.tok_embeddings = None
        if s < num_stages - 1:
            part.norm, part.lm_head = None, None
        stages[s] = Stage(part)
    return stages


def packed_row(
    step: int, row_tokens: int, median_doc: int, microbatches: int, seed: int, vocab: int = 2048
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row (tokens, labels, cu_seqlens), the same on every rank for (seed, step).

    Lengths: log-normal, median ``median_doc``, sigma 1, capped at ``row_tokens //
    microbatches``; the last document is cut to fill the row. Each document follows a fixed
    rule (next = 5 * previous + 3 mod vocab) 80% of the time, so the loss can fall; its labels
    are its own next tokens (none crosses a document boundary).
    """
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    cap = max(1, row_tokens // microbatches)
    lengths: list[int] = []
    while sum(lengths) < row_tokens:
        n = int(math.exp(math.log(median_doc) + float(torch.randn((), generator=g))))
        lengths.append(min(max(n, 1), cap, row_tokens - sum(lengths)))
    tokens, labels = [], []
    for n in lengths:
        doc = torch.empty(n + 1, dtype=torch.long)
        doc[0] = torch.randint(0, vocab, (), generator=g)
        noise = torch.randint(0, vocab, (n,), generator=g)
        follow = torch.rand(n, generator=g) < 0.8
        for i in range(n):
            doc[i + 1] = (5 * doc[i] + 3) % vocab if follow[i] else noise[i]
        tokens.append(doc[:-1])
        labels.append(doc[1:])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat(tokens)[None], torch.cat(labels)[None], cu


def token_loss(pred: torch.Tensor, labels: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """torchtitan's cross-entropy (summed over tokens) over the step's token count: the loss
    contract of docs/use/varlen.md (with ``scale_grads=False``)."""
    return cross_entropy_loss(pred, labels) / num_tokens


def train(
    rank: int,
    world: int,
    args: argparse.Namespace,
    on_grads: Callable[[int, dict[str, nn.Parameter]], None] | None = None,
) -> list[dict[str, float]]:
    """One rank's loop (process group already up). ``on_grads(step, params)`` sees this rank's
    parameters (named as in the whole model) after each step's backward, before the optimizer.
    Returns the printed records on the rank of the last stage, an empty list elsewhere."""
    cls = zbpipe.get_schedule_class(args.schedule)
    num_stages = world * cls.stages_per_rank
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    model = build_model(args.layers, args.seed)
    modules = split_model(model, num_stages, mine)
    dim = model.config.dim
    del model
    stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = cls(
        stages, args.microbatches, loss_fn=token_loss, scale_grads=False, variable_shapes=True
    )
    params = {n.removeprefix("model."): p for s in mine for n, p in modules[s].named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=args.lr)
    first, last = 0 in mine, num_stages - 1 in mine

    records = []
    for step in range(args.steps):
        tokens, labels, cu = packed_row(
            step, args.row_tokens, args.median_doc, args.microbatches, args.seed
        )
        t0 = time.perf_counter()
        # every rank splits the same row: the metadata reaches every stage by keyword
        mbs = split_packed(
            tokens,
            args.microbatches,
            cu_seqlens=cu,
            labels=labels,
            metadata=("positions", "document_ids"),
            quadratic_at=12 * dim,
        )
        losses: list[torch.Tensor] = []
        opt.zero_grad(set_to_none=True)
        sched.step(
            arg_mbs=mbs.arg_mbs if first else None,
            kwarg_mbs=mbs.kwarg_mbs,
            target_mbs=mbs.target_mbs if last else None,
            losses=losses if last else None,
            loss_kwargs={"num_tokens": mbs.num_tokens},
            microbatch_costs=mbs.costs if first and not args.data_order else None,
        )
        if on_grads is not None:
            on_grads(step, params)
        opt.step()
        seconds = time.perf_counter() - t0
        if last:
            loss = float(
                torch.stack(losses).detach().sum()
            )  # each is a sum over tokens / num_tokens
            n_docs = len(cu) - 1
            longest = int((cu[1:] - cu[:-1]).max())
            records.append(
                {"step": step, "loss": loss, "seconds": seconds, "tokens": mbs.num_tokens}
            )
            print(
                f"[{args.schedule}] step {step:3d}  loss {loss:.4f}  {n_docs:3d} docs "
                f"(longest {longest:4d})  {seconds * 1e3:7.1f} ms  "
                f"{mbs.num_tokens / seconds:8.0f} tokens/s",
                flush=True,
            )
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # torchrun: one process per rank, env:// rendezvous
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    from zbpipe.testing import run_ranks  # spawns the ranks and never hangs (timeouts)

    run_ranks(train, args.ranks, args, timeout=120.0 + 20.0 * args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
