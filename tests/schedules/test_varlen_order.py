"""Microbatches ordered by their costs at run time (zbpipe.schedules.cost_order): stage 0's rank
gets ``microbatch_costs``, the order reaches the other rank in the shape exchange's header, and
losses, outputs and gradients come back as the unpipelined model gives them in data order."""

import pytest

from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

# long first: the simulator moves a short one to the front; then a step in data order's favour
DRAWS = [[50, 7, 29, 13], [40, 40, 3, 40]]


def test_cost_order_keeps_losses_outputs_and_gradients_in_the_callers_order():
    from tests.schedules._varlen_order_cases import ordered_steps

    names = ["ScheduleZBH1", "ScheduleZBV"]
    per_rank = run_ranks(ordered_steps, 2, names, DRAWS, timeout=180)
    for name in names:
        slots = per_rank[0][name]
        assert per_rank[1][name] == slots  # both ranks' plans agree on the order
        assert tuple(slots[0]) != (0, 1, 2, 3), (name, slots)  # the check saw a reordered step
