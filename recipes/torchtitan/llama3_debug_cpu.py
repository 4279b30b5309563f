"""torchtitan 0.3.x config: its llama3 debug model with a zbpipe schedule, on CPU (gloo).

The tests run exactly this file (tests/test_torchtitan_trainer.py); on a laptop:

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
* :func:`use_cpu_device`: torchtitan 0.3.0 has no CPU device: ``torchtitan.tools.utils`` picks
  ``"cuda"`` (and ``torch.cuda``) when no accelerator is found, its modules import those names at
  import time, and its device memory monitor calls CUDA-only functions. The CPU module given
  instead reports no memory statistics (torchtitan logs -1 for them).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import torch

import zbpipe.torchtitan  # noqa: F401  (the integration: registers zbpipe's names, patches torchtitan)


def _cpu_device_module() -> SimpleNamespace:
    # torch.cpu plus the CUDA-only calls torchtitan's Trainer and memory monitor make.
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    base = {k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")}
    return SimpleNamespace(
        **{
            **base,
            "get_device_name": lambda device=None: "cpu",
            "current_device": lambda: 0,
            "device_count": lambda: 1,
            "set_device": lambda device: None,
            "get_device_properties": lambda device=None: SimpleNamespace(total_memory=total),
            "memory_stats": lambda device=None: {},
            "reset_peak_memory_stats": lambda device=None: None,
            "empty_cache": lambda: None,
        }
    )


def use_cpu_device() -> None:
    """Make every loaded torchtitan module see ``device_type = "cpu"`` (CPU runs only)."""
    if torch.accelerator.is_available():
        return
    cpu = _cpu_device_module()
    for name, module in list(sys.modules.items()):
        if not (name.startswith("torchtitan") and isinstance(module, ModuleType)):
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu


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
