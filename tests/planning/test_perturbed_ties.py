"""Choosing among equally fast plans by drawn cost sets (planning/search/perturbed.py, plan_zbv's
``perturbed_ties``): never slower under the planned costs, within the same memory, the same on
every call, and less slowed when the real times are not the planned ones."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zbpipe.planning import Costs, Plan, plan, simulate
from zbpipe.planning.core import Action, make_plan
from zbpipe.planning.search.perturbed import least_sensitive, scenarios
from zbpipe.planning.simulator import simulate_timing
from zbpipe.planning.v.zbv import plan_zbv

# Issue 37's 2-rank GPT (benchmarks/sim_vs_trace.py --model gpt, sim_vs_trace_gpt_m4.json): the
# bytes a microbatch of each chunk holds after F and the change at B, in units (the probe's), and
# the chunks' measured F, B, W times in ms (W cheaper than B, as in most transformer layers).
GPT_BYTES = dict(
    mem_f=[1.02, 0.965, 0.965, 1.05],
    mem_b=[-0.057, -0.002, -0.002, -0.058],
    mem_w=[-0.963, -0.963, -0.963, -0.992],
)
GPT_TIMES = dict(f=[42.2, 42.0, 41.5, 42.4], b=[45.1, 44.3, 46.1, 45.0], w=[34.8, 35.4, 34.9, 37.1])


def test_the_gpt_remade_plan_keeps_its_speed_under_the_measured_times() -> None:
    bytes_only, measured = Costs(**GPT_BYTES), Costs(**GPT_BYTES, **GPT_TIMES)
    generator = plan_zbv(2, 4, bytes_only)
    chosen = plan_zbv(2, 4, bytes_only, perturbed_ties=4)
    without_promise = plan_zbv(2, 4)  # the plan for equal bytes: 1.035x the promise here
    assert simulate(chosen, bytes_only).makespan == simulate(generator, bytes_only).makespan == 25
    # the promise (1F1B's peak, the default budget) is kept by both
    budget = max(
        simulate(
            plan("1F1B", 2, 4, bytes_only.joined(2)), bytes_only.joined(2)
        ).peak_memory.values()
    )
    assert max(simulate(chosen, bytes_only).peak_memory.values()) <= budget + 1e-9
    assert max(simulate(without_promise, bytes_only).peak_memory.values()) > budget
    t_gen, t_chosen, t_free = (
        simulate(x, measured).makespan for x in (generator, chosen, without_promise)
    )
    assert t_chosen <= 0.97 * t_gen  # 1027.7 against 1086.5 ms with these times
    assert t_chosen <= 1.01 * t_free  # within a hundredth of the plan that ignores the promise
    assert chosen.meta["perturbed_ties"] == 4


# 12 random cases (30 before) and the largest size in each mode written out, with unequal bytes
# and a B that frees memory (-0.3) beside Bs that hold more (0.8)
_MEM = [(0.5, -0.3), (2.0, 0.8), (1.2, 0.1), (0.7, 0.5), (1.9, -0.2), (1.0, 0.0)]


@settings(max_examples=12, deadline=None)
@given(
    p=st.integers(2, 3),
    k=st.integers(2, 3),
    mem=st.lists(st.tuples(st.floats(0.5, 2.0), st.floats(-0.3, 0.8)), min_size=6, max_size=6),
    mode=st.sampled_from(["zb", "half", "min"]),
)
@example(p=3, k=3, mem=_MEM, mode="zb")
@example(p=3, k=3, mem=_MEM, mode="half")
@example(p=3, k=3, mem=_MEM, mode="min")
def test_never_slower_than_the_generators_choice_and_within_its_budget(p, k, mem, mode) -> None:
    mem = mem[: 2 * p]
    costs = Costs(
        mem_f=[f for f, _ in mem],
        mem_b=[f * b for f, b in mem],
        mem_w=[-(f + f * b) for f, b in mem],
    )
    m = k * p
    try:
        generator = plan_zbv(p, m, costs, memory=mode)
    except ValueError:
        return  # no plan fits the mode's budget with these bytes: nothing to compare
    chosen = plan_zbv(p, m, costs, memory=mode, perturbed_ties=3)
    budget = chosen.meta["memory_budget"]
    g, c = simulate_timing(generator, costs), simulate_timing(chosen, costs)
    assert round(c.longest_span, 9) <= round(g.longest_span, 9)
    assert round(c.makespan, 9) <= round(g.makespan, 9)
    assert max(simulate(chosen, costs).peak_memory.values()) <= budget + 1e-9
    assert chosen == plan_zbv(p, m, costs, memory=mode, perturbed_ties=3)  # every rank alike


def test_scenarios_move_times_only_within_the_spread_and_repeat() -> None:
    costs = Costs(f=[1, 2], b=[1, 3], w=[0.5, 1], comm=0.1, mem_f=[1, 2], mem_b=0, mem_w=[-1, -2])
    drawn = scenarios(costs, 2, count=5, spread=0.2)
    assert drawn == scenarios(costs, 2, count=5, spread=0.2)
    for d in drawn:
        for s in range(2):
            got, base = d.stage(s), costs.stage(s)
            for kind in ("f", "b", "w"):
                assert 0.8 * getattr(base, kind) <= getattr(got, kind) <= 1.2 * getattr(base, kind)
            assert (got.comm, got.mem_f, got.mem_b, got.mem_w) == (
                base.comm, base.mem_f, base.mem_b, base.mem_w,
            )  # fmt: skip
    assert len({d.f for d in drawn}) == 5
    with pytest.raises(ValueError, match="spread must be in"):
        scenarios(costs, 2, spread=1.0)


def _one_rank(order: str, name: str = "hand") -> Plan:
    """A 1-rank, 1-stage plan from ``"F0 F1 B0 ..."`` (the kind and the microbatch)."""
    actions = tuple(Action(0, a[0], int(a[1:])) for a in order.split())
    return make_plan(name, 1, 2, {0: 0}, {0: actions})


def test_least_sensitive_worked_by_hand() -> None:
    # One stage, one rank, two microbatches: every order of the same actions takes 2 (F + B + W)
    # under any costs (one rank never waits), so the two orders tie under every drawn set too
    # and the first given stays, whichever it is.
    costs = Costs()
    a, b = _one_rank("F0 B0 W0 F1 B1 W1"), _one_rank("F0 F1 B0 B1 W0 W1")
    drawn = scenarios(costs, 1, count=4)
    assert least_sensitive([a, b], costs, drawn) is a
    assert least_sensitive([b, a], costs, drawn) is b
    with pytest.raises(ValueError, match="at least one candidate"):
        least_sensitive([], costs, drawn)


def test_least_sensitive_prefers_the_plan_the_drawn_costs_slow_less() -> None:
    # The GPT's two re-made orders tie under its bytes with equal times (25 units each); the
    # drawn sets decide, by their mean makespan computed here, whatever the candidates' order;
    bytes_only = Costs(**GPT_BYTES)
    x, y = plan_zbv(2, 4, bytes_only), plan_zbv(2, 4, bytes_only, perturbed_ties=4)
    assert x.order != y.order
    drawn = scenarios(bytes_only, 4, count=16)
    mean = {id(c): sum(simulate(c, d).makespan for d in drawn) / 16 for c in (x, y)}
    want = min((x, y), key=lambda c: mean[id(c)])
    assert least_sensitive([x, y], bytes_only, drawn) is want
    assert least_sensitive([y, x], bytes_only, drawn) is want


def test_a_candidate_slower_than_the_first_is_never_chosen() -> None:
    # Under the GPT's measured times the generator's plan (x) is slower than the chosen one (y);
    # under the drawn set below (found by search) x is 5% faster. Scored on that set alone, x
    # would win: it must not, being slower than the first candidate under the planned costs.
    bytes_only, measured = Costs(**GPT_BYTES), Costs(**GPT_BYTES, **GPT_TIMES)
    x, y = plan_zbv(2, 4, bytes_only), plan_zbv(2, 4, bytes_only, perturbed_ties=4)
    drawn = [
        Costs(
            **GPT_BYTES,
            f=[2.91, 1.87, 1.13, 2.44],
            b=[0.36, 2.61, 0.62, 0.37],
            w=[0.52, 2.52, 0.25, 2.75],
        )
    ]
    assert simulate(x, drawn[0]).makespan < 0.96 * simulate(y, drawn[0]).makespan
    assert simulate(x, measured).makespan > simulate(y, measured).makespan
    assert least_sensitive([y, x], measured, drawn) is y
    assert least_sensitive([x, y], bytes_only, drawn) is x  # tied under equal times: x wins
