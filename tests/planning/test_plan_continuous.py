"""Continuous (flush-free) plans: sync rule, weight-version bounds, periods, the bubble saved."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zbpipe.planning.continuous.periods import (
    MODES,
    check_continuous,
    continuous_parts,
    live_versions,
    plan_continuous,
)
from zbpipe.planning.core import Action, PlanError, loop_placement, make_plan
from zbpipe.planning.costs import Costs
from zbpipe.planning.loop.onef1b import plan_1f1b
from zbpipe.planning.loop.zbh1 import plan_zbh1
from zbpipe.planning.metrics import bubble_rate
from zbpipe.planning.simulator import simulate


def idle(result):
    """Sum over ranks of (rank span - busy): time a rank sits between its first and last action.

    The staggered start (rank r waits for its first activation) and the mirrored end are not
    counted, as in the paper's bubble rate; what is left is the bubble a boundary could add.
    """
    return sum(
        ivs[-1].end - ivs[0].start - result.busy[r] for r, ivs in result.timeline.items() if ivs
    )


def sync_rule_holds(plan, m):
    """Written independently of check_continuous: per rank, last W of k before first F of k + 1."""
    for acts in plan.order.values():
        for k in range(plan.n_microbatches // m - 1):
            last_w = max(i for i, a in enumerate(acts) if a.kind == "W" and a.microbatch // m == k)
            first_f = min(
                i for i, a in enumerate(acts) if a.kind == "F" and a.microbatch // m == k + 1
            )
            if last_w > first_f:
                return False
    return True


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 8), (4, 12)])
def test_sync_equal_costs_bubbles_only_at_start_and_end(p, m):
    # F = B = W = 1, comm 0, m >= 2p - 1: each mini-batch is ZB-H2's parallelogram, whose rank
    # spans are all 3m, so mini-batch k + 1 reaches rank r exactly when k's last W ends there.
    results = {n: simulate(plan_continuous(p, m, n_minibatches=n)) for n in (2, 20)}
    assert idle(results[2]) == pytest.approx(idle(results[20]), abs=1e-9)
    for n, r in results.items():
        assert r.makespan == pytest.approx(3 * m * n + p - 1)  # paper's ZB-H2 makespan, N times m


def test_sync_n20_bubble_rate_below_zbh1_step_by_step():
    p, m, n = 4, 8, 20
    cont = simulate(plan_continuous(p, m, n_minibatches=n))
    # Step by step = a flush before every optimizer step (global clip and NaN check need all
    # stages): mini-batch k runs ZB-H1's timeline shifted by k * makespan on every rank.
    one = simulate(plan_zbh1(p, m))
    flushed = {
        r: [
            (iv.start + k * one.makespan, iv.end + k * one.makespan) for k in range(n) for iv in ivs
        ]
        for r, ivs in one.timeline.items()
    }
    step_by_step = bubble_rate(flushed)
    assert one.makespan == 3 * m + p - 1  # the paper's ZB-H1 makespan with unit costs
    assert step_by_step == pytest.approx(
        1 - 3 * m * n / ((n - 1) * (3 * m + p - 1) + 3 * m + p - 1), abs=1e-12
    )
    assert cont.bubble_rate < step_by_step
    assert cont.makespan == 3 * m * n + p - 1 < n * one.makespan


def test_sync_beats_zbh1_concatenated_without_flush():
    # A stronger baseline: ZB-H1's per-rank orders joined under the sync rule (no barrier).
    p, m, n = 4, 8, 20
    segment = plan_zbh1(p, m, exact=True).order
    orders = {
        r: [Action(a.stage, a.kind, a.microbatch + k * m) for k in range(n) for a in acts]
        for r, acts in segment.items()
    }
    joined = simulate(make_plan("ZBH1xN", p, n * m, loop_placement(p, p), orders))
    assert simulate(plan_continuous(p, m, n_minibatches=n)).makespan < joined.makespan


def test_hand_worked_two_ranks_one_microbatch():
    # p = 2, m = 1: nothing to overlap in sync mode; each rank runs F B W per mini-batch and
    # rank 0's next F waits for its own W: 5 units per mini-batch (F, F, B, B, W on the chain).
    pl = plan_continuous(2, 1, n_minibatches=2)
    assert [str(a) for a in pl.order[0]] == ["0F0", "0B0", "0W0", "0F1", "0B1", "0W1"]
    assert simulate(pl).makespan == 10
    assert pl.meta["step_after"] == {0: (2, 5), 1: (2, 5)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "p,m,costs",
    [
        (4, 8, Costs()),
        (3, 2, Costs(f=1, b=1.5, w=0.5, comm=0.2)),
        (5, 7, Costs(f=[1, 1.3, 1, 0.8, 1])),
    ],
)
def test_joining_k_periods_validates(mode, p, m, costs):
    parts = continuous_parts(p, m, costs, mode=mode)
    for k in range(1, 6):
        n = k + 1
        pl = make_plan(
            "joined", p, n * m, loop_placement(p, p), parts.join(n), minibatch_size=m, mode=mode
        )
        simulate(pl, costs, parts.memory_limit)  # complete, deadlock-free, within memory
        check_continuous(pl)
        assert pl.order == plan_continuous(p, m, costs, n_minibatches=n, mode=mode).order


costs_st = st.builds(
    Costs,
    f=st.floats(0.5, 2.0),
    b=st.floats(0.5, 2.0),
    w=st.floats(0.2, 2.0),
    comm=st.floats(0.0, 0.5),
)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 16), n=st.integers(1, 4), costs=costs_st)
def test_sync_property(p, m, n, costs):
    pl = plan_continuous(p, m, costs, n_minibatches=n)
    pl.validate()  # every (stage, microbatch) has F, B, W exactly once
    base = simulate(plan_1f1b(p, m), costs)
    limit = 2 * max(base.peak_memory.values())  # ZB-2p's default budget
    r = simulate(pl, costs, memory_limit=limit)  # raises on deadlock or memory overflow
    assert sync_rule_holds(pl, m)
    assert r.makespan <= n * base.makespan + 1e-9
    for rank, steps in pl.meta["step_after"].items():
        for k, i in enumerate(steps):
            acts = pl.order[rank]
            assert acts[i].kind == "W" and acts[i].microbatch // m == k
            assert all(not (a.kind == "W" and a.microbatch // m == k) for a in acts[i + 1 :])


def _stash_versions(acts, m):
    """Most weight versions a stash stage holds: the latest (steps done, a step after each
    mini-batch's last W) and the one each in-flight microbatch's F saw."""
    w_left = {}
    for a in acts:
        if a.kind == "W":
            w_left[a.microbatch // m] = w_left.get(a.microbatch // m, 0) + 1
    steps, seen, worst = 0, {}, 1
    for a in acts:
        if a.kind == "F":
            seen[a.microbatch] = steps
        elif a.kind == "W":
            del seen[a.microbatch]
            w_left[a.microbatch // m] -= 1
            while w_left.get(steps) == 0:
                steps += 1
        worst = max(worst, len(set(seen.values()) | {steps}))
    return worst


# 12 drawn cases (25 before) and the corners written out: one rank; the largest p and m over
# the most mini-batches; m < p
@settings(max_examples=12, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 16), n=st.integers(1, 4), costs=costs_st)
@example(p=1, m=1, n=4, costs=Costs(f=0.5, b=2.0, w=0.2, comm=0.5))
@example(p=8, m=16, n=4, costs=Costs(f=1.0, b=1.5, w=0.5, comm=0.1))
@example(p=8, m=3, n=3, costs=Costs(f=2.0, b=0.5, w=2.0, comm=0.0))
def test_2bw_and_stash_property(p, m, n, costs):
    base = simulate(plan_1f1b(p, m), costs)
    for mode in ("2bw", "stash"):
        pl = plan_continuous(p, m, costs, n_minibatches=n, mode=mode)
        simulate(pl, costs, memory_limit=2 * max(base.peak_memory.values()))
        for rank, acts in pl.order.items():
            if mode == "stash":  # PipeDream: at most p - s versions (independent of live_versions)
                assert _stash_versions(acts, m) <= p - rank
            else:  # 2BW: F of mini-batch k + 2 only after the last W of k (its weights exist)
                for k in range(n - 2):
                    last_w = max(
                        i for i, a in enumerate(acts) if a.kind == "W" and a.microbatch // m == k
                    )
                    first_f = min(
                        i
                        for i, a in enumerate(acts)
                        if a.kind == "F" and a.microbatch // m == k + 2
                    )
                    assert last_w < first_f
        bound = {s: (2 if mode == "2bw" else p - s) for s in range(p)}
        assert all(v <= bound[s] for s, v in live_versions(pl).items())


def test_2bw_keeps_two_versions_and_stash_p_minus_s():
    # p = 2, m = 1 (PipeDream's setting), worked by hand. Stash, rank 0: F0 F1 B0 W0 F2 ...:
    # after W0's update, microbatch 1 still holds version 0 beside the new version 1 (2 = p - 0);
    # rank 1 runs F B W back to back (1 = p - 1). 2BW, rank 1: F0 B0 W0 (update 0 -> version 1)
    # F1, and mini-batch 1 runs on version 0: 2 versions. Sync never needs more than 1.
    assert live_versions(plan_continuous(2, 1, n_minibatches=4, mode="stash")) == {0: 2, 1: 1}
    assert live_versions(plan_continuous(2, 1, n_minibatches=4, mode="2bw")) == {0: 2, 1: 2}
    assert live_versions(plan_continuous(4, 4, n_minibatches=3, mode="sync")) == {
        0: 1,
        1: 1,
        2: 1,
        3: 1,
    }


def test_check_continuous_rejects_f_before_previous_w():
    acts = [
        Action(0, "F", 0),
        Action(0, "B", 0),
        Action(0, "F", 1),
        Action(0, "W", 0),
        Action(0, "B", 1),
        Action(0, "W", 1),
    ]
    pl = make_plan("bad", 1, 2, {0: 0}, {0: acts}, minibatch_size=1, mode="sync")
    with pytest.raises(PlanError, match="rank 0 step 2"):
        check_continuous(pl)
    # The same order is legal under 2BW (mini-batch 1 runs on version 0).
    check_continuous(make_plan("ok", 1, 2, {0: 0}, {0: acts}, minibatch_size=1, mode="2bw"))


def test_check_continuous_rejects_a_third_2bw_version():
    # F of mini-batch 2 needs version 1, i.e. the update of mini-batch 0: here W0 comes later.
    acts = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "F", 2)] + [
        Action(0, k, i) for i in range(3) for k in ("B", "W")
    ]
    pl = make_plan("bad", 1, 3, {0: 0}, {0: acts}, minibatch_size=1, mode="2bw")
    with pytest.raises(PlanError, match="version 1"):
        check_continuous(pl)


def test_lower_memory_limit_down_to_1f1b_peak():
    p, m = 4, 8
    peak = max(simulate(plan_1f1b(p, m)).peak_memory.values())
    pl = plan_continuous(p, m, memory_limit=peak, n_minibatches=3)
    r = simulate(pl, memory_limit=peak)
    assert (
        r.makespan > simulate(plan_continuous(p, m, n_minibatches=3)).makespan
    )  # bubbles come back
    with pytest.raises(ValueError, match="below 1F1B's peak"):
        plan_continuous(p, m, memory_limit=peak - 1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        plan_continuous(2, 2, mode="async")
    with pytest.raises(ValueError, match="n_minibatches"):
        plan_continuous(2, 2, n_minibatches=0)


# 12 drawn cases (25 before) and the corners written out
@settings(max_examples=12, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 10), costs=costs_st)
@example(p=1, m=1, costs=Costs(f=0.5, b=2.0, w=0.2, comm=0.5))
@example(p=6, m=10, costs=Costs(f=1.0, b=1.5, w=0.5, comm=0.1))
@example(p=6, m=2, costs=Costs(f=2.0, b=0.5, w=2.0, comm=0.0))
def test_stale_plans_are_never_behind_sync_on_four_minibatches(p, m, costs):
    """Every sync order is a valid 2bw / stash order and is among their candidates, so over the
    4 joined mini-batches the planner compares on, a stale plan is never slower than sync's."""
    sync = simulate(plan_continuous(p, m, costs, n_minibatches=4), costs).makespan
    for mode in ("2bw", "stash"):
        stale = simulate(plan_continuous(p, m, costs, n_minibatches=4, mode=mode), costs)
        assert stale.makespan <= sync + 1e-9


@pytest.mark.parametrize("mode", ["2bw", "stash"])
def test_deferred_w_on_the_last_rank_shortens_the_stream(mode):
    """p = 2, m = 2, unit costs, by hand: rank 1 runs F0 B0 F1 B1 W0 W1 per mini-batch, so its
    last B ends at 6N - 1 (with W after each B, at 6N), rank 0's last B and W follow: 6N + 1,
    against sync's 7 per mini-batch (its stage 0 waits for the round trip every mini-batch)."""
    for n in (1, 3, 6):
        pl = plan_continuous(2, 2, n_minibatches=n, mode=mode)
        assert pl.order[1][:6] == tuple(
            Action(1, k, g) for k, g in (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1))
        )
        assert simulate(pl).makespan == pytest.approx(6 * n + 1)
    assert simulate(plan_continuous(2, 2, n_minibatches=6)).makespan == pytest.approx(42)


