"""Issue 37's promises on 4 gloo ranks, measured by a meter that shares nothing with zbpipe
(``tests/memory/_independent_meter.py``: every storage any op creates, sampled between actions).

Default arguments and ``costs="profile"``, both engines: ZB-H1 and ZB-1p hold at most 1F1B's
peak from the first step on (the first step runs a plan that keeps it whatever the bytes); ZB-V
too, V-Half and V-Min within their formulas (a V rank holds the first and the last chunk
together, so no order keeps the promise before the bytes are known: their first step sends
microbatch 0 down the V and back, measures, and runs the rest of the step with the plan made
for the measured bytes; zbpipe.schedules.measured_start, docs/use/memory-budgets.md).

Under full activation checkpointing (a dense model, one with experts as a 3-D weight) the
re-made plan's predicted peak is what the run holds, and V-Half holds less than ZB-V; the same
under selective checkpointing, whose cache the probe reads.

4 ranks because the promises differ from 2 ranks' there (V-Half's and V-Min's formulas, ZB-1p's
budget) and a V rank 1 or 2 holds neither end of the model. Every run in one launch; two steps
per run with defaults (the plan made before the bytes are known, then the re-made one), three
with ``costs="profile"`` (warm-up, one profiled step, the re-made plan).
"""

from __future__ import annotations

import pytest

from tests.schedules import _memory_promise_cases as cases
from zbpipe.testing import run_ranks

#: the shared launch's setup counts against the first test; its own deadline is run_ranks'
pytestmark = pytest.mark.timeout(900)

P, M = 4, 8
#: 5%: the meter sees what the plans' model leaves out (a send's buffer until it is let go of,
#: the loss's scalars); docs/results/memory-promise.md has every ratio these runs gave
TOL = 1.05
LOOP = [("ZBH1", "deferred", "default"), ("ZB1P", "deferred", "default"),
        ("ZBH1", "graph", "default"), ("ZBH1", "deferred", "profile"),
        ("ZB1P", "graph", "profile")]  # fmt: skip
V = [("ZBV", "deferred", "default"), ("ZBVHalf", "deferred", "default"),
     ("ZBVMin", "deferred", "default"), ("ZBV", "graph", "default"),
     ("ZBVHalf", "graph", "default"),  # (held 1.104 of its formula with ZB-V's re-plan rule)
     ("ZBV", "deferred", "profile")]  # fmt: skip


#: the checkpointed models: a head lighter than the checkpointed blocks' recomputed inputs
#: (vocab 64): V-Half's formula, not one microbatch of the head, is then what binds it
CHECKPOINTED = {
    "full": {"ac": "full", "moe": False, "vocab": 64},
    "experts-full": {"ac": "full", "moe": True, "vocab": 64},
    "selective": {"ac": "selective", "moe": False, "vocab": 64},
    "experts-selective": {"ac": "selective", "moe": True, "vocab": 64},
}


@pytest.fixture(scope="module")
def per_rank():
    """Every 4-rank run of this file in one launch (the promise rows, and the checkpointed
    rows, which ran one launch per model before)."""
    return run_ranks(
        cases.all_rows, P, M, LOOP + V, CHECKPOINTED, ["ZBH1", "ZBV", "ZBVHalf"], timeout=900
    )


@pytest.fixture(scope="module")
def rows(per_rank):
    """``{run: [[peak of rank r in step i for r] for i]}``."""
    promise = [r["promise"] for r in per_rank]
    return {
        k: [[promise[r][k][i] for r in range(P)] for i in range(len(promise[0][k]))]
        for k in promise[0]
        if k != "grads"
    }


@pytest.mark.dist
@pytest.mark.parametrize("run", LOOP + V, ids=lambda r: "-".join(r))
def test_grads_after_the_re_plan_equal_the_unpipelined_reference(per_rank, run):
    """The step after the re-plan (for the measured bytes, or the profile) gives the
    unpipelined model's gradients on 4 ranks. Replaces test_memory_by_default.py's
    test_grads_equal_reference_after_the_re_plan_on_4_ranks (ZB-H1, ZB-V, V-Min, deferred
    engine, defaults: rows here), which ran a 4-rank launch of its own."""
    for r in per_rank:
        assert r["promise"]["grads"][run] < 1e-5, (run, r["promise"]["grads"][run])


@pytest.mark.dist
@pytest.mark.parametrize("run", LOOP, ids=lambda r: "-".join(r))
def test_loop_schedules_keep_1f1b_peak_from_the_first_step(rows, run):
    torch_peak = max(max(step) for step in rows["torch"])
    for i, step in enumerate(rows[run], start=1):
        assert max(step) <= TOL * torch_peak, f"step {i}: {max(step) / torch_peak:.3f}x 1F1B's"


@pytest.mark.dist
@pytest.mark.parametrize("run", V, ids=lambda r: "-".join(r))
def test_v_schedules_keep_their_promise_from_the_first_step(rows, run):
    torch_peak = max(max(step) for step in rows["torch"])
    # torch's rank 0 holds p microbatches of the p-stage model's stage 0 (chunks 0 and 1)
    stage0 = rows["torch"][-1][0] / P
    promise = {"ZBV": torch_peak, "ZBVHalf": (P + 2) / 2 * stage0, "ZBVMin": (P + 4) / 3 * stage0}
    for i, step in enumerate(rows[run], start=1):
        ratio = max(step) / promise[run[0]]
        assert ratio <= TOL, f"step {i}: {ratio:.3f}x its promise"


#: measured against predicted, max over ranks, the step after the re-plan (issue 37 asks for a
#: tenth). ``benchmarks/memory_promise.py --checkpointed`` runs these bodies and stores every
#: ratio (docs/results/memory-promise.md)
AC_TOL = 0.10


@pytest.mark.dist
@pytest.mark.parametrize("model", list(CHECKPOINTED))
def test_checkpointed_plans_predict_what_they_hold_and_v_half_holds_less(per_rank, model):
    got = {
        name: (
            max(r[model][name]["measured"] for r in per_rank),
            per_rank[0][model][name]["predicted"],
        )
        for name in per_rank[0][model]
    }
    for name, (measured, predicted) in got.items():
        assert abs(measured / predicted - 1) <= AC_TOL, (name, measured, predicted)
    assert got["ZBVHalf"][1] < got["ZBV"][1]
    assert got["ZBVHalf"][0] < got["ZBV"][0]
