"""Gradients after step() equal an unpipelined reference computed in the same process.

Real processes, gloo, one thread each. The model has an embedding, LayerNorms, a Linear used
twice per block, a custom autograd.Function and a buffer (zbpipe.testing.models, tricky=True).
Every gradient case of one world size runs in one process group (the ``launched`` fixture: 2
launches for the file, where each test had its own): starting processes is the slow part.
The default engine for this model is the deferred one (split="auto"); cases with
split="graph" keep the graph engine covered on every schedule family.
"""

import pytest

from tests.schedules import _dist_cases as cases
from zbpipe.testing import run_ranks

#: the module's launches run in the setup of the first test that reads them
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


GRAPH = {"split": "graph"}


def _cases(schedule, microbatches, options=None):
    return [(schedule, m, options or {}) for m in microbatches]


def _zbh1(world):
    ms = (world, 2 * world, 2 * world + 1)  # m = p, 2p, and one more: not a multiple of p
    return (
        _cases("ScheduleZBH1", ms)
        + _cases("ScheduleZBH1", ms, {"exact": True})
        + _cases("ScheduleZBH1", (2 * world + 1,), GRAPH)
        + _cases("ScheduleZBH1", (2 * world,), {"exact": True, **GRAPH})
    )


def _zbh2_and_auto(world):
    ms = (world, 2 * world + 1)
    return (
        _cases("ScheduleZBH2", ms)
        + _cases("ScheduleZBAuto", ms, {"memory_limit": "1p"})
        + _cases("ScheduleZBAuto", ms, {"memory_limit": "2p"})
        + _cases("ScheduleZBAuto", (2 * world + 1,), {"memory_limit": "1p", **GRAPH})
    )


def _zbv_all_modes():
    ms = (1, 3, 4, 8)
    return (
        [c for mode in ("zb", "half", "min") for c in _cases("ScheduleZBV", ms, {"memory": mode})]
        + _cases("ScheduleZBV", (3, 8), {"memory": "zb", **GRAPH})
        + _cases("ScheduleZBV", (4,), {"memory": "min", **GRAPH})
        # post-accumulate hooks of Linear weights fire once per W (deferred engine)
        + _cases("ScheduleZBV", (4,), {"memory": "zb", "split": "deferred", "hooks": True})
    )


def _checkpointed():
    return [
        (schedule, 4, {"checkpoint": "non-reentrant", "split": split})
        for schedule in ("ScheduleZBH1", "ScheduleZBV")
        for split in ("deferred", "graph")
    ]


#: every gradient case of this file, by world size and test: one launch per world size
GROUPS = {
    2: {
        "zbh1": _zbh1(2),
        "zbh2_auto": _zbh2_and_auto(2),
        "zbv_modes": _zbv_all_modes(),
        "1f1b_multi": _cases("Schedule1F1BMulti", (2, 5)),
        "checkpointed": _checkpointed(),
    },
    4: {
        "zbh1": _zbh1(4),
        "zbh2_auto": _zbh2_and_auto(4),
        "zbv": _cases("ScheduleZBV", (4, 8, 9)) + _cases("ScheduleZBV", (9,), GRAPH),
        # At p = 4 the budgets differ (ZB-V 4, V-Half 3, V-Min 8/3 units): other plans.
        "v_half_min": [
            c for mode in ("half", "min") for c in _cases("ScheduleZBV", (8,), {"memory": mode})
        ],
    },
}


@pytest.fixture(scope="module")
def launched():
    """Per world size, one launch of every case of that size, made when a test of that size
    first asks (a run that selects only 2-rank tests, as CI's compat lines do, starts no 4-rank
    launch); ``launched(world)`` is ``{group: worsts}`` (each case raises in its rank if a
    gradient differs from the reference)."""
    out: dict[int, dict] = {}

    def of(world: int) -> dict:
        if world not in out:
            groups = GROUPS[world]
            flat = [c for cs in groups.values() for c in cs]
            per_rank = run_ranks(cases.grads_cases, world, flat, timeout=600)
            assert len(per_rank) == world and all(len(w) == len(flat) for w in per_rank)
            at, out[world] = 0, {}
            for name, cs in groups.items():
                out[world][name] = [w[at : at + len(cs)] for w in per_rank]
                at += len(cs)
        return out[world]

    return of


def _ran(launched, world, group):
    per_rank = launched(world)[group]
    assert len(per_rank) == world and all(len(w) == len(GROUPS[world][group]) for w in per_rank)


@pytest.mark.parametrize("world", [2, 4])
def test_zbh1_grads_equal_unpipelined_reference(launched, world):
    _ran(launched, world, "zbh1")


