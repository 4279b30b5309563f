"""V-Half and V-Min plan for a W that costs nothing (a stage without weight GEMMs to defer, as
``costs="profile"`` can measure): the block construction divided by the shortest pass and
raised ZeroDivisionError (found with issue 47's plain-order checks)."""

from __future__ import annotations

import pytest

from zbpipe.planning import Costs, plan, simulate
from zbpipe.planning.yardsticks import v_budget


@pytest.mark.parametrize("name, mode", [("ZBVHalf", "half"), ("ZBVMin", "min")])
def test_v_memory_modes_plan_for_a_free_w(name, mode):
    p, m = 2, 4
    costs = Costs(w=0.0, comm=2.0)
    pl = plan(name, p, m, costs=costs)
    r = simulate(pl, costs)  # validates the order: every action, dependencies, no deadlock
    # within the mode's budget (yardsticks' formula), and never longer than running the
    # 2p chunks one microbatch at a time: m * (each chunk's F + B) + the comm of its hops
    assert max(r.peak_memory.values()) <= v_budget(p, m, costs.per_stage(2 * p), mode) + 1e-9
    assert r.makespan <= m * (2 * p * 2.0 + 2 * (2 * p - 1) * 2.0)
