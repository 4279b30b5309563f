"""zbpipe's schedule classes take torch's constructor shape, so code written for torch's
PipelineScheduleMulti (positional or keyword) constructs them unchanged."""

import inspect

import pytest
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from zbpipe.continuous import ScheduleContinuous
from zbpipe.schedules.runtime import PlannedSchedule

TORCH = [n for n in inspect.signature(PipelineScheduleMulti.__init__).parameters if n != "self"]


@pytest.mark.parametrize("cls", [PlannedSchedule, ScheduleContinuous])
def test_constructor_starts_with_torchs_parameters_in_order(cls):
    ours = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    assert ours[: len(TORCH)] == TORCH


@pytest.mark.parametrize("cls", [PlannedSchedule, ScheduleContinuous])
def test_zbpipe_options_are_keyword_only(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[len(TORCH) + 1 :]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params)
