"""Per-rank bodies of the torchtitan tests (module level so spawned processes can import them).

They drive torchtitan 0.3.x's own pipeline code (``pipeline_llm``: stage count, model split,
stage placement, schedule building) on a tiny llama3, on CPU with gloo.
"""

from __future__ import annotations

import torch

DIM, VOCAB, N_LAYERS, HEADS, SEQ = 64, 256, 4, 4, 32


def tiny_llama3_config():
    """torchtitan's llama3 at dim 64, 4 layers, vocab 256.

    torchtitan's language models use FlexAttention, which has no backward on CPU; the inner
    attention is swapped for torchtitan's own causal ``ScaledDotProductAttention`` (what its
    Flux model uses). Everything else (embedding, RoPE, GQA, SwiGLU FFN, RMSNorm, lm_head, init)
    is torchtitan's.
    """
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention

    cfg = L.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)
        ),
        layers=L._build_llama3_layers(
            n_layers=N_LAYERS,
            dim=DIM,
            n_heads=HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
            rope=ComplexRoPE.Config(
                dim=DIM // HEADS, max_seq_len=2 * SEQ, theta=10000, scaling="none"
            ),
            attn_backend="flex",
        ),
    )
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = tiny_llama3_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss_fn():
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))


def _parallel_dims(world: int, schedule: str):
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    # torchtitan falls back to "cuda" when no accelerator is found; this machine has none.
    pd.device_type = "cpu"
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=world,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=1,
        data_parallel_shard_degree=1,
    )
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    return dims, parallelism


def pipeline_step(rank: int, world: int, schedule: str, local_batch: int, seed: int):
    """Build the pipeline with torchtitan's ``pipeline_llm`` and run one ``step``.

    Returns (schedule class name, this rank's stage indices, {fqn: grad}, summed loss or None).
    """
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    import zbpipe.torchtitan  # noqa: F401  (the integration: every rank imports it)

    dims, parallelism = _parallel_dims(world, schedule)
    model = build_model(seed)
    sched, parts, has_first, has_last = pipeline_llm(
        model,
        parallel_dims=dims,
        training=TrainingConfig(local_batch_size=local_batch, seq_len=SEQ),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,  # only read by parallelize_fn
        dump_folder="",
        device=torch.device("cpu"),
        model_config=tiny_llama3_config(),
        parallelize_fn=lambda m, **_: m,  # no FSDP/TP/compile on CPU: the pipeline is under test
        loss_fn=_loss_fn(),
    )
    x, y = batch(local_batch, seed)
    losses: list = []
    # torch 2.13's step(); torchtitan 0.3.0's Trainer calls step(arg_mbs=...), a newer torch API.
    sched.step(*((x,) if has_first else ()), target=y if has_last else None, losses=losses)
    # numpy, not tensors: torch pickles tensors through shared memory that dies with the process.
    grads = {
        n: p.grad.detach().numpy().copy() for part in parts for n, p in part.named_parameters()
    }
    loss = torch.stack(losses).sum().item() if has_last else None
    stages = [s.stage_index for s in getattr(sched, "_stages", None) or [sched._stage]]
    return type(sched).__name__, stages, grads, loss


def unpipelined_grads(local_batch: int, seed: int):
    """The whole model, one microbatch at a time, losses summed.

    torchtitan passes scale_grads=False.
    """
    model = build_model(seed)
    loss_fn = _loss_fn()
    x, y = batch(local_batch, seed)
    total = sum(loss_fn(model(xi), yi)[0] for xi, yi in zip(x.split(1), y.split(1)))
    total.backward()
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}, total.item()


def compare_schedules(rank: int, world: int, schedules: list[str], local_batch: int, seed: int):
    """Run each schedule through torchtitan on the same model and data.

    Returns the results per schedule.
    """
    out = {name: pipeline_step(rank, world, name, local_batch, seed) for name in schedules}
    if rank == 0:
        out["reference"] = unpipelined_grads(local_batch, seed)
    return out
