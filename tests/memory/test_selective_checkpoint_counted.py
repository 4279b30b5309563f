"""What selective activation checkpointing keeps is counted, from the forward until freed.

torch's ``create_selective_checkpoint_contexts`` keeps the outputs its policy saves in a cache
of the region's own, not through saved-tensor hooks. The region here is ``relu(x @ A) @ B``
with distinct shapes: the policy saves both matmuls' outputs (R x H and R x K floats), the
region's input x (R x D) is what non-reentrant checkpointing itself saves (through the hooks),
and everything else is recomputed in the backward. The expected bytes are those sizes, worked
out in the test.
"""

from __future__ import annotations

import gc
from functools import partial

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from zbpipe.memory import SavedActivationMeter
from zbpipe.memory.saved import SavedTensors, param_storages

R, D, H, K = 4, 8, 32, 16  # rows, input width, hidden, output width


def _save_matmuls(ctx, op, *args, **kwargs):
    saved = op in (torch.ops.aten.mm.default,)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _region(x, a, b):
    return torch.relu(x @ a) @ b


def _forward(meter, selective: bool):
    torch.manual_seed(0)
    a = torch.randn(D, H, requires_grad=True)
    b = torch.randn(H, K, requires_grad=True)
    x = torch.randn(R, D, requires_grad=True)
    ctx = partial(create_selective_checkpoint_contexts, _save_matmuls)
    kwargs = {"context_fn": ctx} if selective else {}
    saved = SavedTensors(observer=meter, skip=param_storages([a, b]))
    with saved.hooks():
        y = checkpoint(_region, x, a, b, use_reentrant=False, **kwargs)
    return y, (x, a, b)


def test_the_policys_saved_outputs_count_until_the_backward_frees_them():
    meter = SavedActivationMeter()
    meter.begin_step()
    y, leaves = _forward(meter, selective=True)
    # x (checkpoint's own saved input) + x @ A (R x H) + relu(.) @ B (R x K), float32
    expected = 4 * (R * D + R * H + R * K)
    assert meter.live_bytes == expected
    y.sum().backward()
    del y
    gc.collect()
    assert meter.live_bytes == 0  # the recompute took them from the cache; the backward freed them
    assert all(t.grad is not None for t in leaves)


def test_full_checkpointing_counts_only_the_regions_input():
    meter = SavedActivationMeter()
    meter.begin_step()
    y, _ = _forward(meter, selective=False)
    assert meter.live_bytes == 4 * R * D
    del y
    gc.collect()
    assert meter.live_bytes == 0


def test_the_cache_is_not_watched_outside_the_hooks():
    meter = SavedActivationMeter()
    ctx = partial(create_selective_checkpoint_contexts, _save_matmuls)
    x = torch.randn(R, D, requires_grad=True)
    a, b = torch.randn(D, H), torch.randn(H, K)
    with SavedTensors(observer=meter).hooks():
        pass
    y = checkpoint(_region, x, a, b, use_reentrant=False, context_fn=ctx)
    assert meter.live_bytes == 0
    del y
