"""The first steps' plan keeps 1F1B's per-rank peak whatever each stage's bytes turn out to be
(one stage per rank), and a re-plan never gives up a faster plan that keeps the promise."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.rules import peak_memory
from zbpipe.planning.yardsticks import onef1b_rank_peaks
from zbpipe.schedules.memory_promise import fastest_keeping, first_step_plan


def _sched(name: str, p: int, m: int, costs: Costs, layout: str = "loop") -> SimpleNamespace:
    return SimpleNamespace(
        safe_first_step=True,
        exact=False,
        layout=layout,
        pp_group_size=p,
        _n_microbatches=m,
        _num_stages=p if layout == "loop" else 2 * p,
        costs=costs,
        _plan_options={},
        build_plan=lambda q, n, c, **o: plan(name, q, n, costs=c, **o),
    )


bytes_st = st.lists(
    st.tuples(st.floats(0.01, 100.0), st.floats(-1.0, 30.0)), min_size=6, max_size=6
)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 12), held=bytes_st)
@pytest.mark.parametrize("name", ["ZBH1", "ZB1P"])
def test_first_step_plan_keeps_each_ranks_1f1b_peak_whatever_the_bytes(name, p, m, held):
    # (ZB-1p and ZB-2p run ZB-H1's order in their first step too: it keeps a stricter promise)
    # The plan is made before any byte is known; the bytes are drawn afterwards: F holds f, B
    # frees part of it (b < 0) or holds up to 30 times more until W (checkpointing).
    times = Costs(f=1.0, b=1.2, w=0.8)
    first = first_step_plan(_sched(name, p, m, times))
    assert first is not None
    f = [held[r][0] for r in range(p)]
    b = [max(held[r][1], -1.0) * f[r] for r in range(p)]
    real = Costs(mem_f=f, mem_b=b, mem_w=[-(x + y) for x, y in zip(f, b)])
    yardstick = onef1b_rank_peaks(p, m, real)
    sc = real.per_stage(p)
    for r, acts in first.order.items():
        assert peak_memory(acts, sc) <= yardstick[r] * (1 + 1e-9) + 1e-9, (r, first)


def test_first_step_plan_costs_little_time():
    # the price of not knowing the bytes, in simulated step time against the plan for equal
    # bytes (unit costs): 1/13 at p = 2, m = 4 (the runs' shape); 3/27 at p = 4, m = 8
    for p, m, most in ((2, 4, 14 / 13), (4, 8, 30 / 27)):
        c = Costs()
        first = first_step_plan(_sched("ZBH1", p, m, c))
        assert first is not None
        ratio = simulate(first, c).makespan / simulate(plan("ZBH1", p, m, costs=c), c).makespan
        assert ratio <= most + 1e-9


def test_no_safe_plan_where_the_schedule_has_none():
    s = _sched("ZBH1", 2, 4, Costs())
    s.safe_first_step = False
    assert first_step_plan(s) is None


def test_a_faster_plan_within_the_budget_replaces_the_remade_one():
    c = Costs()
    slow = plan("1F1B", 4, 8, costs=c)
    fast = plan("ZBH1", 4, 8, costs=c)
    peak = max(simulate(fast, c).peak_memory.values())
    assert fastest_keeping([slow, fast], c, peak)[0] is fast
    # over the budget: the re-made plan stays, however slow
    assert fastest_keeping([slow, fast], c, peak - 0.5)[0] is slow
    # no budget known: the re-made plan stays
    assert fastest_keeping([slow, fast], c, None)[0] is slow


def test_a_remade_order_only_as_fast_leaves_the_plan_for_equal_bytes(monkeypatch):
    # Measured bytes (issue 37 item 4) under which ZB-V's plan for equal bytes already keeps the
    # promise (1F1B's peak, chunks joined in pairs), and the planner re-makes a different order
    # that the simulator finds exactly as fast: the plan for equal bytes (what
    # measure_memory=False runs) must stay. Before, the re-made order replaced it.
    from zbpipe.planning.yardsticks import onef1b_peak
    from zbpipe.schedules import memory_replan

    p, m, unit = 2, 4, 1000.0
    f = [0.51, 1.05, 0.54, 1.41]  # bytes per stage after F and kept by B until W, in units
    b = [1.29, 0.28, 0.17, 0.52]
    held = {s: {"F": f[s] * unit, "B": (f[s] + b[s]) * unit} for s in range(2 * p)}
    monkeypatch.setattr(memory_replan, "gather_stage_values", lambda local, group: held)
    equal = plan("ZBV", p, m, costs=Costs(), memory="zb")
    sched = _sched("ZBV", p, m, Costs(), layout="v")
    sched.build_plan = lambda q, n, c, **o: plan("ZBV", q, n, costs=c, memory="zb", **o)
    sched.equal_bytes_plan = sched.plan = equal
    sched._stages = [SimpleNamespace(group=None, stage_index=s) for s in (0, 3)]
    sched.rank, sched.memory_unit_bytes, sched.memory_costs = 1, None, None
    chosen = memory_replan.MemoryReplanner().choose(sched)
    measured = sched.memory_costs
    promise = _onef1b_peak_2ranks(held) / sched.memory_unit_bytes
    assert promise == pytest.approx(onef1b_peak(p, m, measured.joined(2)), rel=1e-2)
    remade = plan("ZBV", p, m, costs=measured, memory="zb")
    assert remade.order != equal.order  # (the old behaviour ran this)
    assert simulate(remade, measured).makespan == pytest.approx(simulate(equal, measured).makespan)
    assert max(simulate(equal, measured).peak_memory.values()) <= promise * (1 + 1e-2)
    assert chosen.order == equal.order
    # where the plan for equal bytes breaks the promise, the re-made plan runs
    held[3] = {"F": 2.0 * unit, "B": 3.0 * unit}  # a heavier head (rank 0 holds it with chunk 0)
    chosen = memory_replan.MemoryReplanner().choose(sched)
    measured = sched.memory_costs
    promise = _onef1b_peak_2ranks(held) / sched.memory_unit_bytes
    assert max(simulate(equal, measured).peak_memory.values()) > promise * 1.1
    assert max(simulate(chosen, measured).peak_memory.values()) <= promise * (1 + 1e-2)
    assert chosen.order != equal.order


def _onef1b_peak_2ranks(held: dict) -> float:
    """torch 1F1B's peak on 2 ranks (m >= 2) of the same 4 chunks (rank 0: chunks 0-1): rank
    0 holds both microbatches' forwards and one backward's extra, rank 1 one of each."""
    f = [held[s]["F"] for s in range(4)]
    extra = [held[s]["B"] - held[s]["F"] for s in range(4)]
    return max(2 * (f[0] + f[1]) + extra[0] + extra[1], f[2] + f[3] + extra[2] + extra[3])


@pytest.mark.parametrize("name", ["ZBH1", "ZB1P"])
def test_on_issue_37s_mlp_the_promise_needs_the_remade_plan_and_costs_one_step_in_13(name):
    # The bytes the probe measured on issue 37's 2-rank MLP (docs/results/memory-promise.md): a
    # Linear+ReLU stage holds more after B than after F (its output gradients, queued for W).
    k = 1024.0
    f, after_b = [512 * k, 640 * k], [1024 * k, 896 * k]
    promise = max(2 * f[0] + after_b[0] - f[0], after_b[1])  # torch 1F1B's rank 0: 1536 KiB
    unit = sum(f) / 2
    c = Costs(
        mem_f=[x / unit for x in f],
        mem_b=[(b - x) / unit for x, b in zip(f, after_b)],
        mem_w=[-b / unit for b in after_b],
    )
    equal, remade = plan(name, 2, 4, costs=Costs()), plan(name, 2, 4, costs=c)
    # the plan for equal bytes runs rank 1's B1 before W0: 2 x 896 KiB held, over the promise
    assert max(simulate(equal, c).peak_memory.values()) * unit > promise * 1.15
    assert max(simulate(remade, c).peak_memory.values()) * unit <= promise * (1 + 1e-9)
    # By hand (unit times): rank 1 can hold one B's bytes plus one F (1536 KiB), never two Bs,
    # so its B3 ends at 12 at the earliest, and rank 0's B3 and W3 follow: 14 against 13. The
    # same by exhaustive search over every order within the promise: the least any takes.
    # (searched once for both schedules: the bytes, the budget and m are the same)
    fb = (tuple(f), tuple(after_b))
    assert simulate(equal, c).makespan == 13 == _fastest_within(*fb, float("inf"), 4)
    assert simulate(remade, c).makespan == 14 == _fastest_within(*fb, promise, 4)


@functools.cache
def _fastest_within(f: tuple[float, ...], after_b: tuple[float, ...], budget: float, m: int) -> int:
    """The least step time, in units (F, B, W one unit each, no communication), of any pair of
    rank orders on 2 ranks (one stage each) whose held bytes stay within ``budget`` on each:
    F holds ``f[r]``, B raises it to ``after_b[r]``, W frees it. Microbatches are alike, so
    each kind runs in microbatch order without loss of generality."""

    def orders(r: int, seq: tuple, n: list[int], held: float) -> list[tuple]:
        if len(seq) == 3 * m:
            return [seq]
        out = []
        for kind, i, ok, add in (
            ("F", 0, n[0] < m, f[r]),
            ("B", 1, n[1] < n[0], after_b[r] - f[r]),
            ("W", 2, n[2] < n[1], -after_b[r]),
        ):
            if ok and held + add <= budget:
                nxt = list(n)
                nxt[i] += 1
                out += orders(r, (*seq, (kind, n[i])), nxt, held + add)
        return out

    def span(o0: tuple, o1: tuple) -> float:
        end: dict = {}
        at, clock, seqs = [0, 0], [0, 0], (o0, o1)
        moved = True
        while moved:
            moved = False
            for r in (0, 1):
                while at[r] < 3 * m:
                    kind, mb = seqs[r][at[r]]
                    dep = (0, "F", mb) if (r, kind) == (1, "F") else None
                    dep = (1, "B", mb) if (r, kind) == (0, "B") else dep
                    if dep is not None and dep not in end:
                        break
                    clock[r] = max(clock[r], end.get(dep, 0)) + 1
                    end[(r, kind, mb)] = clock[r]
                    at[r] += 1
                    moved = True
        return max(clock) if at == [3 * m, 3 * m] else float("inf")

    return int(
        min(
            span(a, b) for a in orders(0, (), [0, 0, 0], 0.0) for b in orders(1, (), [0, 0, 0], 0.0)
        )
    )


def test_when_the_promise_cannot_beat_1f1b_the_line_offers_the_faster_schedules_only():
    # V-Min's bytes under the graph engine on the 4-rank GPT (benchmarks/v_budget.py): its
    # plan is slower than 1F1B, the line offers the V schedules that are not, each at its own
    # simulated time against 1F1B's, and not V-Min itself (its plan is not made again).
    from zbpipe.schedules.memory_promise import cost_line

    p, m = 4, 8
    f, b = [0.904] + [0.855] * 6 + [1.97], [0.196] + [0.145] * 6 + [0.19]
    c = Costs(mem_f=f, mem_b=b, mem_w=[-(x + y) for x, y in zip(f, b)])
    sched = SimpleNamespace(pp_group_size=p, _n_microbatches=m, _num_stages=2 * p, layout="v")
    chosen = plan("ZBVMin", p, m, costs=c)
    t_1f1b = simulate(plan("1F1B", p, m, costs=c.joined(2)), c.joined(2)).makespan
    assert simulate(chosen, c).makespan > t_1f1b
    text, beats = cost_line(sched, chosen, c, plan("ZBV", p, m, costs=Costs()), None)
    assert not beats and "No ZBVMin plan within the promise beats 1F1B" in text
    offered = text.split("faster with more memory: ")[1]
    for name in ("ZBVHalf", "ZBV"):
        ratio = simulate(plan(name, p, m, costs=c), c).makespan / t_1f1b
        assert ratio < 1
        assert f"{name} {ratio:.3f}x its time" in offered
    assert "ZBVMin" not in offered


def test_a_plan_made_within_a_tighter_budget_still_offers_its_own_schedule_at_its_own():
    # A byte budget (ScheduleZBAuto's memory_limit="...GiB": ZB-2p's generator at that limit)
    # tight enough that the plan is slower than 1F1B: the same schedule at its own budget (2x
    # 1F1B's peak) is the fastest offer (B twice F or W: ZB-H1 and ZB-1p leave more bubble), and
    # the line must name it. Only a plan made for its own budget is left out of the offer (its
    # plan would be made again for nothing).
    from zbpipe.planning.yardsticks import onef1b_peak
    from zbpipe.schedules.memory_promise import cost_line

    p, m = 4, 8
    c = Costs(f=1.0, b=2.0, w=1.0)
    sched = SimpleNamespace(pp_group_size=p, _n_microbatches=m, _num_stages=p, layout="loop")
    t_1f1b = simulate(plan("1F1B", p, m, costs=c), c).makespan
    tight = plan("ZB2P", p, m, costs=c, memory_limit=0.25 * onef1b_peak(p, m, c))  # 1 in flight
    own = plan("ZB2P", p, m, costs=c)  # at its own budget, as the chooser plans it
    assert simulate(tight, c).makespan > t_1f1b > simulate(own, c).makespan
    text, beats = cost_line(sched, tight, c, plan("ZB2P", p, m, costs=Costs()), None)
    assert not beats
    ratio = simulate(own, c).makespan / t_1f1b
    offered = text.split("faster with more memory: ")[1]
    assert f"ZB2P {ratio:.3f}x its time" in offered
    for name in ("ZBH1", "ZB1P"):  # slower than ZB-2p at its own budget here
        assert simulate(plan(name, p, m, costs=c), c).makespan > simulate(own, c).makespan


def test_the_plan_for_equal_bytes_stays_on_a_tie_only_within_the_budget_and_no_slower():
    # fastest_keeping's tie rule against hand-made cases: unit costs, p = 4, m = 8, where 1F1B
    # takes 33 units at a peak of 4 and ZB-H1 27 at the same peak (closed forms: 1F1B
    # (m + p - 1)(f + b + w); ZB-H1 m (f + b + w) + (p - 1)(f + b - w)).
    c = Costs()
    onef1b, zbh1 = plan("1F1B", 4, 8, costs=c), plan("ZBH1", 4, 8, costs=c)
    twin = plan("ZBH1", 4, 8, costs=c)  # the same order, another object: a tie
    assert (simulate(onef1b, c).makespan, simulate(zbh1, c).makespan) == (33, 27)
    assert max(simulate(zbh1, c).peak_memory.values()) == 4
    # a tie within the budget: the preferred plan
    assert fastest_keeping([zbh1, twin], c, 4.0, prefer=twin)[0] is twin
    # a tie over the budget: the re-made plan
    assert fastest_keeping([zbh1, twin], c, 3.5, prefer=twin)[0] is zbh1
    # slower within the budget: the faster, re-made plan
    assert fastest_keeping([zbh1, onef1b], c, 4.0, prefer=onef1b)[0] is zbh1
    # a faster third candidate beats the preferred one, which is not preferred over it
    assert fastest_keeping([onef1b, onef1b, zbh1], c, 4.0, prefer=onef1b)[0] is zbh1
    # the preferred plan is the fastest: chosen (as any faster plan within the budget)
    assert fastest_keeping([onef1b, zbh1], c, 4.0, prefer=zbh1)[0] is zbh1


GPT_HELD = ([1.02, 0.965, 0.965, 1.05], [-0.057, -0.002, -0.002, -0.058])
EVEN_HELD = ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])  # the plan for equal bytes keeps it


@pytest.mark.parametrize(
    "ties,times,held_units,asks",
    [
        (0, Costs(), GPT_HELD, False),
        (4, Costs(), GPT_HELD, True),
        (4, Costs(b=1.2, w=0.8), GPT_HELD, False),
        (4, Costs(), EVEN_HELD, False),
    ],
)
def test_the_replan_asks_the_v_planner_for_the_schedules_choice_among_ties(
    monkeypatch, ties, times, held_units, asks
):
    # The 2-rank GPT's bytes (tests/planning/test_perturbed_ties.py): the plan for equal bytes
    # breaks the promise and several re-made orders tie. The re-plan runs the planner's plan for
    # the measured bytes with the schedule's ``replan_perturbed_ties`` (4 for ZB-V, 0 for
    # V-Half and V-Min) where the time costs are the equal guess (not where the user gave
    # times) and the plan for equal bytes breaks the promise (where it keeps it, it runs on a
    # tie anyway), and the plan it runs is that one.
    from zbpipe.planning.v.zbv import plan_zbv
    from zbpipe.schedules import memory_replan

    p, m, unit = 2, 4, 1000.0
    f, b = held_units
    held = {s: {"F": f[s] * unit, "B": (f[s] + b[s]) * unit} for s in range(2 * p)}
    monkeypatch.setattr(memory_replan, "gather_stage_values", lambda local, group: held)
    asked = []

    def build(q, n, c, **o):
        asked.append(o)
        return plan("ZBV", q, n, costs=c, memory="zb", **o)

    sched = _sched("ZBV", p, m, times, layout="v")
    sched.build_plan, sched.replan_perturbed_ties = build, ties
    sched.equal_bytes_plan = sched.plan = plan("ZBV", p, m, costs=times, memory="zb")
    sched._stages = [SimpleNamespace(group=None, stage_index=s) for s in (0, 3)]
    sched.rank, sched.memory_unit_bytes, sched.memory_costs = 1, None, None
    chosen = memory_replan.MemoryReplanner().choose(sched)
    assert asked == [{"perturbed_ties": ties} if asks else {}]
    generator = plan_zbv(p, m, sched.memory_costs)
    if asks:
        assert chosen.order == plan_zbv(p, m, sched.memory_costs, perturbed_ties=ties).order
        assert chosen.order != generator.order  # (the GPT's bytes tie: see there)
    elif held_units is GPT_HELD:
        assert chosen.order == generator.order
    else:  # (the plan for equal bytes keeps the promise: it runs)
        assert chosen.order == sched.equal_bytes_plan.order
