"""How a schedule was named where an integration built it from a name, for advice in that form.

torchtitan builds a schedule from its config's ``pipeline_parallel_schedule`` and passes the
constructor nothing else, so a log line that advises ``memory_limit=...`` gives its user nothing
to type. The integration builds the schedule inside :func:`named` (zbpipe.torchtitan wraps
``pipeline_llm`` so); the schedule keeps :func:`entry_name` (``PlannedSchedule.entry_name``) and
its advice names a schedule name option instead (``"AutoV:7.5MiB"``, see
:mod:`zbpipe.integrations.names`). A context variable, not module state: set and reset around
one build, per thread or task.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_ENTRY: contextvars.ContextVar[str | None] = contextvars.ContextVar("zbpipe_entry", default=None)


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """Schedules built inside were named ``name`` (a config's schedule name)."""
    token = _ENTRY.set(name)
    try:
        yield
    finally:
        _ENTRY.reset(token)


def entry_name() -> str | None:
    """The schedule name of the build under way, or None (built by its constructor)."""
    return _ENTRY.get()
