"""What zbpipe reads of ``nn.Module`` and DTensor: a module's own parameter slots, whether it is
compiled or wrapped for selective activation checkpointing, a DTensor's local shard."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def own_parameter(module: Any, name: str) -> Any:
    """The parameter registered on ``module`` itself as ``name``, else None. Unlike
    ``getattr(module, name)`` it is None under a parametrization (which moves the parameter to
    ``module.parametrizations`` and makes ``module.<name>`` a computed tensor)."""
    return module._parameters.get(name)


def own_parameters(module: Any) -> dict[str, Any]:
    """The parameters registered on ``module`` itself, by attribute name (its ``_parameters``;
    a slot may hold None)."""
    return dict(module._parameters)


def set_own_parameter(module: Any, name: str, tensor: Any) -> None:
    """Put ``tensor`` (a Parameter, or any tensor: a weight version's leaf) in ``module``'s
    parameter slot ``name``, as ``torch.func.functional_call`` does for the duration of a call:
    ``nn.Module.__setattr__`` would refuse a tensor that is not a Parameter."""
    module._parameters[name] = tensor


def is_compiled(module: Any) -> bool:
    """``torch.compile(module)`` (an ``OptimizedModule``) or in-place ``module.compile()`` (the way
    torchtitan compiles; it sets ``_compiled_call_impl``)."""
    return (
        type(module).__name__ == "OptimizedModule"
        or getattr(module, "_compiled_call_impl", None) is not None
    )


def is_plain_or_dtensor(t: Any) -> bool:
    """``t`` is a plain tensor or a DTensor (or a Parameter holding either), not another tensor
    subclass."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or is_dtensor(t)


def is_dtensor(t: Any) -> bool:
    """``t`` is a DTensor (a Parameter holding one included)."""
    return isinstance(t, DTensor)


def local_tensor(t: Any) -> Any:
    """The local shard a DTensor wraps, the tensor object itself (``to_local()`` returns a new
    view of it): the object compiled code receives for ``t`` (AOTAutograd flattens a DTensor
    into it) and the one a gradient DTensor wraps."""
    return t._local_tensor


def compiled_submodule(module: Any) -> str | None:
    """The name of ``module``'s first ``torch.compile``d submodule (``""``: itself), else None.

    Both ``torch.compile(module)`` (an ``OptimizedModule``) and in-place ``module.compile()``
    (the way torchtitan compiles) count (:func:`is_compiled`).
    """
    for name, mod in module.named_modules():
        if is_compiled(mod):
            return str(name)
    return None


def checkpointed_submodule(module: Any) -> str | None:
    """The name of ``module``'s first submodule wrapped by torch's ``checkpoint_wrapper`` (full or
    selective activation checkpointing, as torchtitan applies both; ``""``: itself), else None.

    Matched by class name, as :func:`selective_checkpoint_submodule` says why. A
    ``torch.utils.checkpoint`` call written in a forward is not visible here.
    """
    for name, mod in module.named_modules():
        if type(mod).__name__ == "CheckpointWrapper":
            return str(name)
    return None


def selective_checkpoint_submodule(module: Any) -> str | None:
    """The name of ``module``'s first submodule wrapped by torch's ``checkpoint_wrapper`` with a
    ``context_fn`` (``""``: itself), else None: selective activation checkpointing as torchtitan
    applies it (``context_fn=lambda: create_selective_checkpoint_contexts(policy)``).

    Read from the wrapper's ``checkpoint_fn``, a ``functools.partial`` of
    ``torch.utils.checkpoint.checkpoint`` holding the wrapper's keyword arguments (the wrapper
    class lives in a private module, ``torch.distributed.algorithms._checkpoint``: it is matched
    by name). A ``context_fn`` other than torch's ``noop_context_fn`` counts: torch's only use of
    it is selective checkpointing.
    """
    from torch.utils.checkpoint import noop_context_fn

    for name, mod in module.named_modules():
        if type(mod).__name__ != "CheckpointWrapper":
            continue
        keywords = getattr(getattr(mod, "checkpoint_fn", None), "keywords", None) or {}
        context_fn = keywords.get("context_fn", noop_context_fn)
        if context_fn is not noop_context_fn:
            return str(name)
    return None