def test_minibatches_apart_on_hand_written_orders():
    """A rank's mini-batches are apart when no pass of k + 1 comes before a pass of k (m = 2)."""
    from zbpipe.planning.continuous.stale_orders import minibatches_apart

    def order(text):
        return [Action(0, t[0], int(t[1:])) for t in text.split()]

    assert minibatches_apart(order("F0 B0 F1 B1 W0 W1 F2 B2 F3 B3 W2 W3"), 2)
    assert minibatches_apart(order("F0 F1 B0 W0 B1 W1 F2"), 2)
    assert not minibatches_apart(order("F0 F1 F2 B0 W0 B1 W1"), 2)  # F of 1 before W of 0
    assert not minibatches_apart(order("F0 B0 F1 B1 F2 W1"), 2)  # W of 0 after F of 1
    with pytest.raises(ValueError, match="m must be >= 1"):
        minibatches_apart([], 0)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 3), (4, 4)])
def test_the_last_rank_of_a_2bw_stream_runs_its_minibatches_apart(p, m):
    """Where the runtime can run 2bw on the master (zbpipe.continuous.versions): the last rank
    of a stream plan runs no forward ahead, the others do."""
    from zbpipe.planning.continuous.stale_orders import minibatches_apart

    parts = continuous_parts(p, m, mode="2bw")
    assert parts.source.startswith("stream")
    joined = parts.join(3)
    assert [minibatches_apart(joined[r], m) for r in range(p)] == [False] * (p - 1) + [True]
