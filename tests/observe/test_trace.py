"""The tracer records one event per action on the host clock.

The clock is a fake here (``clock``: each read returns the next whole second), so every start
and end is known exactly: no test reads a real clock. A Trace's bubble rate is the paper's.
"""

import itertools
import types

import pytest

from zbpipe.observe import trace
from zbpipe.observe.timeline import Event
from zbpipe.observe.trace import Trace, Tracer


@pytest.fixture
def clock(monkeypatch):
    """The tracer's host clock replaced: its reads return 1.0, 2.0, 3.0, ... in turn."""
    reads = itertools.count(1)
    fake = types.SimpleNamespace(perf_counter=lambda: float(next(reads)))
    monkeypatch.setattr(trace, "time", fake)
    return fake


def test_spans_become_ordered_events_and_clear_empties_them(clock):
    tr = Tracer(rank=3)
    with tr.span("F", 1, 0):
        pass
    with tr.span("B", 1, 0):
        pass
    (f, b) = tr.events
    assert (f.rank, f.kind, f.stage, f.microbatch) == (3, "F", 1, 0) and b.kind == "B"
    # the clock read on entering and on leaving each span, in that order
    assert (f.start, f.end, b.start, b.end) == (1.0, 2.0, 3.0, 4.0)
    tr.clear()
    assert tr.events == []


def test_a_disabled_tracer_records_nothing():
    tr = Tracer(enabled=False)
    with tr.span("F", 0, 0):
        pass
    assert tr.events == []


def test_bubble_rate_of_a_hand_worked_trace():
    # rank 0 busy [0,1] and [2,3] (span 3), rank 1 busy [1,3] (span 2): busy 4 of 2 x 3.
    t = Trace(
        {
            0: [Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "BW", 0, 0, 2.0, 3.0)],
            1: [Event(1, "F", 1, 0, 1.0, 2.0), Event(1, "BW", 1, 0, 2.0, 3.0)],
        }
    )
    assert t.bubble_rate == pytest.approx(1 - 4 / 6)
    assert t.makespan == pytest.approx(3.0)
    assert t.busy() == {0: 2.0, 1: 2.0} and t.busy("F") == {0: 1.0, 1: 1.0}


def test_a_span_whose_body_raises_is_recorded_and_the_error_propagates(clock):
    tr = Tracer(rank=0)
    with pytest.raises(ZeroDivisionError), tr.span("BW", 2, 5):
        1 / 0  # noqa: B018
    (e,) = tr.events
    assert (e.kind, e.stage, e.microbatch, e.start, e.end) == ("BW", 2, 5, 1.0, 2.0)


def test_nested_spans_each_record_their_own_interval(clock):
    tr = Tracer(rank=0)
    with tr.span("F", 0, 0):
        with tr.span("B", 0, 1):
            pass
    inner, outer = tr.events  # the inner span ends first
    assert (inner.kind, outer.kind) == ("B", "F")
    assert (outer.start, inner.start, inner.end, outer.end) == (1.0, 2.0, 3.0, 4.0)


def test_events_read_between_spans_keep_their_order_and_waits(clock):
    # the spans store plain tuples; reading ``events`` builds the Events, as often as it is read
    tr = Tracer(rank=1)
    with tr.span("F", 0, 0):
        tr.add_wait(0.25)
    first = list(tr.events)
    with tr.span("BW", 0, 0):
        pass
    f, bw = tr.events
    assert first == [f] and isinstance(f, Event) and isinstance(bw, Event)
    assert (f.kind, f.waited, bw.kind, bw.waited) == ("F", 0.25, "BW", 0.0)
    assert (f.start, f.end, bw.start, bw.end) == (1.0, 2.0, 3.0, 4.0)
    assert tr.gather().events == {1: [f, bw]}  # one process, no process group
    tr.clear()
    with tr.span("W", 0, 0):
        pass
    assert [e.kind for e in tr.events] == ["W"]
