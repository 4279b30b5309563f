"""A split made for the schedule: never slower than torchtitan's default split in the simulator,
within the memory the default split was promised; hand-worked cases; the analytic costs.

References are computed here: torchtitan's default rule written out again from its description
(equal pieces per stage, the embedding and the head one piece each, the remainder to the first
stages), the stage costs summed by hand, every makespan from the simulator on those sums.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.layer_costs import layer_costs_from_config
from zbpipe.planning.split import LayerCost, choose_split
from zbpipe.planning.yardsticks import promised_peak


def torchtitan_default(num_layers: int, num_stages: int) -> list[int]:
    """Pieces per stage under torchtitan's rule (input and output weight 1)."""
    effective = num_layers + 2
    per, extra = divmod(effective, num_stages)
    return [per + (1 if s < extra else 0) for s in range(num_stages)]


def costs_of(layers: list[LayerCost], sizes: list[int] | tuple[int, ...]) -> Costs:
    f, b, w, mem, i = [], [], [], [], 0
    for n in sizes:
        run = layers[i : i + n]
        i += n
        f.append(sum(x.f for x in run))
        b.append(sum(x.b for x in run))
        w.append(sum(x.w for x in run))
        mem.append(sum(x.mem for x in run))
    return Costs(f=f, b=b, w=w, mem_f=mem, mem_b=0, mem_w=[-x for x in mem])


def run_of(schedule, p, m, layers, sizes, plan_for):
    costs = costs_of(layers, sizes)
    pl = plan(schedule, p, m) if plan_for == "equal" else plan(schedule, p, m, costs=costs)
    r = simulate(pl, costs)
    return r.makespan, max(r.peak_memory.values()), costs


piece = st.builds(
    lambda f, b, w, mem: (f, b, w, mem),
    st.floats(0.05, 3),
    st.floats(0.05, 3),
    st.floats(0.0, 3),
    st.floats(0.1, 3),
)


