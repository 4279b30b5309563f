"""What zbpipe reads of autograd: hooks on tensors, views, a node's input metadata, the C++ entry
of an ``autograd.Function``, a leaf's ``AccumulateGrad`` node, what the deferred engine's
Linear asks on every call (autocast, saved-tensor hooks, a tensor's version, a hook on its
output's gradient), who asked for a saved tensor (activation checkpointing's recompute) and
the entries of selective activation checkpointing's cache."""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint

from .modules import is_dtensor

#: the file of torch's activation checkpointing (``torch.utils.checkpoint``)
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def post_accumulate_grad_hooks(t: Any) -> dict[Any, Any] | None:
    """The dict of ``t``'s post-accumulate-grad hooks (autograd reads it when the hooks run)."""
    return getattr(t, "_post_accumulate_grad_hooks", None)


def has_post_accumulate_grad_hooks(t: Any) -> bool:
    """Whether ``register_post_accumulate_grad_hook`` put a hook on the leaf ``t``."""
    return bool(post_accumulate_grad_hooks(t))


def has_grad_hooks(t: Any) -> bool:
    """Whether ``t.register_hook`` put a hook on ``t``'s gradient (autograd calls it first)."""
    return bool(getattr(t, "_backward_hooks", None))


def is_view(t: Any) -> bool:
    """Whether tensor ``t`` is a view of another tensor's storage (autograd's ``_is_view()``)."""
    return bool(t._is_view())


def node_input_metadata(node: Any) -> Any:
    """The metadata (``.shape``...) of each gradient an autograd graph node receives, one per
    output of the forward op (``Node._input_metadata``). Raises AttributeError or RuntimeError
    where a node has none."""
    return node._input_metadata


