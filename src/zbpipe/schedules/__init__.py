"""The torch-facing schedules: the public classes (``classes``), the planned runtime that runs a
plan with torch's action runtime (``runtime``), the stage seam (``stage_seam``), sends
(``sends``), a step's inputs (``inputs``), construction-time checks (``validation``) and the
NaN/Inf loss report (``nonfinite``); the schedule chooser (``chooser``); ScheduleDualPipeV
(``overlapped``), its overlapped pairs (``pairs``) and the communication points they interleave
at (``comm_points``).
"""

from .chooser import ScheduleAuto, ScheduleAutoV, choose_schedule
from .classes import (
    Schedule1F1BMulti,
    ScheduleZB1P,
    ScheduleZB2P,
    ScheduleZBAuto,
    ScheduleZBH1,
    ScheduleZBH2,
    ScheduleZBInterleaved,
    ScheduleZBV,
    ScheduleZBVHalf,
    ScheduleZBVMin,
)
from .overlapped import ScheduleDualPipeV
from .runtime import PlannedSchedule

__all__ = [
    "PlannedSchedule",
    "ScheduleAuto",
    "ScheduleAutoV",
    "choose_schedule",
    "Schedule1F1BMulti",
    "ScheduleDualPipeV",
    "ScheduleZB1P",
    "ScheduleZB2P",
    "ScheduleZBAuto",
    "ScheduleZBH1",
    "ScheduleZBH2",
    "ScheduleZBInterleaved",
    "ScheduleZBV",
    "ScheduleZBVHalf",
    "ScheduleZBVMin",
]
