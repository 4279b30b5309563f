"""The default memory re-plan on compiled stages: the first step, which compiles them, measures
the bytes each stage holds as it does on eager stages, and the re-plan gives the plan the same
pipeline gets eager.

Two gloo ranks; each pre-norm MLP block compiled in place with ``fullgraph=True`` (aot_eager,
which keeps the eager block's saved tensors, so the bytes must be the eager ones exactly).
The probe's saved-tensor hooks must cost no recompile and no graph break: once a pipeline built
with ``measure_memory=False`` has compiled the blocks, the probed pipelines compile nothing more.
"""

from __future__ import annotations

import pytest

from tests.observe import _replan_compiled_cases as cases
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

NAMES = ["ZBV", "ZBH1"]


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str, bool], list[dict]]:
    # One compile cache for the launch. ZBV first built with measure_memory=False compiles the
    # blocks' graphs; every probed pipeline after it must compile nothing more.
    todo = [("ZBV", "in-place", False)] + [
        (name, how, True) for name in NAMES for how in ("eager", "in-place")
    ]
    todo += [("ZBV", "whole", True)]
    per_rank = run_ranks(cases.runs, 2, todo, timeout=300)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(todo)}


@pytest.mark.parametrize(
    ("name", "how"), [("ZBV", "in-place"), ("ZBH1", "in-place"), ("ZBV", "whole")]
)
def test_compiled_stages_get_the_plan_their_eager_pipeline_gets(results, name, how):
    # "in-place": each block compiled (torchtitan's way); "whole": each stage module compiled
    eager, compiled = results[name, "eager", True], results[name, how, True]
    for e, c in zip(eager, compiled):
        assert c["unit_bytes"] is not None, c  # measured on compiled stages
        assert (c["memory"], c["unit_bytes"]) == (e["memory"], e["unit_bytes"])
        assert c["plan"] == e["plan"]
    if name == "ZBV":  # the bytes mattered: ZBV's re-plan left the equal-bytes plan (ZBH1's
        # order is the same for these bytes)
        assert any(e["replanned_order_differs"] for e in eager)


def test_probing_costs_no_recompile_and_no_graph_break(results):
    unprobed = results["ZBV", "in-place", False]
    for got in unprobed:  # its first step compiled the blocks' graphs, later steps nothing
        first, *later = got["graphs"]
        assert first > 0 and all(n == first for n in later), got["graphs"]
    for name in NAMES:  # the same graphs served the probed steps: not one more was compiled
        for got in results[name, "in-place", True]:
            assert got["graphs"] == [0, 0, 0], (name, got["graphs"])
            assert got["graph_breaks"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_grads_after_the_re_plan_on_compiled_stages_equal_the_reference(results, name):
    for got in results[name, "in-place", True] + results.get((name, "whole", True), []):
        assert got["worst"] < 1e-5, got["worst"]  # fp32 rounding
