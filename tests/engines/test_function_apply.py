"""``_compat.autograd_function_apply``: ``Fn.apply`` without torch's Python wrapper, the same
Function either way (the deferred engine's patched Linears call it once per Linear in every F).

The reference is ``Fn.apply`` itself, called in the test on the same inputs.
"""

import pytest
import torch

from zbpipe import _compat as C


class Scale(torch.autograd.Function):
    """y = x * w, no setup_context (the shape of the deferred engine's Linear Function)."""

    @staticmethod
    def forward(ctx, x, w, tag):
        ctx.save_for_backward(x, w)
        ctx.tag = tag
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0), None


class ScaleWithSetup(torch.autograd.Function):
    @staticmethod
    def forward(x, w, k=2.0):
        return x * w * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, k = inputs
        ctx.save_for_backward(x, w)
        ctx.k = k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * ctx.k, (g * x * ctx.k).sum(0), None


def _run(apply, cls_args):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = apply(x, w, *cls_args)
    y.backward(torch.ones_like(y))
    return y, x.grad, w.grad


@pytest.mark.parametrize(
    "cls, extra", [(Scale, ("tag",)), (ScaleWithSetup, ()), (ScaleWithSetup, (3.0,))]
)
def test_outputs_gradients_and_node_are_fn_apply_s(cls, extra):
    fast = C.autograd_function_apply(cls)
    got, ref = _run(fast, extra), _run(cls.apply, extra)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    y = fast(torch.ones(2, 4, requires_grad=True), torch.ones(4), *extra)
    assert type(y.grad_fn) is cls._backward_cls


def test_a_dead_functorch_wrapper_is_unwrapped_as_fn_apply_does():
    leaked = []

    def f(t):
        leaked.append(t)
        return t.sum()

    torch.func.grad(f)(torch.ones(4))
    dead = leaked[0]  # a tensor that escaped the transform: its level is gone
    w = torch.full((4,), 2.0, requires_grad=True)
    fast = C.autograd_function_apply(Scale)(dead, w, "tag")
    ref = Scale.apply(dead, w, "tag")
    assert torch.equal(fast, ref) and type(fast) is type(ref)


def test_under_a_functorch_transform_it_behaves_as_fn_apply():
    fast = C.autograd_function_apply(Scale)

    def outcome(apply):
        try:
            return torch.func.vmap(lambda x: apply(x, torch.ones(4), "tag"))(torch.ones(2, 4))
        except RuntimeError as e:  # a Function without setup_context under a transform
            return type(e), str(e)

    got, ref = outcome(fast), outcome(Scale.apply)
    if isinstance(ref, torch.Tensor):
        assert torch.equal(got, ref)
    else:
        assert got == ref


@pytest.mark.parametrize(
    "owner, name", C.PRIVATE_AUTOGRAD_NAMES, ids=[n for _, n in C.PRIVATE_AUTOGRAD_NAMES]
)
def test_the_private_autograd_names_exist(owner, name):
    import importlib

    parts = owner.split(".")
    obj = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    assert hasattr(obj, name) or name in getattr(obj, "__dict__", {}), f"{owner}.{name}"


def test_keyword_arguments_take_torchs_path():
    """A keyword argument goes to ``Fn.apply`` (torch 2.13 binds it; the C++ entry takes none;
    torch 2.11 refuses it, and so must the helper)."""
    try:
        ref = _run(lambda x, w: Scale.apply(x, w, tag="t"), ())
    except TypeError:
        with pytest.raises(TypeError):
            _run(lambda x, w: C.autograd_function_apply(Scale)(x, w, tag="t"), ())
        return
    ours = _run(lambda x, w: C.autograd_function_apply(Scale)(x, w, tag="t"), ())
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_traced_by_dynamo_as_fn_apply_with_fullgraph():
    """Under torch.compile the helper calls ``Fn.apply``, which dynamo traces (it skips the C++
    entry point: a graph break, an error under fullgraph=True on torch 2.11)."""
    apply = C.autograd_function_apply(Scale)
    compiled = torch.compile(lambda x, w: apply(x, w, None), backend="eager", fullgraph=True)
    ours = _run(lambda x, w, _tag: compiled(x, w), (None,))
    ref = _run(Scale.apply, (None,))
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
