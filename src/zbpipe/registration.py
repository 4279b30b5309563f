"""Make torch's own ``get_schedule_class`` know zbpipe's schedule names.

torch resolves a schedule name (``"1F1B"``, ``"ZBVZeroBubble"``...) with
``torch.distributed.pipelining.schedules.get_schedule_class``, a closed table. Code built on
torch (torchtitan's ``pipeline_parallel`` module among others) imports that function by name
and never asks anyone else. :func:`register` replaces it, in torch's module and in every
already-imported module that holds it by name, with a wrapper that

1. looks the name up in zbpipe's one name table (:func:`zbpipe.schedule_names.find_schedule_class`)
   *at call time* (so classes added to it later are found), matching a short name or a class
   name, case-insensitively, among the classes torch's builders can drive (not
   ``ScheduleContinuous``);
2. otherwise calls torch's original function, unchanged (so torch's names and torch's
   ``ValueError`` for unknown names behave exactly as before).

zbpipe's names are looked up first: a zbpipe name equal to one of torch's would shadow it, so
zbpipe avoids torch's names. The original stays reachable as ``wrapper.__wrapped__`` and as
:func:`original_get_schedule_class`. :func:`unregister` puts it back everywhere the wrapper
was installed. Both calls are explicit and idempotent; nothing happens at import time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

from .patching import rebind

logger = logging.getLogger(__name__)

_ATTR = "get_schedule_class"
_MARK = "__zbpipe_registered__"


def _torch_schedules() -> ModuleType:
    import torch.distributed.pipelining.schedules as schedules

    return schedules


def _is_wrapper(fn: object) -> bool:
    return getattr(fn, _MARK, False) is True


def original_get_schedule_class() -> Callable[[str], type]:
    """torch's own ``get_schedule_class``, whether or not :func:`register` has run."""
    fn = getattr(_torch_schedules(), _ATTR)
    return fn.__wrapped__ if _is_wrapper(fn) else fn


def lookup_zbpipe(name: str) -> type | None:
    """zbpipe's torch-shaped class for ``name``, else ``None``: a short name (``ZBH1``,
    ``ZBVHalf``...) or a class name, any case, from :data:`zbpipe.schedule_names.SCHEDULE_CLASSES`.
    ``ScheduleContinuous`` is left out: torch's and torchtitan's builders cannot drive it."""
    from .schedule_names import find_schedule_class

    return find_schedule_class(name, torch_shaped_only=True)


def _make_wrapper(original: Callable[[str], type]) -> Callable[[str], type]:
    @functools.wraps(original)
    def get_schedule_class(schedule_name: str) -> type:
        cls = lookup_zbpipe(schedule_name)
        return cls if cls is not None else original(schedule_name)

    get_schedule_class.__doc__ = (
        "torch's get_schedule_class, extended by zbpipe.registration.register(): zbpipe's "
        "schedule names first, then torch's. The original is __wrapped__."
    )
    setattr(get_schedule_class, _MARK, True)
    return get_schedule_class


def register() -> Callable[[str], type]:
    """Make ``torch.distributed.pipelining.schedules.get_schedule_class`` resolve zbpipe's names.

    Rebinds the name in torch's module and in every loaded module that imported it by name
    (e.g. ``torchtitan.distributed.pipeline_parallel``); modules imported afterwards pick up the
    wrapper from torch. Idempotent: a second call only rebinds modules loaded since the first.
    Returns the wrapper.
    """
    torch_mod = _torch_schedules()
    current = getattr(torch_mod, _ATTR)
    original = current.__wrapped__ if _is_wrapper(current) else current
    wrapper = current if _is_wrapper(current) else _make_wrapper(original)
    patched = rebind(_ATTR, original, wrapper)
    if patched:
        logger.debug(
            "zbpipe: get_schedule_class wrapped in %s", sorted(p.target.__name__ for p in patched)
        )
    return wrapper


def unregister() -> None:
    """Undo :func:`register`: every module holding the wrapper gets torch's original back."""
    current = getattr(_torch_schedules(), _ATTR)
    if not _is_wrapper(current):
        return
    rebind(_ATTR, current, current.__wrapped__)


def is_registered() -> bool:
    """Whether torch's ``get_schedule_class`` currently resolves zbpipe's names."""
    return _is_wrapper(getattr(_torch_schedules(), _ATTR))


__all__ = [
    "register",
    "unregister",
    "is_registered",
    "original_get_schedule_class",
    "lookup_zbpipe",
]
