"""Zero-bubble schedules over ``torch.compile``d blocks: the split survives compilation.

Two gloo ranks, each block compiled on its own with ``fullgraph=True``
(tests/engines/_compile_cases.py). Gradients after ``step()`` must equal an eager unpipelined
reference to fp32 rounding; the compiled stages' W must run as many weight GEMMs as the eager ones
(every Linear's weight work is in W, as without compile); the first step compiles, later steps
do not, and nothing breaks the graph. Inductor, every other schedule class and the compiled
unpipelined reference: tests/engines/test_compiled_every_schedule.py.
"""

from __future__ import annotations

from tests.engines import _compile_cases as cases
from zbpipe.testing import run_ranks


def _check(result: dict, eager: dict) -> None:
    assert result["worst"] < 1e-5
    assert result["w_gemms"] == eager["w_gemms"]
    first, *later = result["graphs"]
    assert first > 0 and all(n == first for n in later), f"recompiled: {result['graphs']}"
    assert result["graph_breaks"] == 0


def _zbh1_and_zbv_split_like_eager(order: list[tuple[str, str, str]]) -> None:
    """``order``: ZBH1 eager, ZBH1 compiled, ZBV eager, ZBV compiled (2 ranks)."""
    per_rank = run_ranks(cases.compiled_cases, 2, order, timeout=300)
    for h1_eager, h1_compiled, v_eager, v_compiled in per_rank:
        _check(h1_compiled, h1_eager)
        _check(v_compiled, v_eager)
    for k in (0, 2):  # W ran GEMMs somewhere, for each schedule
        assert sum(sum(rank[k]["w_gemms"]) for rank in per_rank) > 0


def test_compiled_blocks_split_like_eager_ones():
    # ZBH1 (loop placement) with blocks compiled in place, ZBV (V placement) with
    # torch.compile(block) wrappers; each against the same schedule on eager blocks.
    order = [
        ("ScheduleZBH1", "eager", ""),
        ("ScheduleZBH1", "in-place", "aot_eager"),
        ("ScheduleZBV", "eager", ""),
        ("ScheduleZBV", "wrapped", "aot_eager"),
    ]
    _zbh1_and_zbv_split_like_eager(order)


def test_fsdp2_compiled_blocks_split_like_eager_ones():
    # torchtitan 0.3's PP runs: blocks compiled, then under FSDP2 (a one-rank dp mesh). Around
    # forward and backward FSDP2 puts its unsharded plain parameters on the Linears, not the
    # sharded DTensors that were routed: compiled code hands the op those, whose gradients
    # must still wait for W (and reach the sharded parameters after the last W).
    order = [
        ("ScheduleZBH1", "fsdp-eager", ""),
        ("ScheduleZBH1", "fsdp-in-place", "aot_eager"),
        ("ScheduleZBV", "fsdp-eager", ""),
        ("ScheduleZBV", "fsdp-in-place", "aot_eager"),
    ]
    _zbh1_and_zbv_split_like_eager(order)


def test_more_schedules_and_checkpointed_compiled_blocks_split_like_eager_ones():
    # ZBH2 and ZBAuto (loop placement) over blocks compiled in place; ZBV and ZBH1 over blocks
    # checkpointed, then compiled (torchtitan's order: the recompute runs in the compiled B).
    order = []
    for schedule, how in (
        ("ScheduleZBH2", "in-place"),
        ("ScheduleZBAuto", "in-place"),
        ("ScheduleZBV", "ac-in-place"),
        ("ScheduleZBH1", "ac-in-place"),
    ):
        order += [(schedule, "eager", ""), (schedule, how, "aot_eager")]
    for results in run_ranks(cases.compiled_cases, 2, order, timeout=300):
        for eager, compiled in zip(results[::2], results[1::2]):
            _check(compiled, eager)


def test_profiling_measures_memory_on_compiled_stages():
    # costs="profile" probes one warm-up step's saved tensors through saved-tensor hooks; a
    # compiled region saves through them too, so its bytes are measured and planned for. Each
    # stage module is compiled whole here (each block compiled on its own works alike).
    per_rank = run_ranks(cases.profiled_compiled_v, 2, "stage", timeout=300)
    for got in per_rank:
        assert got["unit_bytes"] is not None and got["unit_bytes"] > 0, got
        first, *later = got["graphs"]
        assert all(n == first for n in later), f"recompiled: {got['graphs']}"
        assert got["worst"] < 1e-5
