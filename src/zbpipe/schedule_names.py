"""One table from schedule name to zbpipe's schedule class, and the one lookup that reads it.

Every way of naming a zbpipe schedule resolves here: :func:`zbpipe.get_schedule_class`, torch's
own ``get_schedule_class`` once :func:`zbpipe.register` ran
(:func:`zbpipe.registration.lookup_zbpipe`), and the torchtitan integration
(:mod:`zbpipe.torchtitan`, through ``lookup_zbpipe``). A name
matches a key of :data:`SCHEDULE_CLASSES` or a class's own name (``"ZBVHalf"``,
``"ScheduleZBVHalf"``), in any case. To add a schedule class, add a line to the table.

Plan names (``plan("ZBVHalf", ...)``) are a different table, :data:`zbpipe.planning.GENERATORS`:
a name there maps to a plan generator, here to a class that runs a plan. The fixed-option classes
(:mod:`zbpipe.plan_name_schedules`) make every zbpipe plan name a class name too.
"""

from __future__ import annotations

from .continuous import ScheduleContinuous
from .plan_name_schedules import ScheduleZB1P, ScheduleZB2P, ScheduleZBVHalf, ScheduleZBVMin
from .runtime import PlannedSchedule
from .schedules import Schedule1F1BMulti, ScheduleZBAuto, ScheduleZBH1, ScheduleZBH2, ScheduleZBV

#: zbpipe's schedule classes by the short name configs use (torchtitan's
#: ``pipeline_parallel_schedule``). No name here is one of torch's (``"1F1B"`` stays torch's
#: ``Schedule1F1B``): zbpipe's names are looked up first and must never shadow torch's.
SCHEDULE_CLASSES: dict[str, type] = {
    "1F1BMulti": Schedule1F1BMulti,
    "ZBH1": ScheduleZBH1,
    "ZBH2": ScheduleZBH2,
    "ZBAuto": ScheduleZBAuto,
    "ZB1P": ScheduleZB1P,
    "ZB2P": ScheduleZB2P,
    "ZBV": ScheduleZBV,
    "ZBVHalf": ScheduleZBVHalf,
    "ZBVMin": ScheduleZBVMin,
    "Continuous": ScheduleContinuous,
}


def is_torch_shaped(cls: type) -> bool:
    """Whether torch's and torchtitan's builders can drive ``cls``: torch's constructor
    (``cls(stages, n_microbatches, loss_fn=...)``) and ``step()`` contract. Every
    :class:`~zbpipe.runtime.PlannedSchedule` is; ``ScheduleContinuous`` is not (it needs
    ``optimizer=`` and owns the optimizer step)."""
    return issubclass(cls, PlannedSchedule)


def find_schedule_class(name: str, *, torch_shaped_only: bool = False) -> type | None:
    """zbpipe's class for ``name`` (a :data:`SCHEDULE_CLASSES` key or a class name, any case),
    else None. ``torch_shaped_only``: None for a class :func:`is_torch_shaped` refuses.

    Reads the table at call time, so a line added to it later is found.
    """
    wanted = name.lower()
    for key, cls in SCHEDULE_CLASSES.items():
        if wanted in (key.lower(), cls.__name__.lower()):
            return None if torch_shaped_only and not is_torch_shaped(cls) else cls
    return None


def get_schedule_class(name: str) -> type:
    """The schedule class for ``name`` (case-insensitive): zbpipe's names first, then torch's.

    >>> get_schedule_class("ZBVHalf").__name__
    'ScheduleZBVHalf'
    """
    found = find_schedule_class(name)
    if found is not None:
        return found
    from .registration import original_get_schedule_class

    try:
        return original_get_schedule_class()(name)
    except ValueError as torch_error:  # torch's message lists torch's names
        raise ValueError(
            f"unknown schedule {name!r}: zbpipe knows {sorted(SCHEDULE_CLASSES)}; "
            f"torch: {torch_error}"
        ) from None
