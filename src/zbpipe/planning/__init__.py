"""Plans (pure Python, no torch): what each rank computes, in which order."""

from .core import (
    KINDS,
    TORCH_LETTERS,
    Action,
    Layout,
    Plan,
    PlanError,
    format_grid,
    loop_placement,
    make_plan,
    v_placement,
)
from .costs import Costs, StageCosts
from .csv_format import plan_from_csv, plan_to_csv
from .onef1b import plan_1f1b
from .registry import GENERATORS, known_names, plan
from .simulator import Interval, SimResult, simulate
from .zbh1 import plan_zbh1

__all__ = [
    "KINDS",
    "TORCH_LETTERS",
    "Action",
    "Layout",
    "Plan",
    "PlanError",
    "format_grid",
    "loop_placement",
    "make_plan",
    "v_placement",
    "Costs",
    "StageCosts",
    "plan_from_csv",
    "plan_to_csv",
    "plan_1f1b",
    "GENERATORS",
    "known_names",
    "plan",
    "Interval",
    "SimResult",
    "simulate",
    "plan_zbh1",
]
