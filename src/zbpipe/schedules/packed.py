"""A packed batch (documents laid end to end in one row) split into microbatches of whole
documents, each with its own metadata, ready for ``step(arg_mbs=, kwarg_mbs=, target_mbs=)``
with ``variable_shapes=True`` (docs/use/varlen.md).

A packed row's metadata describes the whole row: ``cu_seqlens`` indexes its documents from the
row's first token, positions count from each document's start. Slicing the row into
microbatches and keeping that metadata is the bug torchtitan #4098 reports (a microbatch indexes
the whole batch's ``cu_seqlens``). :func:`split_packed` never splits a document; it groups the
documents by cost (:func:`zbpipe.planning.by_cost.group_by_cost`: tokens, plus attention's
square term per document) and rebuilds each microbatch's positions, ``cu_seqlens`` (from 0) and
document ids (from 0). :func:`document_mask` turns a microbatch's document ids into the
block-diagonal mask SDPA takes.

The metadata goes in ``kwarg_mbs``, which reach every stage on a rank (torch's contract): every
rank calls :func:`split_packed` on the same packed batch (a rank without stage 0 needs only its
boundaries and labels; its tokens may be any tensor of the row's shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..planning.by_cost import group_by_cost

Metadata = Literal["positions", "cu_seqlens", "document_ids", "max_seqlen"]
_METADATA = ("positions", "cu_seqlens", "document_ids", "max_seqlen")


@dataclass(frozen=True, kw_only=True)
class PackedMicrobatches:
    """A packed batch as ``step()``'s microbatch lists."""

    arg_mbs: list[tuple[torch.Tensor]]
    """Each microbatch's tokens, ``(tokens,)``: the packed row's layout, ``(n,)`` or ``(1, n)``."""
    kwarg_mbs: list[dict[str, Any]]
    """Each microbatch's metadata, under the names asked for: ``positions`` (int64, the tokens'
    shape, from 0 at every document's start), ``cu_seqlens`` (1-D, from 0 to the microbatch's
    length; the given ``cu_seqlens``' dtype, else int32 as flash attention takes it),
    ``document_ids`` (int64, the tokens' shape, numbered from 0 in the microbatch),
    ``max_seqlen`` (a Python int: its longest document)."""
    target_mbs: list[torch.Tensor] | None
    """Each microbatch's labels (sliced as the tokens are), or None without ``labels``."""
    documents: tuple[tuple[int, ...], ...]
    """Which documents (numbered in packed order) each microbatch holds, in packed order."""
    costs: tuple[float, ...]
    """Each microbatch's cost relative to the mean one (the cost the grouping balanced): pass it
    as ``step(microbatch_costs=...)`` on stage 0's rank."""
    num_tokens: int
    """The batch's tokens the loss counts: labels other than ``ignore_index`` (all the tokens
    without labels). Divide a summed loss by it (the loss contract, docs/use/varlen.md)."""


def split_packed(
    tokens: torch.Tensor,
    n_microbatches: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    metadata: Sequence[Metadata] = ("positions", "cu_seqlens"),
    quadratic_at: float | None = None,
    ignore_index: int = -100,
) -> PackedMicrobatches:
    """Split one packed row into ``n_microbatches`` microbatches of whole documents.

    ``tokens``: shape ``(T,)`` or ``(1, T)``. The documents are given by exactly one of
    ``cu_seqlens`` (1-D integers ``[0, ..., T]``, strictly increasing) or ``document_ids`` (the
    tokens' shape; each document's tokens one contiguous run). A document of ``n`` tokens costs
    ``n + n**2 / quadratic_at`` (:func:`~zbpipe.planning.by_cost.token_scales`' model, per
    document as varlen or document-masked attention computes it; None: linear). ``metadata``
    names the keyword inputs each microbatch gets (:class:`PackedMicrobatches`).
    """
    row, t = _row(tokens)
    starts, lengths = _documents(t, cu_seqlens, document_ids)
    _check_options(tokens, labels, metadata, quadratic_at, n_microbatches, len(lengths))
    doc_costs = [n + (n * n / quadratic_at if quadratic_at else 0.0) for n in lengths]
    groups = group_by_cost(doc_costs, n_microbatches)
    cu_dtype = cu_seqlens.dtype if cu_seqlens is not None else torch.int32
    arg_mbs, kwarg_mbs, target_mbs = [], [], []
    for docs in groups:
        lens = [lengths[d] for d in docs]
        index = torch.cat([torch.arange(starts[d], starts[d] + lengths[d]) for d in docs])
        shape = (len(index),) if not row else (1, len(index))
        arg_mbs.append((tokens.reshape(-1)[index].reshape(shape),))
        if labels is not None:
            target_mbs.append(labels.reshape(-1)[index].reshape(shape))
        kwarg_mbs.append(_metadata(metadata, lens, shape, cu_dtype))
    totals = [sum(doc_costs[d] for d in docs) for docs in groups]
    mean = sum(totals) / len(totals)
    counted = t if labels is None else int((labels != ignore_index).sum())
    return PackedMicrobatches(
        arg_mbs=arg_mbs,
        kwarg_mbs=kwarg_mbs,
        target_mbs=target_mbs if labels is not None else None,
        documents=groups,
        costs=tuple(x / mean for x in totals),
        num_tokens=counted,
    )


