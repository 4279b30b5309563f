"""Every private torch name zbpipe relies on exists, with the parameters zbpipe passes, and
zbpipe uses no other.

``zbpipe._compat`` lists them (``PRIVATE_API``, ``PRIVATE_SCHEDULE_ATTRIBUTES``,
``TORCH_INTERNAL_ATTRIBUTES``, ``PRIVATE_OBJECT_ATTRIBUTES``); a torch upgrade that renames one
fails here, naming it, instead of deep inside a pipeline step. The census tests scan zbpipe's
source: a private torch name outside ``_compat`` that zbpipe's schedules do not inherit fails
them. CI runs this file on torch 2.11, 2.13 and 2.14.
"""

import ast
import inspect
import pathlib
import re

import pytest
import torch
import torch.distributed.pipelining as pipelining
import torch.distributed.pipelining.schedules as torch_schedules

from zbpipe import _compat as C

SRC = pathlib.Path(C.__file__).parents[1]  # src/zbpipe (C is the package src/zbpipe/_compat)
PIPELINING = pathlib.Path(pipelining.__file__).parent


@pytest.mark.parametrize(
    "owner, name, params",
    C.PRIVATE_API,
    ids=[f"{o.__name__ if o else 'schedules'}.{n}" for o, n, _ in C.PRIVATE_API],
)
def test_private_name_exists_with_the_parameters_zbpipe_passes(owner, name, params):
    obj = getattr(owner if owner is not None else torch_schedules, name, None)
    assert obj is not None, f"torch no longer has {name}: update zbpipe._compat"
    accepted = inspect.signature(obj).parameters
    missing = [p for p in params if p not in accepted]
    assert not missing, f"{name} no longer takes {missing}: update zbpipe._compat"


def test_private_schedule_attributes_are_set_by_torch():
    source = inspect.getsource(torch_schedules)
    for attr in C.PRIVATE_SCHEDULE_ATTRIBUTES:
        assert re.search(rf"self\.{attr}\b\s*[:=]", source), f"torch no longer sets {attr}"


@pytest.mark.parametrize(
    "module, attr", C.TORCH_INTERNAL_ATTRIBUTES, ids=[a for _, a in C.TORCH_INTERNAL_ATTRIBUTES]
)
def test_torch_internal_attributes_are_set_by_torch(module, attr):
    source = (PIPELINING / f"{module}.py").read_text()
    assert re.search(rf"self\.{attr}\b\s*(:[^=\n]+)?=", source), (
        f"torch's pipelining/{module}.py no longer sets {attr}: update zbpipe._compat"
    )


def test_no_private_torch_import_outside_compat():
    """Modules import torch's private names through zbpipe._compat only."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if "_compat" in path.relative_to(SRC).parts:
            continue
        for line in path.read_text().splitlines():
            if (
                re.match(r"\s*from torch[\w.]* import .*\b_[a-zA-Z]", line)
                or re.search(r"torch\.[\w.]*\._[a-z]\w*\.", line)
                or re.search(r"(?<![`\w.])torch\._[a-z]\w*\(", line)  # a private op called
            ):
                offenders.append(f"{path.name}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.parametrize(
    "module, name, params", C.PRIVATE_OPS, ids=[n for _, n, _ in C.PRIVATE_OPS]
)
def test_private_operators_exist_and_take_what_zbpipe_passes(module, name, params):
    # builtins have no signature to read: call them as zbpipe's helper does
    op = getattr(__import__(module), name, None)
    assert op is not None, f"{module} no longer has {name}: update zbpipe._compat.ops"
    assert params == ("offs",)
    a, b = torch.randn(6, 8), torch.randn(2, 8, 4)
    out = C.grouped_mm(a, b, torch.tensor([2, 6], dtype=torch.int32))
    assert torch.equal(out, torch.cat([a[:2] @ b[0], a[2:] @ b[1]]))


# ---------------------------------------------------------------- the census, zbpipe's side
def _torch_private_names() -> set[str]:
    """The private names torch defines on what zbpipe touches: pipelining's classes and
    functions and the attributes its classes set on ``self``; ``nn.Module``'s; a tensor's, an
    autograd node's and an optimizer's; a DTensor's."""
    names: set[str] = set()
    sources = [p.read_text() for p in PIPELINING.glob("*.py")]
    sources.append(inspect.getsource(torch.nn.Module))
    for text in sources:
        names |= set(re.findall(r"^\s*(?:def|class) (_[A-Za-z]\w*)", text, re.M))
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=(?!=)", text))
    from torch.distributed.tensor import DTensor

    # the module that defines DTensor: the attributes it sets on the tensors it makes
    dtensor = pathlib.Path(inspect.getfile(DTensor.from_local)).read_text()
    names |= set(re.findall(r"^\s*(?:def|class) (_[A-Za-z]\w*)", dtensor, re.M))
    names |= set(re.findall(r"\b\w+\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=(?!=)", dtensor))
    x = torch.ones(1, requires_grad=True)
    module = torch.nn.Linear(1, 1)  # instances: nn.Module sets some attributes by __setattr__
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for obj in (x, (x * 2).grad_fn, module, optimizer):
        names |= {n for n in dir(obj) if n.startswith("_") and not n.startswith("__")}
    return names


