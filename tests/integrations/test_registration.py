"""zbpipe.integrations.names: torch's own get_schedule_class learns zbpipe's names, keeps
torch's."""

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from zbpipe.integrations import names as registration
from zbpipe.integrations.names import SCHEDULE_CLASSES
from zbpipe.schedules import Schedule1F1BMulti, ScheduleZBH1
from zbpipe.schedules.runtime import PlannedSchedule


def test_torch_lookup_finds_zbpipe_names(torch_get):
    assert torch_schedules.get_schedule_class("ZBH1") is ScheduleZBH1
    assert (
        torch_schedules.get_schedule_class("zbh1") is ScheduleZBH1
    )  # torch's lookup is case-insensitive
    assert torch_schedules.get_schedule_class("Schedule1F1BMulti") is Schedule1F1BMulti


def test_torch_names_still_resolve_to_torch_classes(torch_get):
    assert torch_schedules.get_schedule_class("1F1B") is torch_schedules.Schedule1F1B
    assert (
        torch_schedules.get_schedule_class("ZBVZeroBubble") is torch_schedules.ScheduleZBVZeroBubble
    )


def test_unknown_name_still_raises_value_error(torch_get):
    with pytest.raises(ValueError, match="NoSuchSchedule"):
        torch_schedules.get_schedule_class("NoSuchSchedule")


def test_classes_added_after_register_are_found(torch_get, monkeypatch):
    class ScheduleLate(PlannedSchedule):
        plan_name = "1F1B"

    monkeypatch.setitem(SCHEDULE_CLASSES, "Late", ScheduleLate)
    assert torch_schedules.get_schedule_class("late") is ScheduleLate


def test_register_is_idempotent_and_keeps_the_original_reachable():
    original = torch_schedules.get_schedule_class
    try:
        first = registration.register()
        assert registration.register() is first
        assert first.__wrapped__ is original
        assert registration.original_get_schedule_class() is original
    finally:
        registration.unregister()
    assert torch_schedules.get_schedule_class is original
    assert not registration.is_registered()


def test_modules_that_imported_the_function_by_name_are_rebound(monkeypatch):
    import sys
    import types

    user = types.ModuleType("_zbpipe_fake_user")
    user.get_schedule_class = (
        torch_schedules.get_schedule_class
    )  # like `from ... import get_schedule_class`
    monkeypatch.setitem(sys.modules, user.__name__, user)
    try:
        registration.register()
        assert user.get_schedule_class("ZBH1") is ScheduleZBH1
    finally:
        registration.unregister()
    with pytest.raises(ValueError):
        user.get_schedule_class("ZBH1")
