"""A V schedule's first step: microbatch 0's round trip through the V, then the rest of the plan
made for the measured bytes, keeps the promise whatever each chunk holds
(zbpipe.schedules.measured_start; docs/use/memory-budgets.md, "The first step").

Pure planning, no process: the bytes of every chunk's F and B are drawn (a head up to 20 times
a block chunk; B freeing part of what F held, or holding up to 10 times more until W:
checkpointing), the plan is made for them as the runtime makes it, and the whole first step's
order (the round trip, then the rest) is simulated against the promise of the same bytes.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.core import Action
from zbpipe.planning.yardsticks import promised_peak, v_minimum_memory
from zbpipe.schedules.measured_start import rest_after, round_trip


def _first_step(name: str, p: int, m: int, costs: Costs):
    planned = plan(name, p, m, costs=costs)
    prefix = round_trip(SimpleNamespace(pp_group_size=p))
    budget = promised_peak(name, p, m, costs, stages_per_rank=2)
    rest = rest_after(planned, prefix, costs, budget)
    first = dataclasses.replace(planned, order={r: tuple(prefix[r] + rest[r]) for r in rest})
    first.validate()
    return first


@settings(max_examples=10, deadline=None)
@given(
    p=st.integers(2, 4),
    m=st.integers(1, 10),
    body=st.lists(st.floats(0.2, 5.0), min_size=8, max_size=8),
    head=st.floats(0.2, 20.0),
    b_ratio=st.lists(st.floats(-0.9, 10.0), min_size=8, max_size=8),
)
@pytest.mark.parametrize("name", ["ZBV", "ZBVHalf", "ZBVMin"])
def test_the_first_step_keeps_the_promise_whatever_the_bytes(name, p, m, body, head, b_ratio):
    n = 2 * p
    mem_f = body[: n - 1] + [head]
    mem_b = [b * f for b, f in zip(b_ratio, mem_f)]
    real = Costs(mem_f=mem_f, mem_b=mem_b, mem_w=[-(f + b) for f, b in zip(mem_f, mem_b)])
    first = _first_step(name, p, m, real)
    peak = max(simulate(first, real).peak_memory.values())  # also: no deadlock
    promise = promised_peak(name, p, m, real, stages_per_rank=2)
    assert promise is not None
    floor = v_minimum_memory(real.per_stage(n), p)  # the least any plan holds (documented)
    assert peak <= max(promise, floor) * (1 + 1e-9) + 1e-9, (peak, promise, floor)


def test_microbatch_0_goes_down_the_v_and_back_first():
    assert round_trip(SimpleNamespace(pp_group_size=3)) == {
        0: [Action(0, "F", 0), Action(5, "F", 0), Action(5, "B", 0), Action(0, "B", 0)],
        1: [Action(1, "F", 0), Action(4, "F", 0), Action(4, "B", 0), Action(1, "B", 0)],
        2: [Action(2, "F", 0), Action(3, "F", 0), Action(3, "B", 0), Action(2, "B", 0)],
    }


@pytest.mark.parametrize(("p", "m", "most"), [(2, 4, 29 / 25), (2, 8, 53 / 49), (4, 8, 63 / 51)])
def test_the_round_trip_costs_the_first_step_what_the_docs_say(p, m, most):
    # equal bytes and times: the rest is ZB-V's own plan; microbatch 0's trip with the other
    # ranks idle costs the simulated step (module docstring of measured_start)
    c = Costs()
    first = simulate(_first_step("ZBV", p, m, c), c).makespan
    assert first <= most * simulate(plan("ZBV", p, m, costs=c), c).makespan + 1e-9
