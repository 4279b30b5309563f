"""The simulator on hand-worked cases, and its error messages."""

import pytest

from zbpipe.planning import Action, Costs, Plan, PlanError, plan_1f1b, simulate


def test_hand_worked_1f1b_p2_m2_with_comm():
    # f = b = w = 1 (BW = 2), comm 0.5. Rank 0: F0 F1 BW0 BW1; rank 1: F0 BW0 F1 BW1.
    # rank 0: F0 [0,1]  F1 [1,2]
    # rank 1: F0 [1.5,2.5] (0F0 ends 1, +0.5)  BW0 [2.5,4.5]  F1 [4.5,5.5]  BW1 [5.5,7.5]
    # rank 0: BW0 [5,7] (1BW0 ends 4.5, +0.5)  BW1 [8,10] (1BW1 ends 7.5, +0.5)
    res = simulate(plan_1f1b(2, 2), Costs(comm=0.5))
    times = {
        r: [(str(iv.action), iv.start, iv.end) for iv in ivs] for r, ivs in res.timeline.items()
    }
    assert times[0] == [("0F0", 0, 1), ("0F1", 1, 2), ("0BW0", 5, 7), ("0BW1", 8, 10)]
    assert times[1] == [
        ("1F0", 1.5, 2.5),
        ("1BW0", 2.5, 4.5),
        ("1F1", 4.5, 5.5),
        ("1BW1", 5.5, 7.5),
    ]
    assert res.makespan == 10
    assert res.busy == {0: 6, 1: 6}
    # spans: rank 0 is 10, rank 1 is 6; bubble = 1 - 12 / (2 * 10)
    assert res.bubble_rate == pytest.approx(0.4)
    assert res.peak_memory == {0: 2, 1: 1}


def _plan(order, num_ranks, m, placement):
    return Plan("hand", num_ranks, m, placement, {r: tuple(a) for r, a in order.items()})


def test_split_backward_same_rank_has_no_comm():
    # One rank, one stage: F0 B0 W0 back to back even with comm, since nothing crosses ranks.
    pl = _plan({0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "W", 0)]}, 1, 1, {0: 0})
    res = simulate(pl, Costs(f=1, b=2, w=3, comm=5))
    assert [(iv.start, iv.end) for iv in res.timeline[0]] == [(0, 1), (1, 3), (3, 6)]
    assert res.bubble_rate == 0


def test_memory_accounting_is_signed():
    # F allocates 2 at start, B frees 0.5, W frees 1.5: peak 2 + 2 - 0.5 = 3.5 after F1 starts.
    acts = [
        Action(0, "F", 0),
        Action(0, "B", 0),
        Action(0, "F", 1),
        Action(0, "W", 0),
        Action(0, "B", 1),
        Action(0, "W", 1),
    ]
    res = simulate(_plan({0: acts}, 1, 2, {0: 0}), Costs(mem_f=2, mem_b=-0.5, mem_w=-1.5))
    assert res.peak_memory == {0: 3.5}


def test_deadlock_names_ranks_and_steps():
    # Rank 1 forwards microbatch 1 first, but rank 0 sends it only after backward 0, which
    # rank 1 runs after its F1: a cycle.
    a = Action
    order = {
        0: [a(0, "F", 0), a(0, "BW", 0), a(0, "F", 1), a(0, "BW", 1)],
        1: [a(1, "F", 1), a(1, "BW", 1), a(1, "F", 0), a(1, "BW", 0)],
    }
    with pytest.raises(PlanError) as err:
        simulate(_plan(order, 2, 2, {0: 0, 1: 1}))
    msg = str(err.value)
    assert "deadlock" in msg and "ranks [0, 1]" in msg
    assert "rank 0 step 1 (0BW0)" in msg and "rank 1 step 0 (1F1)" in msg


def test_same_rank_dependency_violation():
    # Two stages on one rank; stage 1's forward is placed before stage 0's on that rank.
    a = Action
    order = {0: [a(1, "F", 0), a(0, "F", 0), a(1, "BW", 0), a(0, "BW", 0)]}
    with pytest.raises(
        PlanError, match=r"rank 0 step 0 \(1F0\) needs the activation of F0 from stage 0.*step 1"
    ):
        simulate(_plan(order, 1, 1, {0: 0, 1: 0}))


def test_incomplete_plan_is_rejected():
    order = {0: [Action(0, "F", 0), Action(0, "B", 0)]}  # W missing
    with pytest.raises(PlanError, match="stage 0 microbatch 0"):
        simulate(_plan(order, 1, 1, {0: 0}))


def test_memory_limit_violation_names_rank_and_step():
    # 1F1B p=4 puts 4 microbatches in flight on rank 0, the 4th at its step 3.
    with pytest.raises(PlanError, match=r"rank 0 step 3 \(0F3\).*memory_limit 3"):
        simulate(plan_1f1b(4, 8), memory_limit=3)
    assert max(simulate(plan_1f1b(4, 8), memory_limit=4).peak_memory.values()) == 4


def test_costs_must_match_stage_count():
    with pytest.raises(ValueError, match="length 3"):
        simulate(plan_1f1b(4, 4), Costs(f=[1, 1, 1]))


def test_per_stage_costs_used():
    # One microbatch through 3 stages, F = 1, 2, 3: forward chain ends at 6, backward (BW = b + w)
    # 2 each: 6 + 3 * 2 = 12.
    res = simulate(plan_1f1b(3, 1), Costs(f=[1, 2, 3]))
    assert res.makespan == 12


def test_summary_mentions_numbers():
    res = simulate(plan_1f1b(2, 2))
    text = res.summary()
    assert f"{res.bubble_rate:.2%}" in text and "makespan 9" in text


@pytest.mark.parametrize("name", ["1F1B", "ZBH1", "ZBV", "Continuous"])
def test_simulate_timing_gives_simulates_numbers(name):
    # The generators rank candidates with simulate_timing (no Interval per action): its makespan,
    # longest rank span and peaks must be simulate's, bit for bit, or a generator would choose
    # differently than the documented simulator says it should.
    from zbpipe.planning import plan
    from zbpipe.planning.simulator import simulate_timing

    costs = Costs(f=1, b=1.2, w=0.6, comm=0.05)
    pl = plan(name, 4, 9, costs=costs)
    full = simulate(pl, costs)
    timing = simulate_timing(pl, costs)
    spans = [ivs[-1].end - ivs[0].start for ivs in full.timeline.values() if ivs]
    assert timing.makespan == full.makespan
    assert timing.longest_span == max(spans)
    assert timing.peak_memory == full.peak_memory


def test_simulate_timing_raises_what_simulate_raises():
    from zbpipe.planning.simulator import simulate_timing

    with pytest.raises(PlanError, match=r"rank 0 step 3 \(0F3\).*memory_limit 3"):
        simulate_timing(plan_1f1b(4, 8), memory_limit=3)
