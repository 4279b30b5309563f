"""The shape exchange's steady state (zbpipe.schedules.varlen): a step whose microbatches' input
shapes were all seen in an earlier step runs no all-reduce on any rank; a step with a new shape
runs one. Behaviour only (collectives counted), no timing; gradients checked on every step."""

import pytest

from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

# new, permutation of seen, one new length, only seen lengths
DRAWS = [[7, 29, 13, 50], [29, 7, 50, 13], [7, 29, 13, 51], [51, 51, 7, 7]]
# 1 where the step must all-reduce (its stage-0 shapes not all seen before), 0 where it must not
EXPECTED = [1, 0, 1, 0]


def test_steady_state_skips_the_all_reduce_on_every_rank():
    from tests.schedules._varlen_steady_cases import all_reduces_per_step

    schedules = ["ScheduleZBH1", "ScheduleZBV"]
    per_rank = run_ranks(all_reduces_per_step, 2, schedules, DRAWS, timeout=180)
    for rank, counts in enumerate(per_rank):
        for name in schedules:
            assert counts[name] == EXPECTED, (rank, name, counts[name])
