"""Zero-bubble schedules over ``torch.compile``d blocks: the split survives compilation.

Two gloo ranks, each block compiled on its own with ``fullgraph=True``
(tests/engines/_compile_cases.py). Gradients after ``step()`` must equal an eager unpipelined
reference to fp32 rounding; the compiled stages' W must run as many weight GEMMs as the eager ones
(every Linear's weight work is in W, as without compile); the first step compiles, later steps
do not, and nothing breaks the graph. All cases run in one launch of two ranks (a module
fixture). Inductor, every other schedule class and the compiled
unpipelined reference: tests/engines/test_compiled_every_schedule.py.
"""

from __future__ import annotations

import pytest

from tests.engines import _compile_cases as cases
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

# ZBH1 (loop placement) with blocks compiled in place, ZBV (V placement) with
# torch.compile(block) wrappers; each against the same schedule on eager blocks.
PLAIN = [
    ("ScheduleZBH1", "eager", ""),
    ("ScheduleZBH1", "in-place", "aot_eager"),
    ("ScheduleZBV", "eager", ""),
    ("ScheduleZBV", "wrapped", "aot_eager"),
]
# torchtitan 0.3's PP runs: blocks compiled, then under FSDP2 (a one-rank dp mesh). Around
# forward and backward FSDP2 puts its unsharded plain parameters on the Linears, not the
# sharded DTensors that were routed: compiled code hands the op those, whose gradients
# must still wait for W (and reach the sharded parameters after the last W).
FSDP = [
    ("ScheduleZBH1", "fsdp-eager", ""),
    ("ScheduleZBH1", "fsdp-in-place", "aot_eager"),
    ("ScheduleZBV", "fsdp-eager", ""),
    ("ScheduleZBV", "fsdp-in-place", "aot_eager"),
]
# ZBH2 and ZBAuto (loop placement) over blocks compiled in place; ZBV and ZBH1 over blocks
# checkpointed, then compiled (torchtitan's order: the recompute runs in the compiled B).
MORE = [
    case
    for schedule, how in (
        ("ScheduleZBH2", "in-place"),
        ("ScheduleZBAuto", "in-place"),
        ("ScheduleZBV", "ac-in-place"),
        ("ScheduleZBH1", "ac-in-place"),
    )
    for case in ((schedule, "eager", ""), (schedule, how, "aot_eager"))
]


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    """Every test's cases in one launch of two ranks (each case resets dynamo first, so each
    still compiles its own graphs): {group: per rank, the group's results}."""
    calls = [("compiled_cases", group) for group in (PLAIN, FSDP, MORE)]
    calls.append(("profiled_compiled_v", "stage"))
    per_rank = run_ranks(cases.several, 2, calls, timeout=600)
    names = ("plain", "fsdp", "more", "profiled")
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(names)}


def _check(result: dict, eager: dict) -> None:
    assert result["worst"] < 1e-5
    assert result["w_gemms"] == eager["w_gemms"]
    first, *later = result["graphs"]
    assert first > 0 and all(n == first for n in later), f"recompiled: {result['graphs']}"
    assert result["graph_breaks"] == 0


def _zbh1_and_zbv_split_like_eager(per_rank: list) -> None:
    """``per_rank``: per rank, ZBH1 eager, ZBH1 compiled, ZBV eager, ZBV compiled."""
    for h1_eager, h1_compiled, v_eager, v_compiled in per_rank:
        _check(h1_compiled, h1_eager)
        _check(v_compiled, v_eager)
    for k in (0, 2):  # W ran GEMMs somewhere, for each schedule
        assert sum(sum(rank[k]["w_gemms"]) for rank in per_rank) > 0


@pytest.mark.timeout(900)
def test_compiled_blocks_split_like_eager_ones(runs):
    _zbh1_and_zbv_split_like_eager(runs["plain"])


@pytest.mark.timeout(900)
def test_fsdp2_compiled_blocks_split_like_eager_ones(runs):
    _zbh1_and_zbv_split_like_eager(runs["fsdp"])


@pytest.mark.timeout(900)
def test_more_schedules_and_checkpointed_compiled_blocks_split_like_eager_ones(runs):
    for results in runs["more"]:
        for eager, compiled in zip(results[::2], results[1::2], strict=True):
            _check(compiled, eager)


@pytest.mark.timeout(900)
def test_profiling_measures_memory_on_compiled_stages(runs):
    # costs="profile" probes one warm-up step's saved tensors through saved-tensor hooks; a
    # compiled region saves through them too, so its bytes are measured and planned for. Each
    # stage module is compiled whole here (each block compiled on its own works alike).
    for got in runs["profiled"]:
        assert got["unit_bytes"] is not None and got["unit_bytes"] > 0, got
        first, *later = got["graphs"]
        assert all(n == first for n in later), f"recompiled: {got['graphs']}"
        assert got["worst"] < 1e-5
