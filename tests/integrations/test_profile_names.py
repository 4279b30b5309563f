"""``costs="profile"`` where only a schedule name can be configured (torchtitan's
``pipeline_parallel_schedule``): ``"<name>:profile"``, with a memory mode (``"ZBVHalf:profile"``)
or a budget (``"AutoV:40GiB:profile"``); wrong options are clear errors."""

from __future__ import annotations

import pytest

import zbpipe
from tests.integrations import _profile_name_cases as cases
from zbpipe.integrations.names import lookup_zbpipe, register, unregister
from zbpipe.schedules.chooser import ScheduleAuto, ScheduleAutoV
from zbpipe.schedules.classes import ScheduleZBH1, ScheduleZBV
from zbpipe.testing import run_ranks


@pytest.mark.parametrize(
    "name,base,fixed",
    [
        ("ZBV:profile", ScheduleZBV, {"costs": "profile"}),
        ("zbv:PROFILE", ScheduleZBV, {"costs": "profile"}),
        ("ScheduleZBH1:profile", ScheduleZBH1, {"costs": "profile"}),
        ("ZBVHalf:profile", ScheduleZBV, {"memory": "half", "costs": "profile"}),
        ("ZBVMin:profile", ScheduleZBV, {"memory": "min", "costs": "profile"}),
        ("Auto:40GiB:profile", ScheduleAuto, {"memory_limit": "40GiB", "costs": "profile"}),
        ("AutoV:1P:profile", ScheduleAutoV, {"memory_limit": "1p", "costs": "profile"}),
    ],
)
def test_a_profile_name_is_the_class_with_costs_profile(name, base, fixed):
    cls = zbpipe.get_schedule_class(name)
    assert issubclass(cls, base) and cls is not base
    assert cls.fixed_options == fixed
    assert cls.layout == base.layout and cls.stages_per_rank == base.stages_per_rank
    assert zbpipe.get_schedule_class(name) is cls  # one class per name: identity checks hold


def test_the_options_in_either_order_name_one_class():
    assert zbpipe.get_schedule_class("AutoV:profile:40GiB") is zbpipe.get_schedule_class(
        "AutoV:40GiB:profile"
    )
    assert zbpipe.get_schedule_class("Auto:40GiB").fixed_options == {"memory_limit": "40GiB"}


def test_torchs_get_schedule_class_resolves_it_once_registered():
    from torch.distributed.pipelining import schedules

    register()
    try:
        assert schedules.get_schedule_class("ZBV:profile") is zbpipe.get_schedule_class(
            "ZBV:profile"
        )
        assert lookup_zbpipe("ZBVHalf:profile") is zbpipe.get_schedule_class("ZBVHalf:profile")
        assert lookup_zbpipe("1F1B:profile") is None  # torch's names take no options
    finally:
        unregister()


@pytest.mark.parametrize(
    "name,message",
    [
        ("ZBV:fast", r"unknown option 'fast'\. A name takes ':profile'.*'Auto', 'AutoV', 'ZBAuto'"),
        ("ZBV:", "unknown option ''"),
        ("Auto:plenty", "unknown option 'plenty'.*'1p', '2p', bytes like '40GiB'"),
        ("ZBV:profile:profile", "':profile' given twice"),
        ("Auto:1p:40GiB", r"two memory budgets \('1p', '40GiB'\)"),
        ("ZBH1:40GiB:profile", "ScheduleZBH1 takes no memory budget"),
        ("ZB1P:40GiB", "ScheduleZB1P takes no memory budget"),
        ("Continuous:profile", "ScheduleContinuous takes no ':profile'"),
    ],
)
def test_a_wrong_option_is_a_clear_error(name, message):
    with pytest.raises(ValueError, match=message):
        zbpipe.get_schedule_class(name)


def test_the_fixed_costs_cannot_be_overridden():
    cls = zbpipe.get_schedule_class("ZBV:profile")
    with pytest.raises(ValueError, match="runs costs='profile'; got costs=None"):
        cls([], 4, costs=None)


def test_built_as_torchtitan_builds_it_profiles_replans_and_keeps_the_gradients():
    """2 gloo ranks, 4 steps (1 warm-up, 2 measured, the re-plan at the end of the third, one
    step on the new plan): the last step's gradients equal an unpipelined reference's."""
    names = ["ZBV:profile", "ZBH1:profile", "AutoV:40GiB:profile"]
    for rank_rows in run_ranks(cases.built_like_torchtitan, 2, names, timeout=180):
        for name, (cls_name, replanned, worst) in zip(names, rank_rows):
            assert cls_name == "Schedule" + name, cls_name
            assert replanned, name
            assert worst < 1e-5, (name, worst)
