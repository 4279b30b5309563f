"""The one way zbpipe replaces someone else's attribute: remember what was there, undo on demand.

zbpipe patches in two shapes. A *stage wrap* replaces a method on one torch ``PipelineStage``
object (the tracer's timing, the memory meter's hooks, keyword filtering for structured
batches): the method lives on the class, the replacement on the instance, so undoing deletes
the instance attribute. A *rebind* replaces a function in every loaded module that imported it
by name (torch's ``get_schedule_class``, torchtitan's pipeline helpers), because rebinding only
the defining module would miss ``from x import f`` copies.

Every patch returns :class:`Patch` records; :meth:`Patch.undo` restores the previous value if
the attribute still holds the replacement (a later patch on top is left alone).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_ABSENT = object()  # the target had no attribute of its own (it came from its class)


@dataclass(frozen=True)
class Patch:
    """``target.name`` was set to ``replacement``; ``previous`` is what the target held itself."""

    target: Any
    name: str
    replacement: Any
    previous: Any

    def undo(self) -> bool:
        """Put the previous value back; False (and nothing done) if someone replaced ours since."""
        if vars(self.target).get(self.name, _ABSENT) is not self.replacement:
            return False
        if self.previous is _ABSENT:
            delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, self.previous)
        return True


def patch(target: Any, name: str, replacement: Any) -> Patch:
    """Set ``target.name = replacement`` and return the record that undoes it."""
    previous = vars(target).get(name, _ABSENT)
    setattr(target, name, replacement)
    return Patch(target, name, replacement, previous)


def wrap(target: Any, name: str, make: Callable[[Any], Any]) -> Patch:
    """Replace ``target.name`` by ``make(current)``, ``current`` being what lookup gives now."""
    return patch(target, name, make(getattr(target, name)))


def modules_holding(name: str, value: object) -> list[ModuleType]:
    """Every loaded module whose attribute ``name`` is ``value`` (a copy of ``sys.modules``:
    importing can mutate it while we scan)."""
    return [
        m
        for m in list(sys.modules.values())
        if isinstance(m, ModuleType) and getattr(m, name, None) is value
    ]


def rebind(name: str, old: object, new: object) -> list[Patch]:
    """In every loaded module whose ``name`` is ``old``, set it to ``new``."""
    return [patch(module, name, new) for module in modules_holding(name, old)]


def undo_all(patches: Iterable[Patch]) -> None:
    """Undo ``patches`` newest first, so stacked patches on one attribute unwind in order."""
    for p in reversed(list(patches)):
        p.undo()
