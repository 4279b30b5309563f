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


_HOOKS = {"identity": _identity_hooks, "save_on_cpu": _cpu_hooks}


def _dtensor_case(rank: int, world: int, hooks: str | None, leaf: bool) -> dict[str, Any]:
    """The block with replicated DTensor parameters (torchtitan 0.3's), ``hooks`` around F or a
    leaf on ``up.weight``'s memory in its place; what B queued, which ``.grad`` W filled, and
    the worst difference from the plain eager reference."""
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    block = MLPBlock()
    ref = copy.deepcopy(block)
    for sub in block.modules():
        for name, p in list(sub._parameters.items()):
            dt = distribute_tensor(p.detach(), mesh, [Replicate()])
            sub._parameters[name] = torch.nn.Parameter(dt)
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    ref(x).backward(g)
    slot = StoreSlot()
    patch_linears(block, slot)
    block.compile(fullgraph=True, backend="aot_eager")
    nodes = route_compiled_linears(block, patched_linears(block))  # noqa: F841 (kept)
    x_d, g_d = (distribute_tensor(t, mesh, [Replicate()]) for t in (x, g))
    version = block.up.weight.detach().requires_grad_() if leaf else None
    store = WeightGradStore()
    slot.store = store
    try:
        with _HOOKS[hooks]() if hooks else nullcontext():
            if version is not None:
                out = torch.func.functional_call(block, {"up.weight": version}, (x_d,))
            else:
                out = block(x_d)
        store.deferring = True
        out.backward(g_d)
    finally:
        slot.store, store.deferring = None, False
    queued, none_after_b = store.num_gemms, block.down.weight.grad is None
    store.run()
    grads = {name: p.grad for name, p in block.named_parameters()}
    if version is not None:
        grads["up.weight"] = version.grad
    return {
        "queued": queued,
        "down_none_after_b": none_after_b,
        "up_param_grad": block.up.weight.grad is not None,
        "diff": max(
            (grads[name].full_tensor() - q.grad).abs().max().item()
            for name, q in ref.named_parameters()
        ),
    }


#: the one-rank DTensor cases: (hooks, leaf)
_DTENSOR_CASES = [("identity", False), ("save_on_cpu", False), (None, True)]


def _dtensor_cases(rank: int, world: int, todo: list[tuple[str | None, bool]]) -> list[dict]:
    """Each of ``todo`` as :func:`_dtensor_case`, in one process (starting it and warming dynamo
    up is most of a case's cost); dynamo reset before each, so each compiles its own graph as
    in a process of its own."""
    out = []
    for hooks, leaf in todo:
        torch.compiler.reset()
        out.append(_dtensor_case(rank, world, hooks, leaf))
    return out


@pytest.fixture(scope="module")
def dtensor_found() -> dict[tuple[str | None, bool], dict[str, Any]]:
    from zbpipe.testing import run_ranks

    (found,) = run_ranks(_dtensor_cases, 1, _DTENSOR_CASES, timeout=300)
    return dict(zip(_DTENSOR_CASES, found, strict=True))


@pytest.mark.parametrize("hooks", list(_HOOKS))
def test_dtensor_weights_defer_their_gemms_under_saved_tensor_hooks(dtensor_found, hooks: str):
    # A DTensor's local shard needs no gradient: autograd hands the compiled backward the saved
    # shard itself under hooks too, and the route is found by its identity.
    found = dtensor_found[hooks, False]
    assert found["queued"] == 2 and found["down_none_after_b"], found
    assert found["diff"] < 1e-5, found


def test_a_dtensor_leaf_on_a_parameters_local_memory_keeps_its_own_gradient(dtensor_found):
    # As above for plain parameters: the version's local shard shares the parameter's memory
    # but is another object; its gradient is computed in B and reaches the version only.
    found = dtensor_found[None, True]
    assert found["queued"] == 1, found  # down's GEMM waits; the version's ran in B
    assert not found["up_param_grad"], found
    assert found["diff"] < 1e-5, found


@pytest.mark.parametrize("hooks", [None, "identity"])
def test_a_parameter_put_on_a_routed_linear_later_defers_its_gemm(hooks: str | None):
    # FSDP2 routes look like this: routing saw the sharded parameter, and around forward and
    # backward FSDP2 puts another Parameter (its unsharded one, the same object every time) on
    # the Linear. Compiled code hands the op that one (or, under saved-tensor hooks, an alias of
    # it, met before the parameter itself): its GEMM waits for W, which adds into its .grad.
    from contextlib import nullcontext

    block, ref, x, g, slot, nodes = _compiled_block_and_reference()  # noqa: F841 (nodes kept)
    swapped = {}
    for name in ("up", "down"):
        lin = block.get_submodule(name)
        swapped[name] = torch.nn.Parameter(lin.weight.detach().clone())
        lin._parameters["weight"] = swapped[name]  # as FSDP2 registers its unsharded one
    for mb in range(2):  # the second microbatch finds the new routes without a scan
        store = WeightGradStore()
        slot.store = store
        try:
            with _HOOKS[hooks]() if hooks else nullcontext():
                out = block(x)
            store.deferring = True
            out.backward(g)
        finally:
            slot.store, store.deferring = None, False
        assert store.num_gemms == 2
        if mb == 0:  # W adds the gradients
            assert swapped["up"].grad is None and swapped["down"].grad is None
        store.run()
    for name, p in swapped.items():
        torch.testing.assert_close(p.grad, 2 * ref.get_submodule(name).weight.grad, msg=name)


def test_a_stand_in_keeps_its_hook_when_the_linears_are_routed_again():
    # FSDP2 puts its sharded parameters back between steps, so a second schedule built on the
    # same modules routes the sharded ones again. The unsharded stand-in's hooked AccumulateGrad
    # node was kept only by the replaced route: it died, the stand-in kept its route, and its
    # placeholders (uninitialized after the first) reached .grad: gradients of 1e36. Routing a
    # Linear again now drops its stand-in, which is routed afresh, with a hook, when next met.
    import gc

    from zbpipe.engines.compiled_linear import route_compiled_linears
    from zbpipe.engines.linear_patch import patched_linears

    block, ref, x, g, slot, nodes = _compiled_block_and_reference()
    sharded = {n: block.get_submodule(n).weight for n in ("up", "down")}
    unsharded = {n: torch.nn.Parameter(p.detach().clone()) for n, p in sharded.items()}

    def put(which: dict) -> None:
        for n, p in which.items():
            block.get_submodule(n)._parameters["weight"] = p

    def step() -> None:
        store = WeightGradStore()
        slot.store = store
        try:
            put(unsharded)  # FSDP2's unshard
            out = block(x)
            store.deferring = True
            out.backward(g)
        finally:
            slot.store, store.deferring = None, False
            put(sharded)  # and its reshard after the step
        assert store.num_gemms == 2
        assert all(p.grad is None for p in unsharded.values())  # W adds them
        store.run()

    held = [nodes]  # each schedule keeps its routing's nodes
    for again in (False, True, True):  # the second step learns the placeholders arrive alone
        if again:
            held.append(route_compiled_linears(block, patched_linears(block)))  # a new schedule
            gc.collect()
        for p in unsharded.values():
            p.grad = None
        step()
        for name, p in unsharded.items():
            torch.testing.assert_close(p.grad, ref.get_submodule(name).weight.grad, msg=name)
