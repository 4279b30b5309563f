"""Compiled Linears keep their split under saved-tensor hooks around the forward.

zbpipe's memory probe and meter (and torch's ``save_on_cpu``) pack every tensor a microbatch's
forward saves. For a compiled region autograd then hands the compiled backward a new tensor
object for each saved weight, sharing the parameter's memory: found by identity, its route was
missed, so the weight GEMM ran in B (the probe measured nothing waiting for W, and the default
re-plan planned compiled stages for the wrong bytes). The route is found by the weight's address
too, and W adds into the parameter's own ``.grad``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.engines._compile_cases import MLPBlock
from zbpipe.engines.compiled_linear import route_compiled_linears
from zbpipe.engines.deferred import WeightGradStore
from zbpipe.engines.linear_patch import StoreSlot, patch_linears, patched_linears


def _identity_hooks() -> Any:
    # what zbpipe's SavedTensors does with a parameter: hand the very tensor back
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _cpu_hooks() -> Any:
    return torch.autograd.graph.save_on_cpu()


def _compiled_block_and_reference() -> tuple[Any, ...]:
    """A patched MLP block compiled (aot_eager) with its Linears routed, an eager reference
    copy after one backward, the input and output gradient, the slot, the routes' nodes."""
    torch.manual_seed(0)
    block = MLPBlock()
    ref = copy.deepcopy(block)
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    ref(x).backward(g)
    slot = StoreSlot()
    patch_linears(block, slot)
    block.compile(fullgraph=True, backend="aot_eager")
    nodes = route_compiled_linears(block, patched_linears(block))
    return block, ref, x, g, slot, nodes


@pytest.mark.parametrize("hooks", [_identity_hooks, _cpu_hooks], ids=["identity", "save_on_cpu"])
def test_compiled_linears_defer_their_gemms_under_saved_tensor_hooks(hooks: Callable[[], Any]):
    block, ref, x, g, slot, nodes = _compiled_block_and_reference()  # noqa: F841 (nodes kept)
    store = WeightGradStore()
    slot.store = store
    try:
        with hooks():
            out = block(x)
        store.deferring = True
        out.backward(g)
    finally:
        slot.store, store.deferring = None, False
    assert store.num_gemms == 2  # both weight GEMMs wait for W
    assert block.up.weight.grad is None and block.down.weight.grad is None
    store.run()
    for (name, p), q in zip(block.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_leaf_on_a_parameters_memory_keeps_its_own_gradient():
    # A weight version's leaf (ScheduleContinuous's 2bw/stash) may share a parameter's memory
    # but is not that parameter: its gradient must reach the leaf, never the parameter.
    block, ref, x, g, slot, nodes = _compiled_block_and_reference()  # noqa: F841 (nodes kept)
    leaf = block.up.weight.detach().requires_grad_()  # same memory, its own .grad
    store = WeightGradStore()
    slot.store = store
    try:
        out = torch.func.functional_call(block, {"up.weight": leaf}, (x,))
        store.deferring = True
        out.backward(g)
    finally:
        slot.store, store.deferring = None, False
    store.run()
    assert block.up.weight.grad is None
    torch.testing.assert_close(leaf.grad, ref.up.weight.grad, rtol=1e-5, atol=1e-6)
