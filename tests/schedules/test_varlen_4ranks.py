"""Microbatches of different lengths on 4 ranks (variable_shapes=True): ZB-H1 and ZB-1p (4
stages), ZB-V and V-Half (8 stages, V placement) in ONE launch of 4 gloo ranks, lengths drawn by
hypothesis (derandomized), gradients equal to the unpipelined model's. 4 ranks on 2 cores is
for correctness only; the model is tiny (16 wide, one block per stage)."""

import pytest

from tests.schedules.test_varlen import _draws
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist


def test_varlen_gradients_on_4_ranks():
    from tests.schedules._varlen_4ranks_cases import varlen_4ranks

    draws = [d * 2 for d in _draws(2)[1:]]  # two hypothesis draws, each repeated: 8 lengths
    schedules = ["ScheduleZBH1", "ScheduleZB1P", "ScheduleZBV", "ScheduleZBVHalf"]
    worst = run_ranks(varlen_4ranks, 4, schedules, draws, timeout=240)
    assert len(worst) == 4
