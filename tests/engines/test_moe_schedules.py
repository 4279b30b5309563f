"""torchtitan MoE blocks under a zero-bubble schedule with default arguments: the experts'
weight gradients go to W, the gradients equal an unpipelined model's, and the load-balancing
counts (tokens per expert, counted in each forward) equal the unpipelined model's, which are
1F1B's: one forward per microbatch, W runs none. One rank holding ZB-V's two stages.
(torchtitan's Trainer against its own 1F1B: tests/integrations.)"""

from __future__ import annotations

import pytest

from tests.engines import _moe_cases as cases
from zbpipe.testing import run_ranks

pytest.importorskip("torchtitan.models.common.moe")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_zbv_defers_experts_with_reference_grads_and_counts(compiled):
    (got,) = run_ranks(cases.moe_v_pipeline, 1, compiled, timeout=300)
    assert got["split"] == "deferred"
    assert got["w_adds"] > 0  # expert weight gradients added by W passes
    assert got["counts_equal"]
    assert got["worst"] < 1e-5, got
