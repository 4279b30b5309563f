"""zbpipe: Zero Bubble pipeline-parallel schedules for torch.distributed.pipelining.

The plan layer (``Costs``, ``simulate``, ``Action``, ``Plan``) is imported eagerly and never
imports torch. Other names are resolved lazily (PEP 562) on first access, so ``import zbpipe``
and ``import zbpipe.planning`` work on a machine without torch. ``plan``
(:mod:`zbpipe.integrations.plans`) is lazy too, though torch-free: it imports torch only to build
one of torch's own schedules (``"torch:<Name>"``), and importing it eagerly here would pull that
torch-facing code into every import of the plan layer (mypy's strict check of ``zbpipe.planning``
among them).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from .planning import Action, Costs, Plan, PlanError, SimResult, simulate

#: lazily imported public name -> module that defines it
_LAZY: dict[str, str] = {
    "plan": "zbpipe.integrations.plans",
    "ScheduleZBH1": "zbpipe.schedules",
    "Schedule1F1BMulti": "zbpipe.schedules",
    "ScheduleZBH2": "zbpipe.schedules",
    "ScheduleZBV": "zbpipe.schedules",
    "ScheduleZBInterleaved": "zbpipe.schedules",
    "ScheduleZBAuto": "zbpipe.schedules",
    "ScheduleDualPipeV": "zbpipe.schedules",
    "CommPoint": "zbpipe.schedules.comm_points",
    "AllToAllSingle": "zbpipe.schedules.comm_points",
    "ScheduleContinuous": "zbpipe.continuous",
    "get_schedule_class": "zbpipe.integrations.names",
    "PlannedSchedule": "zbpipe.schedules.runtime",
    "PostValidatedStep": "zbpipe.continuous.optim",
    "Tracer": "zbpipe.observe.trace",
    "Trace": "zbpipe.observe.trace",
    "ProfileConfig": "zbpipe.observe.profile",
    "SavedActivationMeter": "zbpipe.memory",
    "register": "zbpipe.integrations.names",
    "ScheduleAuto": "zbpipe.schedules.chooser",
    "ScheduleAutoV": "zbpipe.schedules.chooser",
    "choose_schedule": "zbpipe.schedules.chooser",
    "choose_plan": "zbpipe.planning.search.within_budget",
    "split_packed": "zbpipe.schedules.packed",
    "document_mask": "zbpipe.schedules.packed",
}

__all__ = ["Action", "Costs", "Plan", "PlanError", "SimResult", "simulate", *_LAZY]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zbpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
