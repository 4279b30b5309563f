"""Logs a user can act on (issue 47): one line per decision, INFO where nothing is wrong, no
warning about a mode nobody chose, advice in the form the user's entry point accepts.

Each test calls the function that logs, with no process group (cheap: no ranks launched), and
reads the records with ``caplog``.
"""

from __future__ import annotations

import logging

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
