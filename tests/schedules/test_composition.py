"""zbpipe schedules composed with FSDP2 and tensor parallelism on a 2-D DeviceMesh.

Four gloo processes on CPU, one thread each, mesh ``(pp=2, dp=2)`` or ``(pp=2, tp=2)``. After one
``step()`` the full (``full_tensor()``) gradients equal an unpipelined, unsharded reference built
from the same seed in the same process (tests/schedules/_composition_cases.py). For FSDP2 the test
also checks *when* gradients are reduced: a stage's reduce-scatters come from its single REDUCE_GRAD
action, after its last W, once per FSDP parameter group: never early from FSDP's own hooks
inside a B or W, never twice. One process group for both meshes: spawning 4 processes is the
slow part.
"""

from __future__ import annotations

import pytest

from tests.schedules import _composition_cases as cases
from zbpipe.testing import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]  # the launch: the first test's setup

WORLD = 4


def reduce_violations(log: list[tuple], groups: dict[int, int], m: int) -> list[str]:
    """Everything wrong with one rank's event log (empty when the reduction timing is right).

    ``log`` holds ("W", stage, mb), ("REDUCE_GRAD", stage) and ("RS", stage-whose-REDUCE_GRAD-
    was-running or None, numel) in execution order; ``groups[s]`` is the number of FSDP parameter
    groups of stage s (one reduce-scatter each per step).
    """
    bad = []
    for s, n_groups in groups.items():
        w_at = [i for i, e in enumerate(log) if e[0] == "W" and e[1] == s]
        reduce_at = [i for i, e in enumerate(log) if e[0] == "REDUCE_GRAD" and e[1] == s]
        rs = [e for e in log if e[0] == "RS" and e[1] == s]
        if len(w_at) != m:
            bad.append(f"stage {s}: {len(w_at)} W passes, expected {m}")
        if len(reduce_at) != 1:
            bad.append(f"stage {s}: {len(reduce_at)} REDUCE_GRAD actions, expected 1")
        elif w_at and reduce_at[0] < w_at[-1]:
            bad.append(
                f"stage {s}: REDUCE_GRAD at event {reduce_at[0]} before its last W at {w_at[-1]}"
            )
        if len(rs) != n_groups:
            bad.append(
                f"stage {s}: {len(rs)} reduce-scatters in REDUCE_GRAD, "
                f"expected {n_groups} (one per group)"
            )
    early = [i for i, e in enumerate(log) if e[0] == "RS" and e[1] is None]
    if early:
        bad.append(f"reduce-scatter outside REDUCE_GRAD (FSDP reduced early) at events {early}")
    return bad


def test_reduce_violations_detects_early_and_double_reduction():
    """The timing check above can fail: hand-made logs of the two bugs it is meant to catch."""
    good = [("W", 0, 0), ("W", 0, 1), ("REDUCE_GRAD", 0), ("RS", 0, 8), ("RS", 0, 8)]
    assert reduce_violations(good, {0: 2}, m=2) == []
    early = [
        ("W", 0, 0),
        ("RS", None, 8),
        ("W", 0, 1),
        ("REDUCE_GRAD", 0),
        ("RS", 0, 8),
        ("RS", 0, 8),
    ]
    assert any("outside REDUCE_GRAD" in v for v in reduce_violations(early, {0: 2}, m=2))
    twice = good + [("RS", 0, 8)]
    assert any("3 reduce-scatters" in v for v in reduce_violations(twice, {0: 2}, m=2))
    before_w = [("W", 0, 0), ("REDUCE_GRAD", 0), ("RS", 0, 8), ("RS", 0, 8), ("W", 0, 1)]
    assert any("before its last W" in v for v in reduce_violations(before_w, {0: 2}, m=2))


# Both backward engines, in one process group per test (spawning 4 processes is the slow part):
# every case runs once per split.
SPLITS = ("deferred", "graph")


def _per_split(case_list: list[tuple]) -> list[tuple]:
    return [(s, m, {**o, "split": split}, x) for split in SPLITS for s, m, o, x in case_list]


#: (schedule, n_microbatches, options, reshard_after_forward of the blocks)
FSDP_CASES = _per_split(
    [
        ("ScheduleZBH1", 4, {}, False),  # torchtitan's default under PP: blocks unsharded
        ("ScheduleZBV", 4, {}, False),
        ("ScheduleZBH1", 4, {}, True),  # ZeRO-3 style: blocks resharded after every forward
        ("ScheduleZBV", 5, {"memory": "half"}, True),
    ]
)
#: (schedule, n_microbatches, options, DTensor activations between stages)
TP_CASES = _per_split(
    [
        ("ScheduleZBH1", 4, {}, False),
        ("ScheduleZBV", 4, {}, False),
        ("ScheduleZBH1", 4, {}, True),
        ("ScheduleZBV", 4, {}, True),
    ]
)


@pytest.fixture(scope="module")
def results():
    """Both meshes' cases in one launch of 4 ranks (each test had its own)."""
    return run_ranks(cases.fsdp_and_tp_cases, WORLD, FSDP_CASES, TP_CASES, timeout=600)


def test_pp_x_fsdp2_grads_and_reduce_scatter_after_last_w(results):
    for rank, (per_case, _) in enumerate(results):
        for (schedule, m, options, raf), r in zip(FSDP_CASES, per_case, strict=True):
            where = f"rank {rank} {schedule}{options} m={m} reshard_after_forward={raf}"
            assert r["mismatches"] == [], (
                f"{where}: gradients differ from the reference: {r['mismatches']}"
            )
            assert reduce_violations(r["log"], r["groups"], m) == [], f"{where}: {r['log']}"
            assert r["split"] == options["split"], where


def test_pp_x_tp_grads_equal_reference(results):
    for rank, (_, per_case) in enumerate(results):
        for (schedule, m, options, dtensor_boundary), r in zip(TP_CASES, per_case, strict=True):
            where = f"rank {rank} {schedule}{options} m={m} dtensor_boundary={dtensor_boundary}"
            assert r["split"] == options["split"], where
            # fc and out of every block are sharded over tp: 4 DTensor params per block.
            assert r["dtensor_params"] == 4 * 2 * len(r["mine"]), where
            received = r["dtensor_inputs"]
            if any(s != 0 for s in r["mine"]):
                assert received and all(x == dtensor_boundary for x in received), (
                    f"{where}: {received}"
                )
