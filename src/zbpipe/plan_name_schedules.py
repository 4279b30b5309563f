"""A schedule class for every zbpipe plan name, so a memory mode is a config line.

torchtitan (and torch's ``get_schedule_class``) turn a schedule name into a class and construct
it as ``cls(stages, n_microbatches=..., loss_fn=..., scale_grads=...)``: there is no way to pass
``memory="half"`` or ``memory_limit="1p"``. Each class here is a zbpipe schedule with that option
fixed, named like the plan it runs (``plan("ZBVHalf", ...)``), so ``pipeline_parallel_schedule =
"ZBVHalf"`` selects V-Half. Constructing one with the option given again is allowed only with
the same value. Their names are in :mod:`zbpipe.schedule_names`, with every other zbpipe schedule's.
"""

from __future__ import annotations

from typing import Any

from .schedules import ScheduleZBAuto, ScheduleZBV


def _fixed(base: type, plan_name: str, option: str, value: Any, doc: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = kwargs.pop(option, value)
        if given != value:
            raise ValueError(
                f"Schedule{plan_name} runs {option}={value!r}; got {option}={given!r}: "
                f"use {base.__name__}({option}={given!r}) instead"
            )
        base.__init__(self, *args, **{option: value}, **kwargs)

    return type(
        f"Schedule{plan_name}",
        (base,),
        # plan_name stays the base's: its build_plan turns the fixed option into this plan.
        {
            "__init__": __init__,
            "__doc__": doc,
            "__module__": __name__,
            "fixed_option": (option, value),
        },
    )


ScheduleZB1P = _fixed(
    ScheduleZBAuto,
    "ZB1P",
    "memory_limit",
    "1p",
    "The automatic zero-bubble schedule within 1F1B's activation memory (ZB-1p).",
)
ScheduleZB2P = _fixed(
    ScheduleZBAuto,
    "ZB2P",
    "memory_limit",
    "2p",
    "The automatic zero-bubble schedule within twice 1F1B's activation memory (ZB-2p).",
)
ScheduleZBVHalf = _fixed(
    ScheduleZBV, "ZBVHalf", "memory", "half", "V-Half: ZB-V with about half 1F1B's activations."
)
ScheduleZBVMin = _fixed(
    ScheduleZBV, "ZBVMin", "memory", "min", "V-Min: ZB-V with about a third of 1F1B's activations."
)
