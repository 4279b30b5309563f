"""Run torchtitan (0.2.x and 0.3.x) on a machine without an accelerator: CPU ranks, gloo.

torchtitan has no CPU device: ``torchtitan.tools.utils`` picks ``device_type = "cuda"`` (and
``device_module = torch.cuda``) when no accelerator is found, its modules import those two
names at import time, its Trainer calls ``device_module.set_device`` and its device memory
monitor calls CUDA-only functions. :func:`use_cpu_device` rebinds both names, in every loaded
torchtitan module, to ``"cpu"`` and a ``torch.cpu`` namespace that answers those calls (memory
statistics then read -1 in torchtitan's log). With an accelerator it does nothing.

Used by ``llama3_debug_cpu.py`` (torchtitan 0.3.x config module) and
``zbpipe_torchtitan_cpu.py`` (torchtitan 0.2.x ``custom_import``).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import torch


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


def use_gloo_reductions() -> None:
    """Make FSDP2 reduce gradients with plain sums, the reductions gloo has (CPU runs only).

    torchtitan 0.3 turns FSDP's gradient division off (``gradient_divide_factor=1.0``: it scales
    by the global token count itself); FSDP then reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``,
    which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo") as soon as a data-parallel
    or expert-parallel mesh has two ranks. ``set_force_sum_reduction_for_comms(True)`` makes FSDP
    sum and multiply by that same factor after the reduction instead: the same gradients. With
    an accelerator it does nothing.
    """
    if torch.accelerator.is_available():
        return
    from torchtitan.distributed import fsdp

    original = fsdp.disable_fsdp_gradient_division
    if getattr(original, "__wrapped__", None) is not None:
        return

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_fsdp_gradient_division.__wrapped__ = original  # type: ignore[attr-defined]
    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
