"""The split-backward engine where only a schedule name can be configured (torchtitan's
``pipeline_parallel_schedule``): ``"<name>:deferred"``, ``"<name>:graph"``, ``"<name>:auto"``,
with the other name options in any order; wrong ones are clear errors."""

from __future__ import annotations

import pytest

import zbpipe
from tests.integrations import _split_name_cases as cases
from zbpipe.continuous.schedule import ScheduleContinuous
from zbpipe.integrations.names import lookup_zbpipe
from zbpipe.schedules.chooser import ScheduleAutoV
from zbpipe.schedules.classes import ScheduleZBH1, ScheduleZBV
from zbpipe.testing import run_ranks


@pytest.mark.parametrize(
    "name,base,fixed",
    [
        ("ZBV:deferred", ScheduleZBV, {"split": "deferred"}),
        ("zbh1:GRAPH", ScheduleZBH1, {"split": "graph"}),
        ("ZBVHalf:deferred", ScheduleZBV, {"memory": "half", "split": "deferred"}),
        ("ZBV:graph:profile", ScheduleZBV, {"split": "graph", "costs": "profile"}),
        ("AutoV:40GiB:deferred", ScheduleAutoV, {"memory_limit": "40GiB", "split": "deferred"}),
        ("Continuous:graph", ScheduleContinuous, {"split": "graph"}),
    ],
)
def test_an_engine_name_is_the_class_with_split_fixed(name, base, fixed):
    cls = zbpipe.get_schedule_class(name)
    assert issubclass(cls, base) and cls is not base
    assert cls.fixed_options == fixed
    assert cls.layout == base.layout and cls.stages_per_rank == base.stages_per_rank
    assert zbpipe.get_schedule_class(name) is cls  # one class per name: identity checks hold


def test_the_options_in_any_order_name_one_class():
    one = zbpipe.get_schedule_class("AutoV:40GiB:deferred:profile")
    assert zbpipe.get_schedule_class("AutoV:profile:deferred:40GiB") is one
    assert zbpipe.get_schedule_class("AutoV:deferred:40GiB:profile") is one


@pytest.mark.parametrize(
    "name,message",
    [
        ("ZBV:deferred:graph", r"two engines \('deferred', 'graph'\)"),
        ("ZBV:fast", r"an engine for the split backward \(':auto', ':deferred', ':graph'\)"),
    ],
)
def test_a_wrong_engine_option_is_a_clear_error(name, message):
    with pytest.raises(ValueError, match=message):
        zbpipe.get_schedule_class(name)


def test_torchs_own_names_take_no_engine():
    assert lookup_zbpipe("1F1B:deferred") is None
    with pytest.raises(ValueError, match="unknown schedule"):
        zbpipe.get_schedule_class("1F1B:deferred")


def test_the_fixed_engine_cannot_be_overridden():
    cls = zbpipe.get_schedule_class("ZBV:deferred")
    with pytest.raises(ValueError, match="runs split='deferred'; got split='graph'"):
        cls([], 4, split="graph")


def test_the_name_chooses_the_engine_a_schedule_runs():
    """On stages whose weights are mostly outside ``nn.Linear`` the default (``auto``) takes
    the graph engine; ``":deferred"`` overrides it; both give the reference gradients."""
    names = ["ZBV", "ZBV:deferred", "ZBV:graph", "ZBVHalf:auto"]
    (got,) = run_ranks(cases.built_by_name, 1, names, timeout=120)
    assert [(cls, split) for cls, split, _ in got] == [
        ("ScheduleZBV", "graph"),
        ("ScheduleZBV:deferred", "deferred"),
        ("ScheduleZBV:graph", "graph"),
        ("ScheduleZBVHalf:auto", "graph"),
    ]
    assert max(worst for _, _, worst in got) < 1e-5, got