@settings(max_examples=30, deadline=None)
@given(
    schedule=st.sampled_from(["1F1B", "ZBH1", "ZBV", "ZBVHalf", "ZBDualPipeV"]),
    m=st.integers(2, 8),
    raw=st.lists(piece, min_size=6, max_size=9),
    plan_for=st.sampled_from(["equal", "equal", "costs"]),
)
def test_never_slower_than_torchtitans_default_and_within_its_promise(schedule, m, raw, plan_for):
    p = 2
    layers = [LayerCost((f"piece{i}",), *x) for i, x in enumerate(raw)]
    num_stages = 4 if schedule.startswith("ZBV") or schedule == "ZBDualPipeV" else 2
    default = torchtitan_default(len(layers) - 2, num_stages)
    chosen = choose_split(layers, p, schedule, m, plan_for=plan_for)

    assert sum(chosen.sizes) == len(layers) and min(chosen.sizes) >= 1
    assert list(chosen.baseline_sizes) == default
    # the parts are the pieces' names, contiguous, in model order
    assert [n for part in chosen.parts for n in part] == [x.names[0] for x in layers]
    assert [len(part) for part in chosen.parts] == list(chosen.sizes)

    base_time, base_peak, base_costs = run_of(schedule, p, m, layers, default, plan_for)
    time, peak, _ = run_of(schedule, p, m, layers, chosen.sizes, plan_for)
    assert time <= base_time * (1 + 1e-9)
    assert chosen.makespan == pytest.approx(time, rel=1e-6)
    assert chosen.baseline_makespan == pytest.approx(base_time, rel=1e-6)
    promise = promised_peak(schedule, p, m, base_costs, stages_per_rank=num_stages // p)
    limit = base_peak if promise is None else max(promise, base_peak)
    assert peak <= limit * (1 + 1e-6)


def test_one_microbatch_every_split_is_as_fast_and_the_default_stays():
    # m = 1: the pipeline runs every piece once, one after the other: the makespan is the sum
    # of all F, B and W whatever the split, so no split is strictly faster than the default.
    layers = [LayerCost((f"x{i}",), 1.0 + i, 0.5, 0.25, 1.0) for i in range(6)]
    chosen = choose_split(layers, 2, "1F1B", 1)
    assert chosen.sizes == chosen.baseline_sizes == (3, 3)
    assert chosen.makespan == pytest.approx(sum(1.0 + i + 0.75 for i in range(6)))


def test_heavy_head_on_two_ranks_gets_a_stage_of_its_own():
    # Four unit layers between a free embedding and a head worth four of them (F = B = W each a
    # third). The default (3, 3) gives stage 1 the work of 6 layers and stage 0 of 2; with many
    # microbatches 1F1B's step is the heavier stage's work per microbatch, so the best split
    # balances 4 against 4: the embedding and the four layers, then the head alone, once the
    # memory it holds is not capped (it moves activations to rank 0, which holds p = 2 of them).
    # Checked against every split there is.
    third = 1.0 / 3
    layers = [LayerCost(("emb",), 0.0, 0.0, 0.0, 0.0)]
    layers += [LayerCost((f"l{i}",), third, third, third, 1.0) for i in range(4)]
    layers += [LayerCost(("head",), 4 * third, 4 * third, 4 * third, 1.0)]
    chosen = choose_split(layers, 2, "1F1B", 8, memory_limit=float("inf"))
    assert chosen.sizes == (5, 1)
    assert chosen.parts == (("emb", "l0", "l1", "l2", "l3"), ("head",))
    every = {(a, 6 - a): run_of("1F1B", 2, 8, layers, (a, 6 - a), "equal")[0] for a in range(1, 6)}
    assert chosen.makespan == pytest.approx(min(every.values()))
    assert chosen.gain == pytest.approx(every[(3, 3)] / every[(5, 1)])
    assert chosen.gain > 1.3
    # Under the default limit (1F1B promises nothing: the default split's own peak, 2 in-flight
    # microbatches of stage 0's 2 units = 4), (5, 1) would hold 2 x 4 = 8 on rank 0; the best
    # split within 4 units keeps stage 0 at 2 units of memory: (3, 3) itself.
    capped = choose_split(layers, 2, "1F1B", 8)
    assert capped.memory_limit == pytest.approx(4.0)
    assert capped.sizes == (3, 3) and capped.gain == 1.0


def test_v_placement_balances_rank_0_holding_both_ends():
    # ZB-V on 2 ranks: rank 0 holds stages 0 and 3 (embedding and head), rank 1 stages 1 and 2.
    # A head worth two layers makes the default's rank 0 the slowest. The chosen split is the
    # best of every split of these 8 pieces into 4 stages (or within 2% of it: a local search),
    # among those within the memory limit, with the default limit and with none.
    layers = [LayerCost(("emb",), 0.01, 0.0, 0.01, 0.0)]
    layers += [LayerCost((f"l{i}",), 1.0, 1.0, 1.0, 1.0) for i in range(6)]
    layers += [LayerCost(("head",), 2.0, 2.0, 2.0, 1.0)]
    every = {s: run_of("ZBV", 2, 8, layers, s, "costs")[:2] for s in _compositions(8, 4)}
    default_time = every[(2, 2, 2, 2)][0]
    for limit in (None, float("inf")):
        chosen = choose_split(layers, 2, "ZBV", 8, plan_for="costs", memory_limit=limit)
        best = min(t for t, peak in every.values() if peak <= chosen.memory_limit + 1e-9)
        assert chosen.makespan < default_time
        assert chosen.makespan <= best * 1.02
        assert every[chosen.sizes] == (pytest.approx(chosen.makespan), chosen.peak_memory)
    assert chosen.sizes[-1] == 1  # unlimited: the head alone on the last stage


def _compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def test_bad_input_is_a_clear_error():
    layers = [LayerCost((f"x{i}",), 1, 1, 1, 1) for i in range(3)]
    with pytest.raises(ValueError, match="every stage needs one"):
        choose_split(layers, 2, "ZBV", 4)  # 3 pieces, 4 stages
    with pytest.raises(ValueError, match="baseline"):
        choose_split(layers, 2, "1F1B", 4, baseline=[1, 1])
    with pytest.raises(ValueError, match="f must be"):
        LayerCost(("x",), -1, 1, 1, 1)


def test_analytic_costs_count_the_flops_by_hand():
    h, ffn, seq, vocab = 64, 192, 16, 1000
    pieces = layer_costs_from_config(num_layers=2, hidden=h, vocab=vocab, seq=seq, ffn_hidden=ffn)
    assert [p.names for p in pieces] == [
        ("tok_embeddings",),
        ("layers.0",),
        ("layers.1",),
        ("norm", "lm_head"),
    ]
    linear = 2 * seq * (4 * h * h) + 2 * seq * 3 * h * ffn  # q k v o, then SwiGLU's 3 matrices
    scores = 2 * seq * seq * h
    layer = pieces[1]
    assert (layer.f, layer.b, layer.w) == (linear + scores, linear + 2 * scores, linear)
    head = pieces[-1]
    assert head.f == head.b == head.w == 2 * seq * h * vocab
    assert pieces[0].f <= layer.f / 100  # a lookup


def test_analytic_moe_costs_count_the_active_experts_only():
    common = dict(num_layers=3, hidden=64, vocab=100, seq=8, ffn_hidden=256)
    moe = layer_costs_from_config(
        **common, num_experts=8, top_k=2, moe_ffn_hidden=32, shared_experts=1, dense_layers=1
    )
    dense = layer_costs_from_config(**common)
    assert moe[1] == dense[1]  # the first layer is dense
    # 3 active experts of width 32 against a dense 256: 3 * 3 * 2 * 8 * 64 * (256 - 96) fewer
    # FLOPs, less the router's 2 * 8 * 64 * 8
    fewer = 2 * 8 * 3 * 64 * (256 - 3 * 32) - 2 * 8 * 64 * 8
    assert dense[2].w - moe[2].w == fewer
    with pytest.raises(ValueError, match="top_k"):
        layer_costs_from_config(**common, num_experts=4, top_k=5, moe_ffn_hidden=8)