def autograd_function_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` for an ``autograd.Function`` subclass without ``setup_context``, entering
    torch's C++ entry point (``torch._C._FunctionBase.apply``) as torch 2.14's ``apply`` does.

    torch 2.11 and 2.13 wrap that entry point in Python: ``Function.apply`` checks for
    ``setup_context``, then, with no functorch transform active, unwraps dead functorch
    wrappers among the arguments (``torch._functorch.utils.unwrap_dead_wrappers``) and calls
    it. This does the same, minus the wrapper's own calls (about 2 us a call on this
    project's CPU, paid by every patched Linear in every F): under an active transform it calls
    ``cls.apply`` (torch's path, and its error for a Function without ``setup_context``), as it
    does for keyword arguments and while dynamo traces, else unwraps each tensor argument
    (``torch._C._functorch.unwrap_if_dead``) and enters C++. On torch 2.14, where
    ``Function.apply`` is the entry point itself, it returns that.
    """
    entry = torch._C._FunctionBase.__dict__["apply"]
    fast = entry.__get__(None, cls)
    if torch.autograd.Function.__dict__.get("apply") is entry:
        return fast  # type: ignore[no-any-return]
    if cls.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context:
        return cls.apply  # torch binds its defaults
    transforms_active = torch._C._are_functorch_transforms_active
    unwrap = torch._C._functorch.unwrap_if_dead
    slow = cls.apply
    tensor = torch.Tensor
    compiling = torch.compiler.is_compiling

    def apply(*args: Any, **kwargs: Any) -> Any:
        # torch's own path for what its wrapper does beyond unwrapping: keyword arguments (it
        # binds them), functorch transforms, and dynamo, which traces cls.apply but skips the
        # C++ entry point (a graph break; an error under fullgraph=True on torch 2.11)
        if kwargs or transforms_active() or compiling():
            return slow(*args, **kwargs)  # type: ignore[no-untyped-call]  # torch's is untyped
        return fast(*[unwrap(a) if isinstance(a, tensor) else a for a in args])

    return apply


def grad_accumulator(leaf: Any) -> Any:
    """The ``AccumulateGrad`` node of the leaf tensor ``leaf`` (autograd keeps it only while a
    graph or the caller holds it, so hooks on it last as long as the caller keeps it)."""
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


#: whether autocast is on for any device type (one C call; ``torch.is_autocast_enabled(device)``
#: asks one device per call)
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled


#: the innermost ``saved_tensors_hooks`` installed here (activation checkpointing, zbpipe's
#: saved-tensor holders), None without any: ``saved_tensor_hooks() is None`` is the deferred
#: Linear's per-call check (``torch._C._autograd._top_saved_tensors_default_hooks``, bound to
#: its argument: a C call, no Python frame)
saved_tensor_hooks: Callable[[], Any] = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False
)

#: ``t``'s version counter (``Tensor._version``: bumped by every in-place write), which autograd
#: checks when it unpacks a saved tensor (an attribute getter: no Python frame)
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")

#: whether a functorch transform (vmap, grad) is active (its wrapped tensors look plain)
functorch_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active

#: the dict of ``t.register_hook`` hooks, or None (``Tensor._backward_hooks``; a getter)
grad_hook_dict: Callable[[torch.Tensor], Any] = operator.attrgetter("_backward_hooks")


def on_output_grad(out: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> None:
    """Call ``hook(grad)`` when the gradient of ``out`` (a fresh op output) reaches its
    ``grad_fn``, before the node runs: ``Tensor.register_hook`` without its removable handle
    (which costs most of that method's few microseconds). ``out`` must have no hooks yet."""
    out._backward_hooks = {0: hook}
    out.grad_fn._register_hook_dict(out)  # type: ignore[union-attr]  # out has a grad_fn


def asked_by_checkpoint(caller: FrameType | None) -> bool:
    """Whether a saved tensor is being unpacked for ``torch.utils.checkpoint``'s non-reentrant
    recompute: ``caller`` is the Python frame that asked for it (``sys._getframe(1)`` in an unpack
    hook).

    A checkpointed region saves its inputs (under the hooks around it, a microbatch's
    :class:`~zbpipe.memory.saved.SavedTensors`) and nothing else of ours: its nodes' saved
    tensors go to checkpoint's own hooks. The first of its nodes a backward call runs unpacks one
    of those; checkpoint's unpack hook then asks for the region's inputs and runs the region's
    forward again, once per backward call (per graph task). So the node doing that unpack is
    whichever of the region's nodes a call reaches first, not the tensor's user: the recompute
    is. torch asks for the inputs from Python in ``torch/utils/checkpoint.py`` (torch 2.11:
    ``ctx.saved_tensors`` of its ``_NoopSaveInputs`` node in the unpack hook; 2.13 and 2.14:
    ``_CheckpointFrame.get_inputs``), while an autograd node's own unpack comes from C++ (its
    caller is the Python code that started the backward) and a custom ``Function``'s from its
    ``backward``. Only the immediate caller is read: a reentrant checkpoint's backward (also in
    that file) starts an inner backward whose nodes' unpacks have the engine's entry as caller.
    tests/test_compat_names.py checks both kinds of unpack against the installed torch.
    """
    return caller is not None and caller.f_code.co_filename == _CHECKPOINT_FILE


@contextlib.contextmanager
def selective_checkpoint_cached(report: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """While open, ``report(t)`` for every tensor selective activation checkpointing caches.

    ``create_selective_checkpoint_contexts`` keeps the outputs its policy saves (``MUST_SAVE``,
    ``PREFER_SAVE``) in a cache of the region's own until the backward's recompute consumes
    them, not through saved-tensor hooks, so no hook sees them (torch 2.14 can route them
    through the hooks, only if a region asks: ``respect_saved_tensors_hooks=True``; then the
    entry holds what the hook packed, not a tensor, and is not reported twice). Every entry is
    built as ``torch.utils.checkpoint._VersionWrapper(tensor)`` (torch 2.11 to 2.14): its
    ``__init__`` is wrapped while this is open (on this class, for every thread; a forward runs
    inside). A compiled region's cache is a tracing artifact of fake tensors: not reported.
    """
    cls = torch.utils.checkpoint._VersionWrapper
    original = cls.__dict__["__init__"]

    def init(self: Any, val: Any, *args: Any, **kwargs: Any) -> None:
        original(self, val, *args, **kwargs)
        if type(val) is torch.Tensor or is_dtensor(val):
            report(val)

    cls.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        if cls.__dict__["__init__"] is init:  # a later wrap on top is left alone
            cls.__init__ = original  # type: ignore[method-assign]


def checkpoint_recompute_replayable() -> bool:
    """Whether :func:`checkpoint_frame` can find a recomputing region in this torch (2.13 and
    2.14: ``_CheckpointFrame.get_inputs`` asks for its inputs; not 2.11)."""
    frame_type = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
    return frame_type is not None and hasattr(frame_type, "get_inputs")


def checkpoint_frame(caller: FrameType | None) -> Any | None:
    """The region whose recompute asked for a saved tensor, or None: ``caller`` as in
    :func:`asked_by_checkpoint`. torch 2.13 and 2.14 ask from ``_CheckpointFrame.get_inputs``
    (Python 3.11 through its list comprehension's frame): that method's ``self``, whose
    ``recompute_fn`` the unpack hook calls right after. torch 2.11 asks from elsewhere: None
    there, and each backward call recomputes the region as before."""
    frame_type = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
    for _ in range(2):  # get_inputs, or its comprehension then get_inputs
        if caller is None or caller.f_code.co_filename != _CHECKPOINT_FILE:
            return None
        if caller.f_code.co_name == "get_inputs":
            owner = caller.f_locals.get("self")
            ok = frame_type is not None and isinstance(owner, frame_type)
            return owner if ok and hasattr(owner, "recompute_fn") else None
        caller = caller.f_back
    return None


def swap_recompute(region: Any, recompute: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``recompute`` what the checkpointed ``region`` (a ``_CheckpointFrame``, from
    :func:`checkpoint_frame`) runs when a backward call recomputes it; return what it ran."""
    previous: Callable[..., Any] = region.recompute_fn
    region.recompute_fn = recompute
    return previous


def recording_recompute(
    recompute: Callable[..., Any], store: list[torch.Tensor]
) -> Callable[..., None]:
    """``recompute`` (a ``_CheckpointFrame.recompute_fn``) that also appends to ``store`` every
    tensor the recompute hands to checkpoint's recomputation hook, in that hook's order (which
    is how it matches them to the region's saved slots). The hook is the innermost
    ``saved_tensors_hooks`` while the recompute runs: this puts one in front of it that records
    and passes each tensor on (its early stop, an exception, passes through)."""

    def run(*args: Any) -> None:
        pack, unpack = saved_tensor_hooks()

        def record(x: torch.Tensor) -> Any:
            store.append(x.detach())
            return pack(x)

        with torch.autograd.graph.saved_tensors_hooks(record, unpack):
            recompute(*args)

    return run


def replaying_recompute(store: list[torch.Tensor]) -> Callable[..., None]:
    """A ``recompute_fn`` that hands checkpoint's recomputation hook the tensors ``store``
    recorded (:func:`recording_recompute`) instead of running the region's forward again."""

    def run(*args: Any) -> None:
        pack, _ = saved_tensor_hooks()
        for x in store:
            pack(x)  # the last one may raise the hook's early stop: it ends the recompute

    return run