def _zbpipe_modules_outside_compat() -> list[pathlib.Path]:
    # zbpipe.planning is left out: it never imports torch (tests/planning/test_plan_torch_free.py).
    return sorted(
        p for p in SRC.rglob("*.py") if not {"_compat", "planning"} & set(p.relative_to(SRC).parts)
    )


def _names_used(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every attribute read, written or deleted (except on the ``_compat``
    module), every method defined in a class body (an override) and every identifier-like string
    constant (``getattr(x, "_name")``, ``patch(x, "_name", ...)``) that is not a docstring."""
    compat_aliases = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name == "_compat"
    }
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id in compat_aliases):
                used.append((node.lineno, node.attr))
        elif isinstance(node, ast.ClassDef):
            used += [(f.lineno, f.name) for f in node.body if isinstance(f, ast.FunctionDef)]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"[A-Za-z_]\w*", node.value)
            and id(node) not in docstrings
        ):
            used.append((node.lineno, node.value))
    return used


def _uses_outside_compat(wanted) -> list[str]:
    return [
        f"{path.relative_to(SRC)}:{line}: {name}"
        for path in _zbpipe_modules_outside_compat()
        for line, name in _names_used(ast.parse(path.read_text()))
        if wanted(name)
    ]


def test_private_torch_names_outside_compat_are_the_inherited_ones():
    """A private torch name outside zbpipe._compat is one zbpipe's schedules inherit from torch's
    and override or use as their own (``_step_microbatches``, ``self._n_microbatches``), listed
    in the census and checked above: renaming those in zbpipe would break the override itself.
    Anything else (a stage's, a tensor's, a graph node's, a module's private name) goes through
    a named helper in zbpipe._compat."""
    torch_private = _torch_private_names()
    inherited = {n for _, n, _ in C.INHERITED_API} | set(C.PRIVATE_SCHEDULE_ATTRIBUTES)
    offenders = _uses_outside_compat(lambda n: n in torch_private and n not in inherited)
    assert not offenders, (
        "private torch names outside zbpipe._compat: read them through a helper there (with a "
        f"census entry), or list an inherited schedule name in INHERITED_API: {offenders}"
    )


def test_torch_internal_state_is_reached_through_compat_only():
    """torch's stages and schedule runtime keep their caches, receive tables and counters in
    public-looking attributes (``fwd_cache``, ``backward_counter``): only zbpipe._compat names
    them."""
    internal = {a for _, a in C.TORCH_INTERNAL_ATTRIBUTES}
    offenders = _uses_outside_compat(lambda n: n in internal)
    assert not offenders, f"torch internals outside zbpipe._compat: use its helpers: {offenders}"


def test_census_scan_sees_private_uses_but_not_docstrings_or_compat():
    tree = ast.parse(
        "from . import _compat as C\n"
        "def f(stage, node, m):\n"
        "    '''node._input_metadata in a docstring is not a use'''\n"
        "    stage._create_grad_send_info(())\n"
        "    n = node._input_metadata\n"
        "    getattr(m, '_compiled_call_impl', None)\n"
        "    return C._Action\n"
        "class S:\n"
        "    def _maybe_get_loss(self): ...\n"
    )
    names = [name for _, name in _names_used(tree)]
    assert names.count("_input_metadata") == 1
    assert {"_create_grad_send_info", "_compiled_call_impl", "_maybe_get_loss"} <= set(names)
    assert "_Action" not in names
    found = {"_create_grad_send_info", "_input_metadata", "_compiled_call_impl", "_parameters"}
    assert found <= _torch_private_names()


# ---------------------------------------------------------------- private attributes, by behaviour
@pytest.mark.parametrize(
    "owner, name", C.PRIVATE_OBJECT_ATTRIBUTES, ids=[n for _, n in C.PRIVATE_OBJECT_ATTRIBUTES]
)
def test_private_object_attributes_are_torchs(owner, name):
    assert name in _torch_private_names(), f"torch's {owner} no longer has {name}"


def test_node_input_metadata_has_one_entry_per_forward_output():
    x = torch.randn(3, 4, requires_grad=True)
    node = (x * 2).grad_fn
    assert [tuple(m.shape) for m in C.node_input_metadata(node)] == [(3, 4)]
    a, _ = x.split(2, dim=1)  # one node, two outputs: two gradients arrive at it
    assert len(C.node_input_metadata(a.grad_fn)) == 2


def test_is_view_tells_views_from_fresh_tensors():
    x = torch.randn(3, 3)
    assert C.is_view(x[0]) and C.is_view(x.t())
    assert not C.is_view(x) and not C.is_view(x * 2) and not C.is_view(x[0].detach())


def test_own_parameter_is_none_under_a_parametrization():
    from torch.nn.utils import parametrize

    lin = torch.nn.Linear(2, 2)
    assert C.own_parameter(lin, "weight") is lin.weight
    parametrize.register_parametrization(lin, "weight", torch.nn.Identity())
    assert C.own_parameter(lin, "weight") is None
    assert C.own_parameter(lin, "bias") is lin.bias


def test_in_place_compile_sets_the_attribute_is_compiled_reads():
    assert not C.is_compiled(torch.nn.Linear(2, 2))
    # Module.compile() imports the compiler; its source shows the attribute it sets.
    source = inspect.getsource(torch.nn.Module.compile)
    assert re.search(r"self\._compiled_call_impl\s*=", source), "torch renamed _compiled_call_impl"


def test_tensor_hook_attributes_zbpipe_reads_see_the_hooks():
    """The deferred engine reads two private tensor attributes to decide what W may do."""
    w = torch.nn.Parameter(torch.randn(2, 2))
    assert not C.has_grad_hooks(w) and not C.has_post_accumulate_grad_hooks(w)
    w.register_hook(lambda g: g)
    w.register_post_accumulate_grad_hook(lambda p: None)
    assert C.has_grad_hooks(w), "torch no longer keeps register_hook hooks in _backward_hooks"
    assert C.has_post_accumulate_grad_hooks(w), "torch renamed _post_accumulate_grad_hooks"


def test_local_hand_off_buffers_are_dropped_and_a_later_none_gradient_reads_as_zero():
    """V placement: zbpipe drops torch's references to local hand-offs (``drop_local_inputs``);
    a None gradient handed over afterwards must still read as a zero output gradient, as torch's
    own ``set_local_bwd_input`` makes it by zeroing the buffer the last hand-off left."""
    import types

    import torch
    from torch.distributed.pipelining.stage import _PipelineStageBase, _RecvInfo

    if "tensor_meta" not in inspect.signature(_RecvInfo).parameters:
        pytest.skip("torch 2.11's set_local_bwd_input refuses None gradients: nothing to rebuild")
    meta = types.SimpleNamespace(shape=torch.Size([2, 3]), dtype=torch.float32)
    act = _RecvInfo("x", 0, torch.ones(2, 3), meta)
    grad = _RecvInfo("g", 2, torch.ones(2, 3), meta)
    stage = types.SimpleNamespace(
        args_recv_info={0: (act,)},
        grad_recv_info={0: (grad,)},
        device=torch.device("cpu"),
        has_backward=True,
        is_last=False,
    )
    stage.set_local_bwd_input = types.MethodType(_PipelineStageBase.set_local_bwd_input, stage)
    C.drop_local_inputs(stage, 0, fwd=True, bwd=True)
    assert act.buffer.numel() == 0 and grad.buffer.numel() == 0  # freed
    C.set_local_bwd_input(stage, (None,), 0)
    assert torch.equal(grad.buffer, torch.zeros(2, 3))
    handed = torch.full((2, 3), 5.0)
    C.set_local_bwd_input(stage, (handed,), 0)
    assert grad.buffer is handed


def test_asked_by_checkpoint_tells_a_recompute_from_a_nodes_own_unpack():
    """B keeps a checkpointed region's inputs for W's recompute by this answer
    (zbpipe.memory.saved): the unpack of the region's input comes from torch.utils.checkpoint's
    recompute, a node's own unpack from the engine (torch 2.11: ``_NoopSaveInputs``' saved
    tensors in checkpoint's unpack hook; 2.13 and 2.14: ``_CheckpointFrame.get_inputs``)."""
    import sys

    from torch.utils.checkpoint import checkpoint

    seen: list[bool] = []

    def unpack(t: torch.Tensor) -> torch.Tensor:
        seen.append(C.asked_by_checkpoint(sys._getframe(1)))
        return t

    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = torch.sin(x) + checkpoint(lambda t: torch.tanh(lin(t)), x, use_reentrant=False)
    y.sum().backward()
    # sin's input (its node's unpack), then the region's inputs (the recompute's: torch 2.11
    # also saves an empty placeholder beside them)
    assert seen.count(False) == 1 and seen.count(True) >= 1, seen


def test_selective_checkpoint_submodule_finds_torchs_wrapper_with_a_context_fn():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context():
        return create_selective_checkpoint_contexts(policy)

    full = torch.nn.Sequential(torch.nn.Linear(2, 2), checkpoint_wrapper(torch.nn.Linear(2, 2)))
    selective = torch.nn.Sequential(
        torch.nn.Linear(2, 2), checkpoint_wrapper(torch.nn.Linear(2, 2), context_fn=context)
    )
    assert C.selective_checkpoint_submodule(full) is None
    assert C.selective_checkpoint_submodule(selective) == "1"


# ---------------------------------------------------------------- the native capture's C++ side
_CPP_INTERNAL = re.compile(r"\b(?:torch|at|c10)::(?:\w+::)*(?:impl|detail|internal)::\w+")


def test_native_cpp_internals_are_in_the_census():
    """The native weight capture's C++ calls into torch's internal namespaces are listed in
    ``NATIVE_INTERNAL_NAMES``, each with a test that exists and checks it by behaviour."""
    listed = {name for name, _, _ in C.NATIVE_INTERNAL_NAMES}
    used = {
        f"{path.relative_to(SRC)}: {m.group(0)}"
        for path in SRC.rglob("*.cpp")
        for m in _CPP_INTERNAL.finditer(path.read_text())
        if m.group(0) not in listed
    }
    assert not used, f"C++ internals of torch not in NATIVE_INTERNAL_NAMES: {sorted(used)}"
    root = SRC.parents[1]
    for name, _, test in C.NATIVE_INTERNAL_NAMES:
        file, func = test.split("::")
        assert f"def {func}(" in (root / file).read_text(), f"{name}: {test} does not exist"


def test_native_cpp_scan_finds_internal_names():
    text = "a = torch::autograd::impl::post_acc_grad_hooks(w); at::detail::x(); at::linear(x, w);"
    assert [m.group(0) for m in _CPP_INTERNAL.finditer(text)] == [
        "torch::autograd::impl::post_acc_grad_hooks",
        "at::detail::x",
    ]
