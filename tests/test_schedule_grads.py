"""Gradients after step() equal an unpipelined reference computed in the same process.

Real processes, gloo, one thread each. The model has an embedding, LayerNorms, a Linear used
twice per block, a custom autograd.Function and a buffer (zbpipe.testing.models, tricky=True).
Each test runs several cases in one process group: starting processes is the slow part.
"""

import pytest

from zbpipe.testing import run_ranks

import _dist_cases as cases

pytestmark = pytest.mark.dist


def _cases(schedule, microbatches, options=None):
    return [(schedule, m, options or {}) for m in microbatches]


def _run(world, case_list, timeout=240):
    worst = run_ranks(cases.grads_cases, world, case_list, timeout=timeout)
    assert len(worst) == world and all(len(w) == len(case_list) for w in worst)


@pytest.mark.parametrize("world", [2, 4])
def test_zbh1_grads_equal_unpipelined_reference(world):
    ms = (world, 2 * world, 3 * world + 1)
    _run(world, _cases("ScheduleZBH1", ms) + _cases("ScheduleZBH1", ms, {"exact": True}))


@pytest.mark.parametrize("world", [2, 4])
def test_zbh2_and_auto_grads_equal_unpipelined_reference(world):
    ms = (world, 2 * world + 1)
    _run(
        world,
        _cases("ScheduleZBH2", ms)
        + _cases("ScheduleZBAuto", ms, {"memory_limit": "1p"})
        + _cases("ScheduleZBAuto", ms, {"memory_limit": "2p"}),
    )


def test_zbv_all_memory_modes_grads_equal_reference_on_2_ranks():
    ms = (1, 3, 4, 8)
    _run(
        2,
        [c for mode in ("zb", "half", "min") for c in _cases("ScheduleZBV", ms, {"memory": mode})],
    )


def test_zbv_grads_equal_reference_on_4_ranks():
    _run(4, _cases("ScheduleZBV", (4, 8, 9)))


def test_1f1b_multi_grads_equal_unpipelined_reference():
    _run(2, _cases("Schedule1F1BMulti", (2, 5)))


def test_zbh1_exact_is_bitwise_identical_to_1f1b():
    counts = run_ranks(cases.bitwise_equal_to_1f1b, 2, 5, timeout=120)
    assert all(c > 0 for c in counts)


def test_stage_with_two_tensor_outputs_grads_equal_reference():
    assert run_ranks(cases.several_outputs, 2, 3, timeout=120) == [0, 1]
