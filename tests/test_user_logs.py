"""Logs a user can act on (issue 47): one line per decision, INFO where nothing is wrong, no
warning about a mode nobody chose, advice in the form the user's entry point accepts.

Each test calls the function that logs, with no process group (cheap: no ranks launched), and
reads the records with ``caplog``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest


def _records(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


# ---------------------------------------------------------------- ZBDualPipeV without collectives
def test_dualpipev_without_communication_points_says_so_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from zbpipe.schedules.overlapped import ScheduleDualPipeV

    sched = ScheduleDualPipeV.__new__(ScheduleDualPipeV)  # only the reporting method runs
    caplog.set_level(logging.DEBUG, logger="zbpipe.schedules.overlapped")
    for found in (True, False):  # points searched for and none found; none declared
        sched._report_no_overlap([], found)
    records = _records(caplog, "zbpipe.schedules.overlapped")
    assert len(records) == 2
    assert all(r.levelno == logging.INFO for r in records)  # a PP-only model: nothing wrong
    assert "found no communication point" in records[0].getMessage()


# ------------------------------------------------ the native build in the background
class _Running:
    """A background build still under way (``Popen.poll`` answers None)."""

    def poll(self) -> None:
        return None


def test_first_step_beside_the_background_build_names_it_once_with_the_command(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from zbpipe.engines.native.availability import NativeSource
    from zbpipe.engines.weight_capture import CaptureState

    src = NativeSource()
    src._builder = _Running()  # type: ignore[assignment]  # as _spawn leaves it
    caplog.set_level(logging.DEBUG, logger="zbpipe.engines.native")
    engines = [CaptureState(source=src), CaptureState(source=src)]  # two stages, one process
    for _ in range(3):
        for e in engines:
            e.step_begins()
    records = _records(caplog, "zbpipe.engines.native")
    assert len(records) == 1, [r.getMessage() for r in records]  # once per process
    assert records[0].levelno == logging.INFO
    text = records[0].getMessage()
    assert "`python -m zbpipe build-native`" in text and "slower" in text


def test_no_step_line_without_a_build_under_way(caplog: pytest.LogCaptureFixture) -> None:
    from zbpipe.engines.native.availability import NativeSource
    from zbpipe.engines.weight_capture import CaptureState

    src = NativeSource()  # settled without a module (declined, or never started): no build
    caplog.set_level(logging.DEBUG, logger="zbpipe.engines.native")
    state = CaptureState(source=src)
    state.step_begins()
    state.step_begins()
    assert _records(caplog, "zbpipe.engines.native") == []


# ---------------------------------------------------------------- the memory re-plan's line
def _v_sched(name: str, p: int, m: int, entry: str | None) -> SimpleNamespace:
    from zbpipe.planning import Costs, plan

    sched = SimpleNamespace(
        safe_first_step=True, exact=False, layout="v", pp_group_size=p, _n_microbatches=m,
        _num_stages=2 * p, costs=Costs(), _plan_options={}, entry_name=entry, rank=0,
        memory_unit_bytes=None, memory_costs=None,
        _stages=[SimpleNamespace(group=None, stage_index=s) for s in (0, 2 * p - 1)],
    )  # fmt: skip
    sched.build_plan = lambda q, n, c, **o: plan(name, q, n, costs=c, **o)
    sched.equal_bytes_plan = sched.plan = plan(name, p, m, costs=Costs())
    return sched


#: V-Min's bytes under the graph engine on the 4-rank GPT (tests/schedules/test_memory_promise.py):
#: its plan within its promise is slower than 1F1B; ZB-V and V-Half, with more memory, are not
F_HELD, B_HELD = [0.904] + [0.855] * 6 + [1.97], [0.196] + [0.145] * 6 + [0.19]


@pytest.mark.parametrize("entry", [None, "ZBVMin"])
def test_a_plan_slower_than_1f1b_is_said_at_info_with_advice_for_the_entry_point(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, entry: str | None
) -> None:
    import re

    from zbpipe.planning import plan, simulate
    from zbpipe.planning.budget import parse_budget
    from zbpipe.schedules import memory_replan

    unit = 1000.0
    held = {s: {"F": F_HELD[s] * unit, "B": (F_HELD[s] + B_HELD[s]) * unit} for s in range(8)}
    monkeypatch.setattr(memory_replan, "gather_stage_values", lambda local, group: held)
    sched = _v_sched("ZBVMin", 4, 8, entry)
    caplog.set_level(logging.DEBUG, logger="zbpipe.schedules.memory_replan")
    chosen = memory_replan.MemoryReplanner().choose(sched)
    records = _records(caplog, "zbpipe.schedules.memory_replan")
    assert len(records) == 1 and records[0].levelno == logging.INFO  # no WARNING: V-Min ran
    text = records[0].getMessage()
    assert chosen.name == "ZBVMin" and "No ZBVMin plan within the promise beats 1F1B" in text
    if entry is None:
        assert "zbpipe.choose_schedule(..., memory_limit=...)" in text
        return
    # through a name (torchtitan's config): the name option, with a budget that holds the
    # most memory-hungry faster offer (ZB-V's plan for the measured bytes, simulated here)
    assert "choose_schedule" not in text and "memory_limit=" not in text
    budget = re.search(r"e\.g\. 'AutoV:([^']+)'", text)
    assert budget is not None, text
    zbv = plan("ZBV", 4, 8, costs=sched.memory_costs)
    need = max(simulate(zbv, sched.memory_costs).peak_memory.values()) * sched.memory_unit_bytes
    assert need <= parse_budget(budget.group(1))[0] <= need * 1.01


# ---------------------------------------------------------------- ZBDualPipeV's budget advice
def test_dualpipev_advises_a_name_a_config_can_carry_and_that_name_keeps_every_pair() -> None:
    from zbpipe.integrations.names import find_schedule_class
    from zbpipe.planning import Costs, plan
    from zbpipe.planning.budget import parse_budget
    from zbpipe.planning.v.dualpipev import skeleton_budget
    from zbpipe.schedules.overlapped import ScheduleDualPipeV, pairs_report

    p, m, unit, costs = 2, 4, 2048.0, Costs()
    tight = plan("ZBDualPipeV", p, m, costs=costs, memory_limit=3.0)  # the pairs do not fit
    assert len(tight.pairs) < tight.meta["skeleton_pairs"]
    level, text = pairs_report(tight, costs, unit)  # the constructor's user: its argument
    assert level == logging.WARNING and "pass memory_limit=5 (memory units" in text
    level, text = pairs_report(tight, costs, unit, "ZBDualPipeV:profile")
    assert level == logging.WARNING and "memory_limit=" not in text
    name = text.split("name the schedule '")[1].split("'")[0]
    assert name == "ZBDualPipeV:profile:10.0KiB"  # 5 units of 2 KiB (skeleton_budget below)
    assert parse_budget("10.0KiB")[0] == skeleton_budget(p, m, costs) * unit
    cls = find_schedule_class(name)  # the name resolves, with the budget fixed ...
    assert cls is not None and cls.fixed_options["memory_limit"] == "10.0KiB"
    sched = ScheduleDualPipeV.__new__(cls)  # ... and, once the bytes are measured, its plan
    sched.memory, sched.pairs, sched.byte_budget = "zb", "most", 10 * 1024.0  # (as __init__)
    sched.memory_unit_bytes = unit
    kept = sched.build_plan(p, m, costs)
    assert kept.meta["memory_budget"] == pytest.approx(5.0)  # 10 KiB in units of 2 KiB
    assert len(kept.pairs) >= kept.meta["skeleton_pairs"]  # keeps every pair ...
    assert pairs_report(kept, costs, unit, name) == (logging.DEBUG, "")  # ... and says nothing


def test_dualpipev_budget_names_take_bytes_only() -> None:
    from zbpipe.integrations.names import find_schedule_class

    with pytest.raises(ValueError, match="its budget is bytes like"):
        find_schedule_class("ZBDualPipeV:1p")


def test_a_schedule_built_by_torchtitans_pipeline_llm_knows_its_config_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torchtitan")
    from zbpipe.integrations import torchtitan_integration as tt
    from zbpipe.schedules.entry import entry_name

    monkeypatch.setenv("ZBPIPE_SPLIT", "default")  # (the split is not what this checks)
    seen = []
    wrapped = tt._wrap_pipeline_llm(lambda model, **kwargs: seen.append(entry_name()))
    for name in ("ZBDualPipeV:profile", "1F1B"):  # a zbpipe name; torch's, passed through
        parallelism = SimpleNamespace(pipeline_parallel_schedule=name)
        wrapped(None, parallelism=parallelism, parallel_dims=None)
    assert seen == ["ZBDualPipeV:profile", None]
    assert entry_name() is None  # reset after the build
