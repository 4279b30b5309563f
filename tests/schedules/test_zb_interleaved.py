"""ScheduleZBInterleaved on 2 gloo ranks (issue 47): gradients equal the unpipelined model's
with 2 and 3 loop stages per rank, deferred W passes included; a microbatch count it cannot
take is a ValueError on every rank before any message."""

from __future__ import annotations

import pytest

from zbpipe.testing import run_ranks


@pytest.mark.dist
def test_zb_interleaved_grads_equal_the_unpipelined_model():
    from tests.schedules import _zb_interleaved_cases as cases

    got = run_ranks(cases.cases, 2, timeout=180)
    for rank, out in enumerate(got):
        assert out["two"]["stages"] == [rank, rank + 2]
        assert out["three"]["stages"] == [rank, rank + 2, rank + 4]
        for key in ("two", "three", "one_round"):
            assert out[key]["plan"] == "ZBInterleaved", (key, out[key]["plan"])
        assert "ScheduleZBInterleaved" in out["refused"] and "use 4 or 6" in out["refused"]
    # the costs given defer weight passes away from their B on some rank (the split ran)
    assert sum(out["three"]["deferred_w"] for out in got) > 0
