"""A Linear whose ``forward`` is an instance attribute still defers its weight GEMM.

torchtitan 0.3's ``Module.parallelize()`` stores a closure on the instance that redistributes
the inputs, calls the bound ``forward`` it captured, and redistributes the outputs; the class
swap of ``patch_linears`` alone then changed nothing, and every W ran no GEMM (the gradients
were right, the split was gone). ``Wrapped`` below builds such a closure the same way
(torchtitan's own Trainer runs are in tests/integrations/test_torchtitan_trainer.py).
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn

from zbpipe.engines.deferred import WeightGradStore
from zbpipe.engines.linear_patch import StoreSlot, patch_linears, unpatch_linears


def _local_region(func, *args, **kwargs):
    """What ``local_map`` wraps a function with: a partial of a module-level function."""
    return func(*args, **kwargs)


def _wrap_like_parallelize(lin: nn.Linear, calls: list[str], local_map: bool = False) -> None:
    fn = lin.forward  # the bound method, captured before anyone patches the class
    if local_map:  # torchtitan's _maybe_wrap_with_local_region with a local_map config
        fn = functools.partial(_local_region, fn)

    def forward_with_redistribution(*args, **kwargs):
        calls.append("in")
        out = fn(*args, **kwargs)
        calls.append("out")
        return out

    lin.forward = forward_with_redistribution


def _b_then_w(model: nn.Module, slot: StoreSlot, x: torch.Tensor) -> int:
    store = WeightGradStore()
    slot.store = store
    try:
        out = model(x)
        store.deferring = True
        out.pow(2).sum().backward()
    finally:
        slot.store, store.deferring = None, False
    queued = store.num_gemms
    store.run()
    return queued


@pytest.mark.parametrize("local_map", [False, True])
def test_an_instance_level_forward_defers_and_unpatching_restores_it(local_map):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    calls: list[str] = []
    for lin in (model[0], model[2]):
        _wrap_like_parallelize(lin, calls, local_map)
    slot = StoreSlot()
    assert patch_linears(model, slot) == 2
    copy.deepcopy(model)  # a patched module stays copyable (nothing unpicklable stored on it)
    x = torch.randn(5, 8)
    assert _b_then_w(model, slot, x) == 2  # both weight GEMMs waited for W
    assert calls == ["in", "out"] * 2  # the wrapper still runs around the deferred forward
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert unpatch_linears(model) == 2
    assert _b_then_w(model, slot, x) == 0  # ordinary Linears again, wrappers kept
    assert calls == ["in", "out"] * 4


def test_an_instance_forward_zbpipe_cannot_see_into_is_logged_and_stays_correct(caplog):
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    ref = copy.deepcopy(lin)
    lin.forward = lambda x: nn.functional.linear(x, lin.weight, lin.bias)  # no bound forward
    slot = StoreSlot()
    with caplog.at_level(logging.WARNING, logger="zbpipe.engines.linear_patch"):
        patch_linears(lin, slot)
    assert "instance-level forward" in caplog.text
    x = torch.randn(5, 8)
    assert _b_then_w(lin, slot, x) == 0  # computed in B
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
