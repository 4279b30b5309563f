"""torchtitan 0.3.x config: its llama3 debug model with a zbpipe schedule, on CPU (gloo).

The tests run exactly this file (tests/integrations/test_torchtitan_trainer.py); on a laptop:

    PYTHONPATH=recipes/torchtitan torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module llama3_debug_cpu --config llama3_debugmodel_cpu \\
        --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBV

Importing this module imports ``zbpipe.torchtitan`` (on every rank: torchrun starts each rank
with the same ``--module``), which registers zbpipe's schedule names. Everything else is
torchtitan's ``llama3_debugmodel`` (model, optimizer, loss, LR schedule, selective activation
checkpointing, dataloader), with two changes CPU forces:

* attention through torchtitan's own ``ScaledDotProductAttention`` (causal): the debug model's
  FlexAttention has no backward on CPU, and torchtitan 0.3.0 refuses ``attn_backend="sdpa"``
  for language models, so the inner attention module's config is swapped after the model config
  is built (the rest of the model is untouched). Unlike FlexAttention's document mask, causal
  SDPA attends across the packed documents of a sequence; the reference runs do the same;
* :func:`torchtitan_cpu.use_cpu_device`: torchtitan 0.3.0 has no CPU device and would ask CUDA
  for one (``torchtitan_cpu.py``, shared with the torchtitan 0.2.x recipe, says what changes).
"""

from __future__ import annotations

import torch
from torchtitan_cpu import use_cpu_device

import zbpipe.torchtitan  # noqa: F401  (the integration: registers zbpipe's names, patches torchtitan)


def llama3_debugmodel_cpu():
    """torchtitan's llama3 debug model on CPU; choose the schedule with
    ``--parallelism.pipeline_parallel_schedule`` (ZBV, ZBH1, ZBVHalf... or torch's names)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    use_cpu_device()
    config = llama3_debugmodel()
    if not torch.accelerator.is_available():  # FlexAttention has no backward on CPU
        for layer in config.model_spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config
