"""Per-rank body of the torchtitan DualPipeV test (module level: spawned ranks import it).

torchtitan 0.3.0's Qwen3 MoE debug model (``debugmodel_moe``: dim 256, vocab 2048), 4 MoE layers
built by torchtitan's builder for it but smaller (8 experts, top 2: ``EXPERTS`` below), one per
pipeline stage, 4 stages in V placement on 2 CPU
ranks (pipeline parallelism only). Its MoE layers keep torchtitan's ``AllToAllTokenDispatcher``
(the "standard" backend); each rank wires it an expert-parallel mesh of its own (size 1:
the all-to-all is a copy), so the dispatch and combine exchanges run and zbpipe's
``comm_points="auto"`` finds them. FlexAttention has no backward on CPU: the inner attention is
torchtitan's causal ``ScaledDotProductAttention`` (tests/integrations/_torchtitan_cases.py does
the same). The reference is the whole model, unpipelined, with torchtitan's local dispatch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

SEQ, VOCAB, N_LAYERS = 32, 2048, 4


#: the MoE layers' size here (the debug model's: 64 experts of hidden 768, top 8, 16 heads of
#: 128). What is checked (the dispatchers found, the pairs overlapping at their exchanges, the
#: gradients) does not depend on it; the debug model's size made each rank build, copy and
#: run 150 M parameters four times over (the model, its reference, its two stages' copies).
EXPERTS, TOP_K, MOE_HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64, 4, 2, 32


def qwen3_moe(seed: int) -> torch.nn.Module:
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _debugmodel_moe

    cfg = _debugmodel_moe("flex")
    # its layers rebuilt by torchtitan's own builder, as the debug model builds them, smaller
    cfg.layers = _build_qwen3_moe_layers(
        n_layers=N_LAYERS,
        dim=cfg.dim,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        moe_hidden_dim=MOE_HIDDEN,
        num_experts=EXPERTS,
        top_k=TOP_K,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1000000.0),
    )
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _stage_module(model: torch.nn.Module, stage: int, num_stages: int) -> torch.nn.Module:
    """torchtitan's way of cutting a decoder for pipelining: a copy with the other stages'
    layers deleted and the embedding / norm and head set to None (the decoder passes through)."""
    part = copy.deepcopy(model)
    names = list(model.layers.keys())
    per = len(names) // num_stages
    for name in names[: stage * per] + names[(stage + 1) * per :]:
        del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != num_stages - 1:
        part.norm = part.lm_head = None
    return part


def dualpipev_grads(rank, world, m, seed=0):
    """One step of zbpipe's ScheduleDualPipeV (default arguments) on the pipeline: the largest
    gradient difference from the reference, whether the pairs overlapped, how many points
    ``"auto"`` found, how many pairs the plan has, and whether the points' collectives ran
    (a traced action waited on one)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.utils import set_spmd_backend

    from zbpipe import ScheduleDualPipeV

    set_spmd_backend("partial_dtensor")  # the dispatcher's plain all_to_all_single path
    ce = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))

    def loss_fn(out, target):
        return ce(out, target)[0]

    model = qwen3_moe(seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (m, SEQ + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref = copy.deepcopy(model)
    sum(loss_fn(ref(xi), yi) for xi, yi in zip(x.split(1), y.split(1))).backward()
    pp = dist.new_group([0, 1])
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    ep_mesh = DeviceMesh.from_group(own, "cpu")
    mine = sorted(s for s, r in ScheduleDualPipeV.stage_index_to_rank(world).items() if r == rank)
    parts = {s: _stage_module(model, s, 2 * world) for s in mine}
    for part in parts.values():
        for mod in part.modules():
            dispatcher = getattr(mod, "token_dispatcher", None)
            if dispatcher is not None:
                dispatcher.wire_meshes(ep_mesh=ep_mesh)
    stages = [PipelineStage(parts[s], s, 2 * world, torch.device("cpu"), group=pp) for s in mine]
    sched = ScheduleDualPipeV(stages, m, loss_fn=loss_fn, scale_grads=False)  # as torchtitan
    sched.step(*((x,) if 0 in mine else ()), target=y if 2 * world - 1 in mine else None)
    worst = 0.0
    reference = dict(ref.named_parameters())
    for s, part in parts.items():
        for name, p in part.named_parameters():
            q = reference[name]
            # fp32; the same ops, in another order (the expert-parallel path permutes tokens)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{s} {name}")
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    waited = any(e.waited > 0 for e in sched.tracer.events)
    return worst, sched.overlaps, len(sched._pairs._points), len(sched.plan.pairs), waited
