"""torchtitan 0.3.x config: its MoE debug models with a zbpipe schedule, on CPU (gloo).

The tests run exactly this file (tests/integrations/test_torchtitan_moe_trainer.py); on a laptop:

    PYTHONPATH=recipes/torchtitan torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module moe_debug_cpu --config qwen3_moe_debug_cpu \\
        --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBV

Importing this module imports ``zbpipe.torchtitan`` (on every rank), which registers zbpipe's
schedule names. Everything else is torchtitan's: Qwen3's ``qwen3_moe_debug`` (64 routed experts,
top-8, experts through ``torch._grouped_mm``; auxiliary-loss-free load balancing by an expert
bias) and DeepSeek-V3's ``debugmodel`` (8 routed experts, top-3, two shared experts, one dense
layer first; the same balancing), each with its optimizer, loss, LR schedule, selective
activation checkpointing and dataloader, with the two changes CPU forces (as
``llama3_debug_cpu.py``): attention through torchtitan's causal ``ScaledDotProductAttention``
(FlexAttention has no backward on CPU) and :func:`torchtitan_cpu.use_cpu_device`.

Smaller ones for CI, all else unchanged: ``qwen3_moe_debug_2_layers_cpu`` keeps the first 2 of
Qwen3's 8 MoE layers (its 64 experts make each layer the cost of a step on CPU: with PP = 2 a V
schedule then gives each layer a stage of its own, the embedding and the head the other two),
``deepseek_v3_debugmodel_4_layers_cpu`` the first 4 of DeepSeek-V3's 6 (its dense layer and 3
MoE layers).
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan_cpu import use_cpu_device, use_gloo_reductions

import zbpipe.torchtitan  # noqa: F401  (the integration: registers zbpipe's names, patches torchtitan)


def _on_cpu(config: Any, layers: int | None = None) -> Any:
    """``config`` with SDPA attention where there is no accelerator, and its first ``layers``
    layers only (all of them: None)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    use_cpu_device()
    use_gloo_reductions()  # expert parallelism on CPU shards the experts with FSDP over gloo
    model = config.model_spec.model
    if layers is not None:
        model.layers = model.layers[:layers]
    if not torch.accelerator.is_available():  # FlexAttention has no backward on CPU
        for layer in model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def qwen3_moe_debug_cpu() -> Any:
    """torchtitan's Qwen3 ``qwen3_moe_debug`` on CPU."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    return _on_cpu(qwen3_moe_debug())


def deepseek_v3_debugmodel_cpu() -> Any:
    """torchtitan's DeepSeek-V3 ``deepseek_v3_debugmodel`` on CPU."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    return _on_cpu(deepseek_v3_debugmodel())


def qwen3_moe_debug_2_layers_cpu() -> Any:
    """``qwen3_moe_debug_cpu`` with its first 2 of 8 layers."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    return _on_cpu(qwen3_moe_debug(), layers=2)


def deepseek_v3_debugmodel_4_layers_cpu() -> Any:
    """``deepseek_v3_debugmodel_cpu`` with its first 4 of 6 layers (the dense one first)."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    return _on_cpu(deepseek_v3_debugmodel(), layers=4)
