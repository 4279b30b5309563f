"""Analytic per-layer costs of a decoder-only transformer, for the split (:mod:`.split`).

Times are forward FLOPs of one microbatch (``tokens = seq * microbatch_size``); any common unit
does, since a split compares stages of one model. Each matrix multiply of ``tokens x k`` by
``k x n`` costs ``2 * tokens * k * n`` forward, the same again for its input gradient (B) and
again for its weight gradient (W). Attention's score and value products have no weights: their
backward is all B (twice the forward). Memory is the activation bytes a layer keeps per
microbatch, a rough count (inputs of every matrix multiply plus attention's probabilities'
share), good enough to compare stages, not to size a device.

The embedding is a lookup (about nothing to compute, its gradient a scatter); the head (final
norm and the vocabulary projection) costs ``2 * tokens * hidden * vocab`` forward, often several
transformer layers' worth on small models: why the default split, which counts it as one layer,
leaves the last stage (and under V placement rank 0) the slowest.
"""

from __future__ import annotations

from .split import LayerCost


def _check(**values: int | float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"layer_costs_from_config: {name} must be a number >= 0, got {v!r}")


def transformer_layer_cost(
    name: str,
    *,
    hidden: int,
    seq: int,
    microbatch_size: int = 1,
    ffn_hidden: int = 0,
    kv_hidden: int | None = None,
    num_experts: int = 0,
    top_k: int = 0,
    moe_ffn_hidden: int = 0,
    shared_experts: int = 0,
    dtype_bytes: int = 4,
) -> LayerCost:
    """One decoder layer: attention (``kv_hidden``: the key/value width, ``hidden`` without
    grouped-query attention) and either a dense SwiGLU FFN (``ffn_hidden``) or a mixture of
    ``num_experts`` SwiGLU experts of width ``moe_ffn_hidden``, ``top_k`` of them per token,
    plus ``shared_experts`` always-on ones."""
    _check(hidden=hidden, seq=seq, microbatch_size=microbatch_size, ffn_hidden=ffn_hidden)
    _check(num_experts=num_experts, top_k=top_k, moe_ffn_hidden=moe_ffn_hidden)
    tokens = seq * microbatch_size
    kv = hidden if kv_hidden is None else kv_hidden
    projections = 2 * tokens * (2 * hidden * hidden + 2 * hidden * kv)  # q, o; k, v
    scores = 2 * tokens * seq * hidden  # QK^T and PV, causal: half of 2 * 2 * tokens * seq * h
    if num_experts:
        active = (top_k + shared_experts) * moe_ffn_hidden
        ffn = 2 * tokens * 3 * hidden * active + 2 * tokens * hidden * num_experts  # + router
        ffn_width = active
    else:
        ffn = 2 * tokens * 3 * hidden * ffn_hidden
        ffn_width = ffn_hidden
    linear = projections + ffn
    # saved per token: norms' and projections' inputs (~6 h), q k v (~3 h), the FFN's inputs
    # and gate/up outputs (~3 ffn width), attention's output and softmax statistics
    mem = dtype_bytes * tokens * (10 * hidden + 2 * kv + 3 * ffn_width)
    return LayerCost((name,), f=linear + scores, b=linear + 2 * scores, w=linear, mem=mem)


def layer_costs_from_config(
    *,
    num_layers: int,
    hidden: int,
    vocab: int,
    seq: int,
    microbatch_size: int = 1,
    ffn_hidden: int = 0,
    kv_hidden: int | None = None,
    num_experts: int = 0,
    top_k: int = 0,
    moe_ffn_hidden: int = 0,
    shared_experts: int = 0,
    dense_layers: int = 0,
    dtype_bytes: int = 4,
    embedding: tuple[str, ...] = ("tok_embeddings",),
    head: tuple[str, ...] = ("norm", "lm_head"),
    layer_name: str = "layers.{}",
) -> list[LayerCost]:
    """The pieces of a decoder-only transformer in model order: the embedding, ``num_layers``
    decoder layers (the first ``dense_layers`` dense with ``ffn_hidden`` when the others are
    MoE, as DeepSeek-V3 does), the head. Names default to torchtitan's module names.

    Long because every piece's arguments are spelled out by keyword.
    """
    _check(num_layers=num_layers, vocab=vocab, dense_layers=dense_layers)
    if num_experts and (top_k < 1 or top_k > num_experts or moe_ffn_hidden < 1):
        raise ValueError(
            f"layer_costs_from_config: an MoE needs 1 <= top_k <= num_experts and "
            f"moe_ffn_hidden >= 1, got top_k={top_k}, num_experts={num_experts}, "
            f"moe_ffn_hidden={moe_ffn_hidden}"
        )
    tokens = seq * microbatch_size
    pieces = [
        # a lookup forward, a scatter-add for the weight gradient, no input gradient
        LayerCost(embedding, f=tokens * hidden, b=0.0, w=tokens * hidden, mem=0.0)
    ]
    for i in range(num_layers):
        moe = num_experts > 0 and i >= dense_layers
        pieces.append(
            transformer_layer_cost(
                layer_name.format(i),
                hidden=hidden,
                seq=seq,
                microbatch_size=microbatch_size,
                ffn_hidden=ffn_hidden,
                kv_hidden=kv_hidden,
                num_experts=num_experts if moe else 0,
                top_k=top_k if moe else 0,
                moe_ffn_hidden=moe_ffn_hidden if moe else 0,
                shared_experts=shared_experts if moe else 0,
                dtype_bytes=dtype_bytes,
            )
        )
    projection = 2 * tokens * hidden * vocab
    # the logits and their gradient (the loss's softmax) are what the head keeps
    pieces.append(
        LayerCost(
            head,
            f=projection,
            b=projection,
            w=projection,
            mem=dtype_bytes * tokens * (hidden + 2 * vocab),
        )
    )
    return pieces


def layer_cost_from_params(
    name: str,
    active_params: float,
    *,
    hidden: int,
    seq: int,
    microbatch_size: int = 1,
    dtype_bytes: int = 4,
) -> LayerCost:
    """One decoder layer from the parameters a token goes through (``active_params``: all of a
    dense layer's, an MoE layer's shared ones plus ``top_k / num_experts`` of its experts'):
    ``2 * tokens * active_params`` forward FLOPs in matrix multiplies plus causal attention's
    ``2 * tokens * seq * hidden``. Memory as :func:`transformer_layer_cost` counts it, with the
    matrices' input widths taken as ``active_params / hidden``."""
    _check(active_params=active_params, hidden=hidden, seq=seq, microbatch_size=microbatch_size)
    tokens = seq * microbatch_size
    linear = 2.0 * tokens * active_params
    scores = 2.0 * tokens * seq * hidden
    mem = dtype_bytes * tokens * (active_params / max(hidden, 1) + 8 * hidden)
    return LayerCost((name,), f=linear + scores, b=linear + 2 * scores, w=linear, mem=mem)