@pytest.mark.parametrize("world", [2, 4])
def test_zbh2_and_auto_grads_equal_unpipelined_reference(launched, world):
    _ran(launched, world, "zbh2_auto")


def test_zbv_all_memory_modes_grads_equal_reference_on_2_ranks(launched):
    _ran(launched, 2, "zbv_modes")


def test_zbv_grads_equal_reference_on_4_ranks(launched):
    _ran(launched, 4, "zbv")


def test_v_half_and_v_min_grads_equal_reference_on_4_ranks(launched):
    _ran(launched, 4, "v_half_min")


def _v_promise(mode: str, p: int, mem_f: list) -> float:
    """The memory a V schedule promises per rank, in the units of ``mem_f`` (chunk ``i``'s bytes
    after F): ZB-V 1F1B's peak on the same model in p stages (stage i = chunks 2i and 2i + 1
    holds p - i microbatches), V-Half (p + 2) / 2 and V-Min (p + 4) / 3 microbatches of stage 0."""
    stage = [mem_f[2 * i] + mem_f[2 * i + 1] for i in range(p)]
    if mode == "zb":
        return max((p - i) * stage[i] for i in range(p))
    return ((p + 2) / 2 if mode == "half" else (p + 4) / 3) * stage[0]


def test_v_peak_memory_within_the_stated_promise_on_4_ranks_under_both_engines():
    """After ``costs="profile"`` measured the bytes, every rank's peak held for backward (all the
    meter counts: saved tensors, outputs, input gradients, queued or recorded gradients, sends
    until let go of) stays within 5% of the mode's stated promise, computed from chunk bytes
    counted on a standalone forward, plus one boundary tensor per stage of the rank.

    What no plan models: a gradient a B makes before the activation it replaces is freed, and
    input gradients held until their send is known received (zbpipe.schedules.sends: at points the
    order fixes), and the order itself is re-planned from profiled times, so it can differ from run
    to run. Seen: two boundary tensors over the promise on a rank, and once, on a loaded CI run,
    three (6,144 bytes, where 5% of V-Half's promise is 5,530; which held tensor was the third
    is not established)."""
    modes, splits, p = ("zb", "half", "min"), ("deferred", "graph"), 4
    per_rank = run_ranks(cases.v_saved_peak_within_budget, p, 8, modes, splits, timeout=400)
    chunk_bytes, own_bytes = per_rank[0][1], per_rank[0][2]
    boundary = chunk_bytes[0] - chunk_bytes[-1]  # a chunk's output (the last chunk sends none)
    unmodelled = 2 * boundary  # one per stage: a V rank holds two
    for split in splits:
        for mode in modes:
            # the profile measured what a standalone forward holds but its input (to its 3
            # digits' rounding)
            measured = per_rank[0][0][(split, mode)][1]
            assert measured == pytest.approx(own_bytes, rel=0.01), (split, mode)
            promise = _v_promise(mode, p, chunk_bytes)
            peaks = [out[(split, mode)][0] for out, _, _ in per_rank]
            assert 0 < max(peaks) <= 1.05 * promise + unmodelled, (split, mode, peaks, promise)
        # Rank 0 holds the V's first and last chunks: there the modes' budgets bite. V-Min's
        # promise is a third of a chunk below V-Half's, less than the unmodelled tensors above:
        # seen on a loaded CI run, rank 0's V-Min one boundary tensor over its V-Half.
        rank0 = {mode: per_rank[0][0][(split, mode)][0] for mode in modes}
        assert rank0["min"] <= rank0["half"] + unmodelled, (split, rank0)
        assert rank0["half"] < rank0["zb"], (split, rank0)


def test_1f1b_multi_grads_equal_unpipelined_reference(launched):
    _ran(launched, 2, "1f1b_multi")


def test_activation_checkpointed_stages_grads_equal_reference_under_both_engines(launched):
    """torch.utils.checkpoint around every block: the recompute runs inside B (the deferred
    engine's Linears queue their GEMMs from it); the reference runs without checkpointing.

    Non-reentrant only: torch's PipelineStage infers gradient shapes with autograd.grad, which
    reentrant checkpointing refuses (tests/engines/test_deferred.py covers reentrant on one
    stage)."""
    _ran(launched, 2, "checkpointed")


def test_zbh1_exact_is_bitwise_identical_to_1f1b():
    counts = run_ranks(cases.bitwise_equal_to_1f1b, 2, 5, timeout=120)
    assert all(c > 0 for c in counts)


def test_stage_with_two_tensor_outputs_grads_equal_reference():
    assert run_ranks(cases.several_outputs, 2, 3, timeout=120) == [0, 1]
