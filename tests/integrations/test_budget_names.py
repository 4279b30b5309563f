"""A memory budget where only a schedule name can be configured (torchtitan's
``pipeline_parallel_schedule``): ``"<name>:<budget>"`` names the class with that budget fixed."""

from __future__ import annotations

import pytest

import zbpipe
from zbpipe.integrations.names import lookup_zbpipe, register, unregister
from zbpipe.schedules.chooser import ScheduleAuto, ScheduleAutoV
from zbpipe.schedules.classes import ScheduleZBAuto


@pytest.mark.parametrize(
    "name,base,budget",
    [
        ("Auto:40GiB", ScheduleAuto, "40GiB"),
        ("autov:512MiB", ScheduleAutoV, "512MiB"),
        ("ZBAuto:1p", ScheduleZBAuto, "1p"),
        ("ScheduleAuto:80%", ScheduleAuto, "80%"),
    ],
)
def test_a_name_with_a_budget_is_the_class_with_that_memory_limit(name, base, budget):
    cls = zbpipe.get_schedule_class(name)
    assert issubclass(cls, base) and cls is not base
    assert cls.fixed_option == ("memory_limit", budget)
    assert cls.layout == base.layout and cls.stages_per_rank == base.stages_per_rank
    assert zbpipe.get_schedule_class(name) is cls  # one class per name: identity checks hold


def test_torchs_get_schedule_class_resolves_it_once_registered():
    from torch.distributed.pipelining import schedules

    register()
    try:
        assert issubclass(schedules.get_schedule_class("Auto:40GiB"), ScheduleAuto)
        assert lookup_zbpipe("AutoV:40GiB") is zbpipe.get_schedule_class("AutoV:40GiB")
    finally:
        unregister()


def test_a_budget_on_a_schedule_without_one_is_a_clear_error():
    with pytest.raises(ValueError, match="takes no memory budget"):
        zbpipe.get_schedule_class("ZBH1:40GiB")
    with pytest.raises(ValueError, match="unknown option 'plenty'.*'1p', '2p', bytes"):
        zbpipe.get_schedule_class("Auto:plenty")


def test_the_fixed_budget_cannot_be_overridden():
    cls = zbpipe.get_schedule_class("Auto:40GiB")
    with pytest.raises(ValueError, match="runs memory_limit='40GiB'; got memory_limit='1p'"):
        cls([], 4, memory_limit="1p")
