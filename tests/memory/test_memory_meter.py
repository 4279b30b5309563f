"""SavedActivationMeter against tensors counted by hand (no processes, no schedule).

A custom autograd.Function saves exactly three tensors of distinct sizes, so every expected byte
count below is a sum of those sizes worked out in the test. B and W are played by releasing the
holders the way zbpipe's split backward does (``Holder.release``); "never freed" keeps the graph.
"""

import contextlib
import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from zbpipe.memory import SavedActivationMeter
from zbpipe.memory.saved import SavedTensors, param_storages

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


def _lifetimes(hooked: bool, backward: bool) -> tuple[list[list[bool]], int]:
    """Which activations of a small net are alive after the forward and after the graph is done
    with (a backward, or the loss dropped), with or without the meter's saved-tensor hooks.

    The activations are every module output (weakly referenced by storage); Tanh saves its own
    output, GELU and LayerNorm their inputs, the Linears theirs. The meter's ``SavedTensors``
    stays referenced throughout, as the stage seam keeps it until B or W.
    """
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 4),
    )
    refs = []
    for mod in net:
        mod.register_forward_hook(lambda m, i, o: refs.append(StorageWeakRef(o.untyped_storage())))
    meter = SavedActivationMeter()
    saved = SavedTensors(observer=meter, skip=param_storages(net.parameters()))
    with saved.hooks() if hooked else contextlib.nullcontext():
        loss = net(torch.randn(5, 8)).pow(2).sum()
    gc.collect()
    alive = [[not r.expired() for r in refs]]
    if backward:
        loss.backward()  # retain_graph=False: autograd frees each node's saved tensors
    del loss
    gc.collect()
    alive.append([not r.expired() for r in refs])
    live = meter.live_bytes
    assert saved is not None  # referenced until here
    return alive, live


def test_the_meter_changes_no_lifetime():
    """Saved tensors die when autograd lets them go, meter or not: after a fused backward, or
    when the graph is dropped unused (a holder keeping the tensor itself was a reference cycle
    through the graph: the first Tanh output below, saved by its own node, never died)."""
    gc.freeze()  # what exists now is out of the way: the collections below take milliseconds
    try:
        runs = [
            (backward, _lifetimes(False, backward), _lifetimes(True, backward))
            for backward in (True, False)
        ]
    finally:
        gc.unfreeze()
    for backward, (plain, _), (metered, live) in runs:
        assert metered == plain, f"backward={backward}: {metered} != {plain}"
        assert not any(plain[1]), "the reference itself kept an activation"
        assert live == 0, f"backward={backward}: the meter still counts {live} bytes"
