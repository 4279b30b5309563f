"""Memory promises by default: the first step measures what each stage holds, the plan is re-made
for those bytes, and the measured peak stays at torch 1F1B's on a model with a heavy head.

The model (``_memory_default_cases.HEAVY``): a tiny GPT whose LM head's logits and log-softmax
weigh about twice a stage of blocks, the case where a plan counting one unit per microbatch of
any stage let ZB-H1 hold 1.42x torch 1F1B's peak. Peaks are what ``SavedActivationMeter`` counts
(the same rules for torch's schedule and zbpipe's), in a step after the re-plan; the reference
gradients come from the unpipelined model in the same process.
"""

from __future__ import annotations

import pytest

from tests.schedules import _memory_default_cases as cases
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

RUNS = [("ZBH1", "deferred"), ("ZB1P", "deferred"), ("ZBV", "deferred"), ("ZBH1", "graph")]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Every 2-rank run of this file in one launch (``measure_memory=False`` too, which had a
    launch of its own)."""
    return run_ranks(cases.heavy_head_rows, 2, 4, RUNS, timeout=300)


@pytest.mark.parametrize("run", RUNS)
def test_default_schedule_re_plans_for_measured_bytes(two_ranks, run):
    for out in two_ranks:
        assert out[run]["replanned"], run
    # every rank holds the same measured bytes (they were exchanged)
    assert two_ranks[0][run]["mem_f"] == two_ranks[1][run]["mem_f"]
    head, first = two_ranks[0][run]["mem_f"][-1], two_ranks[0][run]["mem_f"][0]
    assert head > 1.5 * first, "the head stage is measured heavier"


@pytest.mark.parametrize("run", [r for r in RUNS if r[1] == "deferred"])
def test_default_peak_within_5_percent_of_torch_1f1b(two_ranks, run):
    torch_peak = max(out["torch"] for out in two_ranks)
    peaks = [out[run]["peak"] for out in two_ranks]
    assert 0 < max(peaks) <= 1.05 * torch_peak, (run, peaks, torch_peak)


def test_graph_engine_peak_within_its_split_backward_need(two_ranks):
    """The graph engine's B keeps the head's recorded gradients until W: its last stage holds more
    after B than after F, and one split backward in flight there is above torch 1F1B's peak on
    this head (ZB-H1 plans for it). Measured 1.07x; the bound leaves the 5% for what no plan
    models (a gradient alive inside B, an input gradient waiting for its send)."""
    torch_peak = max(out["torch"] for out in two_ranks)
    peaks = [out[("ZBH1", "graph")]["peak"] for out in two_ranks]
    assert 0 < max(peaks) <= 1.10 * torch_peak, (peaks, torch_peak)


@pytest.mark.parametrize("run", RUNS)
def test_grads_after_the_re_plan_equal_the_unpipelined_reference(two_ranks, run):
    for out in two_ranks:
        assert out[run]["grad_diff"] < 1e-5, (run, out[run]["grad_diff"])


def test_measure_memory_false_keeps_the_equal_bytes_plan(two_ranks):
    assert two_ranks[0]["opted_out"] == {"replanned": False, "same_plan": True}


# The gradients after the re-plan on 4 ranks (ZB-H1, ZB-V, V-Min, deferred engine, defaults):
# test_memory_promise_4ranks.py::test_grads_after_the_re_plan_equal_the_unpipelined_reference
# checks them in its 4-rank launch, with every other run there.


def test_memory_promise_false_runs_the_plan_for_equal_bytes_and_says_what_it_holds(two_ranks):
    """On the heavy head the promise re-makes ZB-H1's plan; ``memory_promise=False`` keeps the
    plan for equal bytes (gradients still the unpipelined model's), which holds more than
    torch 1F1B's peak there, and rank 0 logs that plan's predicted peak. The default's line
    names the option."""
    torch_peak = max(out["torch"] for out in two_ranks)
    kept = [out["unpromised"][True] for out in two_ranks]
    unkept = [out["unpromised"][False] for out in two_ranks]
    assert not any(row["equal_bytes_plan"] for row in kept)  # the promise changed the plan
    assert all(row["equal_bytes_plan"] and row["replanned"] for row in unkept)  # bytes measured
    assert all(row["grad_diff"] < 1e-5 for row in kept + unkept)
    assert max(row["peak"] for row in kept) <= 1.05 * torch_peak
    assert max(row["peak"] for row in unkept) > 1.05 * torch_peak  # the memory it costs
    (line,) = unkept[0]["lines"]
    assert "keeps ZBH1's plan for equal bytes per stage (memory_promise=False" in line
    assert "predicted peak per rank" in line
    (default,) = kept[0]["lines"]
    assert "memory_promise=False keeps the plan for equal bytes instead (predicted peak" in default
    assert unkept[1]["lines"] == kept[1]["lines"] == []  # rank 0 speaks
