"""``"<name>:nopromise"``: ``memory_promise=False`` where only a schedule name can be configured
(torchtitan's ``pipeline_parallel_schedule``), with the other options in any order; the
schedules that take a memory budget instead, or make no promise, refuse it clearly."""

from __future__ import annotations

import pytest

import zbpipe
from zbpipe.schedules.classes import ScheduleZBH1, ScheduleZBInterleaved, ScheduleZBV


@pytest.mark.parametrize(
    "name,base,fixed",
    [
        ("ZBV:nopromise", ScheduleZBV, {"memory_promise": False}),
        ("zbh1:NoPromise", ScheduleZBH1, {"memory_promise": False}),
        ("ZBVHalf:nopromise", ScheduleZBV, {"memory": "half", "memory_promise": False}),
        (
            "ZBInterleaved:deferred:nopromise",
            ScheduleZBInterleaved,
            {"split": "deferred", "memory_promise": False},
        ),
    ],
)
def test_nopromise_is_the_class_with_memory_promise_false(name, base, fixed):
    cls = zbpipe.get_schedule_class(name)
    assert issubclass(cls, base) and cls is not base
    assert cls.fixed_options == fixed
    assert cls.layout == base.layout and cls.stages_per_rank == base.stages_per_rank
    one = zbpipe.get_schedule_class("ZBInterleaved:nopromise:deferred")
    assert zbpipe.get_schedule_class("ZBInterleaved:deferred:nopromise") is one


@pytest.mark.parametrize(
    "name,says",
    [
        ("ZBV:nopromise:nopromise", "given twice"),
        ("ZBH1:nopromise:profile", "do not go together"),
        ("ZB1P:nopromise", "a memory budget is given instead"),
        ("Auto:nopromise", "a memory budget is given instead"),
        ("1F1BMulti:nopromise", "takes no ':nopromise'"),
        ("Continuous:nopromise", "takes no ':nopromise'"),
    ],
)
def test_a_name_that_cannot_drop_the_promise_is_a_clear_error(name, says):
    with pytest.raises(ValueError, match=says):
        zbpipe.get_schedule_class(name)


def test_the_constructor_refuses_memory_promise_false_beside_a_budget_or_a_profile():
    with pytest.raises(ValueError, match="memory_promise must be True or False"):
        ScheduleZBH1([], 4, memory_promise="no")
    with pytest.raises(ValueError, match="memory_promise=False with costs='profile'"):
        ScheduleZBH1([], 4, memory_promise=False, costs="profile")
    with pytest.raises(ValueError, match="the budget is the promise"):
        zbpipe.ScheduleZBAuto([], 4, memory_limit="2p", memory_promise=False)


def test_the_memory_line_offers_nopromise_only_where_the_schedule_takes_it():
    """A re-made plan's line names ``:nopromise`` (or ``memory_promise=False``), except where
    that is refused: with ``costs="profile"`` or a ``memory_limit``."""
    from types import SimpleNamespace

    from zbpipe.planning import Costs, plan
    from zbpipe.schedules.memory_replan import _unkept_offer

    equal = plan("ZBH1", 2, 4)
    remade = plan("1F1B", 2, 4)  # any other order stands for the plan the promise re-made
    costs = Costs()

    def offer(**attrs):
        base = dict(equal_bytes_plan=equal, _profiler=None, _plan_options={}, entry_name=None)
        return _unkept_offer(SimpleNamespace(**{**base, **attrs}), remade, costs, 1.0)

    assert "memory_promise=False keeps the plan for equal bytes" in offer()
    assert "'ZBH1:nopromise' keeps the plan" in offer(entry_name="ZBH1")
    assert offer(_profiler=object()) == ""
    assert offer(memory_limit="1p") == ""
    assert offer(_plan_options={"memory_limit": 3.0}) == ""
    same = SimpleNamespace(
        equal_bytes_plan=equal, _profiler=None, _plan_options={}, entry_name=None
    )
    assert _unkept_offer(same, equal, costs, 1.0) == ""  # the promise changed nothing
