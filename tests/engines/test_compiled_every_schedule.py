"""Every schedule class over compiled blocks, and over checkpointed-then-compiled blocks.

Two gloo ranks; each pre-norm MLP block compiled on its own with ``fullgraph=True``
(tests/engines/_compile_every_cases.py), in place as torchtitan compiles, or wrapped in
non-reentrant ``torch.utils.checkpoint`` first and then compiled (torchtitan's order for
compile + AC). Every class of ``zbpipe.integrations.names.SCHEDULE_CLASSES`` in its placement
(loop: one stage per rank; V: two) runs two steps with its defaults (the first step compiles,
probes memory and re-plans): its gradients after each step equal a compiled unpipelined
reference (the same blocks, a separate copy compiled the same way) and an eager one, to fp32
rounding; the second step compiles nothing; nothing breaks the graph (most cases compile with
aot_eager; inductor runs ZBH1 and ZBV). ``ScheduleContinuous`` (sync, 2bw, stash) ends with the
parameters its version rule gives on the unpipelined model, its W running deferred GEMMs.

One process group for the whole file (a module fixture; dynamo reset before each placement's
cases and before the inductor cases): starting ranks, importing torch and warming dynamo up is
the slow part.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engines import _compile_every_cases as cases
from zbpipe.integrations.names import SCHEDULE_CLASSES
from zbpipe.testing import run_ranks

# one launch of every case (the module fixture) takes minutes on a loaded 2-core machine
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

PLANNED = [name for name in SCHEDULE_CLASSES if name != "Continuous"]
MODES = ["sync", "2bw", "stash"]


def _all_cases(how: str) -> list[tuple]:
    return [("planned", name, how, "aot_eager", {}) for name in PLANNED] + [
        ("continuous", mode, how, "aot_eager") for mode in MODES
    ]


HOWS = {"compile": "in-place", "compile+ac": "ac-in-place"}
# inductor: ZBH1 (loop) and ZBV (V) compiled in place (ZBV reuses ZBH1's graphs; AC is checked
# under aot_eager: an inductor compile of it costs this file's budget); the graph engine runs
# 1F1BMulti's fused backward over compiled blocks (a plan that splits refuses them under
# split="graph": the last test); ZBV eager, for its W's GEMMs.
INDUCTOR = [
    ("planned", "ZBH1", "in-place", "inductor", {}),
    ("planned", "ZBV", "in-place", "inductor", {}),
    ("planned", "1F1BMulti", "in-place", "aot_eager", {"split": "graph"}),
    ("planned", "ZBV", "eager", "", {}),
]


@pytest.fixture(scope="module")
def launch() -> dict[str, list[list[dict]]]:
    """Every case of the file in one launch of two ranks, in three groups, each from an empty
    compile cache (its first case compiles the blocks' graphs, the others reuse them):
    {"compile" / "compile+ac" / "inductor": per case, per rank, its result}."""
    groups = {key: _all_cases(how) for key, how in HOWS.items()}
    groups["inductor"] = INDUCTOR
    per_rank = run_ranks(cases.run_groups, 2, list(groups.values()), timeout=900)
    return {
        key: [[rank[g][j] for rank in per_rank] for j in range(len(group))]
        for g, (key, group) in enumerate(groups.items())
    }


@pytest.fixture(scope="module", params=list(HOWS), ids=list(HOWS))
def runs(request, launch):
    how = HOWS[request.param]
    todo = _all_cases(how)
    return how, {case[1]: results for case, results in zip(todo, launch[request.param])}


def test_the_cases_share_the_compiled_graphs(runs):
    # The cases of a launch share one compile cache: the first compiles the blocks' graphs, the
    # others reuse them. A block past dynamo's recompile limit would not run eager silently:
    # under fullgraph=True that is a hard error.
    _, results = runs
    for per_rank in results.values():
        assert all(got["graphs"][-1] > 0 for got in per_rank)


def _check_planned(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        # (the per-step assert_close in the rank already held; the worst differences say so too)
        assert got["worst_compiled"] < 1e-5 and got["worst_eager"] < 1e-5, (rank, got)
        first, second = got["graphs"]
        assert first == second, f"rank {rank}: the second step compiled again: {got['graphs']}"
        assert got["graph_breaks"] == 0, got


@pytest.mark.parametrize("name", PLANNED)
def test_every_planned_class_gets_the_compiled_reference_gradients(runs, name):
    how, results = runs
    _check_planned(results[name])
    # every rank agreed on one plan, re-made for the bytes the compiled stages hold
    assert len({r["plan"] for r in results[name]}) == 1
    # (with AC a block holds little after F and its W operands after B: AutoV's 1p budget
    # then fits no V plan, which keeps the first plan with a warning, compiled or not)
    if SCHEDULE_CLASSES[name].memory_planned and how == "in-place":
        assert all(r["unit_bytes"] is not None for r in results[name]), results[name]
    if name != "1F1BMulti":  # the split survives compilation: some W ran deferred GEMMs
        assert sum(r["w_gemms"] for r in results[name]) > 0, (how, name)


@pytest.mark.parametrize("mode", MODES)
def test_continuous_over_compiled_blocks_follows_its_version_rule(runs, mode):
    how, results = runs
    for rank, got in enumerate(results[mode]):
        assert set(got["references"]) == {how, "eager"}
        for ref_how, want in got["references"].items():
            for i, (a, b) in enumerate(zip(got["params"], want, strict=True)):
                # SGD with momentum over 3 mini-batches: fp32 rounding of the gradients only
                np.testing.assert_allclose(
                    a, b, rtol=1e-5, atol=1e-6, err_msg=f"{mode} {ref_how} {rank} {i}"
                )
    for got in results[mode]:
        assert got["graphs"][0] == got["graphs"][-1], got["graphs"]
        assert got["graph_breaks"] == 0
    # the split survives compilation in every mode: every W runs every Linear's GEMM, on the
    # weight versions' leaves too (2bw, stash), whose W adds into the leaves' .grad
    for got in results[mode]:
        assert got["w_gemms"] == [got["linears"]] * (cases.M * cases.N_CONTINUOUS), (how, mode)


# inductor compiles C++ kernels: about 10 s with its on-disk caches warm (the default), 125 s
# with them cold (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, 2-core machine at load 4)
def test_inductor_in_both_placements_and_graph_engine_under_compile(launch):
    results = launch["inductor"]  # per case, per rank
    for per_rank in results[:-1]:
        _check_planned(per_rank)
    assert all(got["split"] == "graph" for got in results[2])
    assert sum(got["w_gemms"] for got in results[0]) > 0  # ZBH1 splits somewhere
    # ZBV splits on both ranks; compiled by inductor, its W runs the GEMMs the eager one runs
    assert all(got["w_gemms"] > 0 for got in results[1])
    assert [got["w_gemms"] for got in results[1]] == [got["w_gemms"] for got in results[3]]


def test_graph_engine_refuses_compiled_blocks_in_a_split_plan():
    from types import SimpleNamespace

    from tests.engines._compile_cases import compile_blocks, mlp_stages
    from zbpipe.engines.graph import check_not_compiled

    stage = SimpleNamespace(submod=compile_blocks(mlp_stages(1)[0], "in-place", "aot_eager"))
    stage.stage_index = 0
    with pytest.raises(ValueError, match=r"stage 0 submodule '0' is torch.compile'd.*deferred"):
        check_not_compiled(SCHEDULE_CLASSES["ZBH1"], [stage])
