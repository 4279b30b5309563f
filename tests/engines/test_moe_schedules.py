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


def _eager_and_compiled(rank: int, world: int) -> list[dict]:
    """Both cases in one process (torchtitan's import and the rank's start are paid once)."""
    return [cases.moe_v_pipeline(rank, world, compiled) for compiled in (False, True)]


@pytest.fixture(scope="module")
def found() -> list[dict]:
    (got,) = run_ranks(_eager_and_compiled, 1, timeout=300)
    return got


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_zbv_defers_experts_with_reference_grads_and_counts(found, compiled):
    got = found[compiled]
    assert got["split"] == "deferred"
    assert got["w_adds"] > 0  # expert weight gradients added by W passes
    assert got["counts_equal"]
    assert got["worst"] < 1e-5, got
