"""Without ``variable_shapes=True`` (the default), zbpipe's schedules send no shapes: a step whose
microbatches differ in shape from the first step's gets a ValueError on the rank of stage 0
before any message of the step (zbpipe.schedules.fixed_shapes), not gloo's "Received data size
doesn't match" on the receiving rank. Left uncaught, the other rank is ended by the launcher."""

import pytest

from zbpipe.schedules.classes import ScheduleZB1P, ScheduleZBH1, ScheduleZBV
from zbpipe.testing import run_ranks
from zbpipe.testing.launch import RankFailure


@pytest.mark.parametrize("cls", [ScheduleZBH1, ScheduleZBV, ScheduleZB1P])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_variable_shapes_must_be_a_bool(cls, value):
    with pytest.raises(ValueError, match="variable_shapes must be True or False"):
        cls([], 4, variable_shapes=value)  # refused before the stages are even looked at


@pytest.mark.dist
def test_a_microbatch_of_another_shape_raises_on_stage0s_rank_before_any_message():
    from tests.schedules._fixed_shapes_cases import fixed_shape_steps

    with pytest.raises(RankFailure) as failure:
        run_ranks(fixed_shape_steps, 2, ["ScheduleZBH1", "ScheduleZBV"], timeout=120)
    text = str(failure.value)
    rank0 = text.split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    # rank 0 got through every checked step (no AssertionError) and ended on the uncaught error
    assert "ValueError: ScheduleZBV.step(): microbatch 2's argument 0 has shape (1, 5)" in rank0
    assert "AssertionError" not in text and "Received data size" not in rank0
    assert "did not finish" not in text  # the launcher ended rank 1: no hang
