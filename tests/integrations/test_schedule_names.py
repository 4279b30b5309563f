"""One name table: each zbpipe schedule name resolves to one class, whichever lookup asks.

zbpipe.get_schedule_class, torch's get_schedule_class after zbpipe.register(), and the torchtitan
integration (zbpipe.integrations.names.lookup_zbpipe) all read
zbpipe.integrations.names.SCHEDULE_CLASSES.
"""

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

import zbpipe
import zbpipe.schedules
import zbpipe.schedules.classes
from zbpipe.continuous import ScheduleContinuous
from zbpipe.integrations import names as registration
from zbpipe.integrations.names import SCHEDULE_CLASSES, find_schedule_class, is_torch_shaped
from zbpipe.schedules.classes import ScheduleZBVHalf
from zbpipe.schedules.runtime import PlannedSchedule

NAMES = sorted(SCHEDULE_CLASSES)


def _spellings(name: str) -> list[str]:
    cls_name = SCHEDULE_CLASSES[name].__name__
    return [name, name.lower(), name.upper(), cls_name, cls_name.lower()]


def test_zbvhalf_resolves_through_zbpipe_get_schedule_class():
    # Issue 20: this raised while torch's registered lookup returned the class.
    assert zbpipe.get_schedule_class("ZBVHalf") is ScheduleZBVHalf


@pytest.mark.parametrize("name", NAMES)
def test_zbpipe_get_schedule_class_resolves_every_name(name):
    for spelling in _spellings(name):
        assert zbpipe.get_schedule_class(spelling) is SCHEDULE_CLASSES[name], spelling


@pytest.mark.parametrize("name", [n for n in NAMES if is_torch_shaped(SCHEDULE_CLASSES[n])])
def test_torch_get_schedule_class_resolves_every_torch_shaped_name_the_same(name, torch_get):
    for spelling in _spellings(name):
        assert torch_get(spelling) is zbpipe.get_schedule_class(spelling), spelling
        assert registration.lookup_zbpipe(spelling) is SCHEDULE_CLASSES[name], spelling


def test_continuous_is_zbpipe_only(torch_get):
    # It needs optimizer= and owns the optimizer step: torch's and torchtitan's builders cannot
    # drive it.
    assert zbpipe.get_schedule_class("Continuous") is ScheduleContinuous
    assert registration.lookup_zbpipe("Continuous") is None
    with pytest.raises(ValueError):
        torch_get("Continuous")
    assert [n for n in NAMES if not is_torch_shaped(SCHEDULE_CLASSES[n])] == ["Continuous"]


@pytest.mark.parametrize("name", NAMES)
def test_no_zbpipe_name_shadows_one_of_torchs(name):
    # zbpipe's names are looked up first: one equal to torch's would hide torch's class.
    torch_own = registration.original_get_schedule_class()
    for spelling in (name, SCHEDULE_CLASSES[name].__name__):
        with pytest.raises(ValueError):
            torch_own(spelling)


def test_torch_names_fall_back_to_torch():
    assert zbpipe.get_schedule_class("1F1B") is torch_schedules.Schedule1F1B
    assert zbpipe.get_schedule_class("zbvzerobubble") is torch_schedules.ScheduleZBVZeroBubble


def test_unknown_name_lists_zbpipe_names_and_torch_ones():
    with pytest.raises(ValueError, match=r"zbpipe knows .*ZBVHalf.*; torch: .*ZBVZeroBubble"):
        zbpipe.get_schedule_class("NoSuchSchedule")


def test_every_zbpipe_schedule_class_has_a_name_in_the_table():
    defined = {
        obj
        for module in (zbpipe.schedules, zbpipe.schedules.classes)
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, PlannedSchedule) and obj is not PlannedSchedule
    }
    assert set(SCHEDULE_CLASSES.values()) == defined | {ScheduleContinuous}


def test_a_line_added_to_the_table_is_found_by_every_lookup(torch_get, monkeypatch):
    class ScheduleLate(PlannedSchedule):
        plan_name = "1F1B"

    monkeypatch.setitem(SCHEDULE_CLASSES, "Late", ScheduleLate)
    assert find_schedule_class("late") is ScheduleLate
    assert zbpipe.get_schedule_class("ScheduleLate") is ScheduleLate
    assert torch_get("LATE") is ScheduleLate
