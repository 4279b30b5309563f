"""SavedActivationMeter against tensors counted by hand (no processes, no schedule).

A custom autograd.Function saves exactly three tensors of distinct sizes, so every expected byte
count below is a sum of those sizes worked out in the test. B and W are played by releasing the
holders the way zbpipe's split backward does (``Holder.release``); "never freed" keeps the graph.
"""

import gc

import torch

from zbpipe.memory import SavedActivationMeter
from zbpipe.saved import SavedTensors

# Distinct powers of two: any sum identifies which tensors are alive.
FREED_AT_B, FREED_AT_W, NEVER_FREED = 1024, 4096, 16384  # bytes (float32: 256, 1024, 4096 elements)


class SavesThree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, c):
        ctx.save_for_backward(a, b, c)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None, None, None


def fresh(nbytes):
    return torch.zeros(nbytes // 4)  # its own storage, so the meter sees three storages


def forward_one_microbatch(meter):
    """One microbatch's forward under zbpipe's saved-tensor hooks; returns (output, holders)."""
    saved = SavedTensors(observer=meter)
    x = torch.ones(4, requires_grad=True)
    with saved.hooks():
        y = SavesThree.apply(x, fresh(FREED_AT_B), fresh(FREED_AT_W), fresh(NEVER_FREED))
    return y, saved.holders


def test_one_microbatch_per_step_b_w_and_a_leak():
    meter = SavedActivationMeter()
    kept = []  # the graphs holding the never-freed tensor, one per step
    for step in range(3):
        meter.begin_step()
        y, (at_b, at_w, never) = forward_one_microbatch(meter)
        assert meter.peak_bytes == FREED_AT_B + FREED_AT_W + NEVER_FREED
        at_b.release()  # B frees the activation-only tensor
        assert meter.live_bytes == step * NEVER_FREED + FREED_AT_W + NEVER_FREED
        at_w.release()  # W frees what the weight gradient needed
        kept.append((y, never))  # never released: alive after the step
        s = meter.end_step()
        # The peak is this step's own: earlier steps' leftovers do not raise it.
        assert s.peak_bytes == FREED_AT_B + FREED_AT_W + NEVER_FREED
        assert s.retained_bytes == NEVER_FREED  # the per-step growth
        assert s.carried_bytes == step * NEVER_FREED
        assert meter.live_bytes == (step + 1) * NEVER_FREED


def test_a_freed_graph_frees_its_saved_tensors():
    # A fused backward (or dropping the graph) frees the holders without anyone calling release().
    meter = SavedActivationMeter()
    meter.begin_step()
    y, holders = forward_one_microbatch(meter)
    del y, holders
    gc.collect()
    s = meter.end_step()
    assert s.peak_bytes == FREED_AT_B + FREED_AT_W + NEVER_FREED
    assert s.retained_bytes == 0 and meter.live_bytes == 0


def test_leftover_freed_in_a_later_step_does_not_lower_that_steps_peak():
    meter = SavedActivationMeter()
    meter.begin_step()
    _, (a, b, c) = forward_one_microbatch(meter)
    a.release(), b.release()  # c carries into step 2
    meter.begin_step()
    c.release()  # freed during step 2: step 2's own count must not go negative
    held = forward_one_microbatch(meter)  # noqa: F841 (its graph and holders stay alive)
    s = meter.end_step()
    assert s.carried_bytes == NEVER_FREED
    assert s.peak_bytes == FREED_AT_B + FREED_AT_W + NEVER_FREED
    assert s.retained_bytes == FREED_AT_B + FREED_AT_W + NEVER_FREED  # a2, b2, c2 still held


def test_a_storage_saved_twice_counts_once_and_parameters_not_at_all():
    meter = SavedActivationMeter()
    w = torch.nn.Parameter(torch.ones(1024))
    t = fresh(FREED_AT_W)
    saved = SavedTensors(observer=meter, skip={w.untyped_storage().data_ptr()})
    x = torch.ones(4, requires_grad=True)
    meter.begin_step()
    with saved.hooks():
        SavesThree.apply(x, t, t[:16], w)  # t, a view of t, and a parameter
    assert meter.peak_bytes == FREED_AT_W
    saved.release_all()
    assert meter.live_bytes == 0
