"""What a backward pass needs of a torch ``PipelineStage`` before it runs (the stage seam's
checks): that every output needing a gradient received one, and FSDP2's state for one split
backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule


def check_output_grads(stage: Any, mb: int, outputs: Any, grads: Sequence[Any]) -> None:
    """Refuse a backward in which a stage output that requires grad received no gradient.

    torch's receive buffer for an output gradient is None when the stage's metadata says the
    output carries none: typically ``PipelineStage(..., output_args=...)`` given outputs
    computed under ``torch.no_grad()``. torch's fused backward then fails inside autograd;
    zbpipe's engines skip an output without a gradient (an output nothing downstream uses),
    so without this check the stage's weights would silently get no gradient.
    """
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for i, (out, grad) in enumerate(zip(outs, grads)):
        if isinstance(out, torch.Tensor) and out.requires_grad and grad is None:
            raise RuntimeError(
                f"zbpipe: stage {stage.stage_index} microbatch {mb}: output {i} requires grad but "
                "no gradient was received for it (the stage's metadata says output "
                f"{i} has none), so its weights would get no gradient; if you pass output_args= "
                "to PipelineStage, compute them with autograd on (not under torch.no_grad()) or "
                "leave output_args out so torch infers them; if the output should carry no "
                "gradient, return it detached"
            )


def prepare_fsdp(stage: Any, unshard: bool) -> None:
    """Prepare an FSDP2 stage for one split backward pass (B or W) of one microbatch.

    1. No gradient reduction inside a microbatch's B or W: the reduce-scatter of a stage follows
       its LAST W (torch lowers a REDUCE_GRAD action after it, which calls FSDP's post-backward
       once), not its last B. Mirrors what torch's stage does around its own backward. FSDP2's
       own hooks stay harmless: its pre-backward hook (on the stage outputs, so it fires in B
       only) queues a final callback that runs post_backward with sync off (accumulate only).
    2. With ``unshard``, every FSDP module of the stage is unsharded (a no-op when it already
       is). With ``reshard_after_forward=True`` a block is resharded after each forward, and
       FSDP2 then registers the *sharded* DTensor parameters on the module. The graph engine's
       B must collect the unsharded parameters (the leaves of the forward's graph; FSDP2 keeps
       those objects across reshards): collected from a resharded block they are DTensors no
       graph node leads to, and W silently drops their gradients. Its W may also read a weight
       (a weight-norm's grad does) whose storage a later microbatch's forward freed: one
       all-gather per W, the price of ``reshard_after_forward=True`` with the graph engine.
       The deferred engine's W reads no weight (its GEMMs take activations and gradients),
       so it does not unshard. Every dp rank runs the same plan, so collectives match.
    """
    module: torch.nn.Module = stage.submod
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)
    if unshard:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.unshard()