def document_mask(document_ids: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """The boolean attention mask of a microbatch's documents: token i attends to token j only
    in the same document (and, ``causal``, for j <= i). ``document_ids``: ``(..., n)``; the mask
    is ``(..., n, n)``, True where attention is allowed (what SDPA's ``attn_mask`` takes)."""
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    if causal:
        n = document_ids.shape[-1]
        same = same & torch.ones(n, n, dtype=torch.bool, device=same.device).tril()
    return same


def _check_options(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    metadata: Sequence[str],
    quadratic_at: float | None,
    n_microbatches: int,
    n_documents: int,
) -> None:
    if labels is not None and tuple(labels.shape) != tuple(tokens.shape):
        raise ValueError(
            f"split_packed: labels have shape {tuple(labels.shape)} but tokens "
            f"{tuple(tokens.shape)}; give one label per token"
        )
    unknown = [m for m in metadata if m not in _METADATA]
    if unknown:
        raise ValueError(f"split_packed: unknown metadata {unknown}; choose from {list(_METADATA)}")
    if quadratic_at is not None and not quadratic_at > 0:
        raise ValueError(f"split_packed: quadratic_at must be > 0 or None, got {quadratic_at}")
    if (
        isinstance(n_microbatches, bool)
        or not isinstance(n_microbatches, int)
        or not 1 <= n_microbatches <= n_documents
    ):
        raise ValueError(
            f"split_packed: n_microbatches={n_microbatches!r} for a batch of {n_documents} "
            "documents; a document is never split, so give between 1 and that many microbatches"
        )


def _row(tokens: torch.Tensor) -> tuple[bool, int]:
    """Whether the row has a batch dimension of 1, and its length."""
    if (
        not isinstance(tokens, torch.Tensor)
        or not (tokens.dim() == 1 or (tokens.dim() == 2 and tokens.shape[0] == 1))
        or tokens.shape[-1] == 0
    ):
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(
            f"split_packed: tokens must be one packed row, shape (T,) or (1, T) with T >= 1, got "
            f"{shape}; "
            "split a batch of several rows one row at a time"
        )
    return tokens.dim() == 2, int(tokens.shape[-1])


def _documents(
    t: int, cu_seqlens: torch.Tensor | None, document_ids: torch.Tensor | None
) -> tuple[list[int], list[int]]:
    """Every document's first token and length, checked against a row of ``t`` tokens."""
    if (cu_seqlens is None) == (document_ids is None):
        raise ValueError(
            "split_packed: give the document boundaries as exactly one of cu_seqlens or "
            "document_ids"
        )
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.numel() < 2:
            raise ValueError(
                "split_packed: cu_seqlens must be a 1-D integer tensor [0, ..., T] with at least "
                f"two entries, got shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
            )
        cu = [int(v) for v in cu_seqlens.tolist()]
        if cu[0] != 0 or cu[-1] != t:
            raise ValueError(
                f"split_packed: cu_seqlens must start at 0 and end at the row's {t} tokens, got "
                f"{cu[0]} ... {cu[-1]}"
            )
        bad = [i for i in range(1, len(cu)) if cu[i] <= cu[i - 1]]
        if bad:
            raise ValueError(
                f"split_packed: cu_seqlens must be strictly increasing (every document has a "
                f"token), but cu_seqlens[{bad[0]}]={cu[bad[0]]} <= "
                f"cu_seqlens[{bad[0] - 1}]={cu[bad[0] - 1]}"
            )
        return cu[:-1], [b - a for a, b in zip(cu, cu[1:])]
    assert document_ids is not None
    if document_ids.is_floating_point() or document_ids.reshape(-1).numel() != t:
        raise ValueError(
            "split_packed: document_ids must be integers of the tokens' shape, got shape "
            f"{tuple(document_ids.shape)} dtype {document_ids.dtype}"
        )
    ids = document_ids.reshape(-1).tolist()
    starts = [0] + [i for i in range(1, t) if ids[i] != ids[i - 1]]
    seen: set[int] = set()
    for s in starts:
        if ids[s] in seen:
            raise ValueError(
                f"split_packed: document id {ids[s]} appears again at token {s} after other "
                "documents; each document's tokens must be one contiguous run of the row"
            )
        seen.add(ids[s])
    return starts, [b - a for a, b in zip(starts, [*starts[1:], t])]


def _metadata(
    names: Sequence[str], lens: list[int], shape: tuple[int, ...], cu_dtype: torch.dtype
) -> dict[str, Any]:
    """One microbatch's keyword inputs, from its documents' lengths alone."""
    meta: dict[str, Any] = {}
    for name in names:
        if name == "positions":
            meta[name] = torch.cat([torch.arange(n) for n in lens]).reshape(shape)
        elif name == "cu_seqlens":
            meta[name] = torch.tensor([0, *_cumsum(lens)], dtype=cu_dtype)
        elif name == "document_ids":
            ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
            meta[name] = ids.reshape(shape)
        else:
            meta[name] = max(lens)
    return meta


def _cumsum(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
