"""Activation checkpointing under the split: how often a checkpointed block runs its forward.

One rank holds a 2-stage V pipeline (ZBV), 2 blocks per stage, each under non-reentrant
``torch.utils.checkpoint``, m = 4: a step runs 16 block forwards. The deferred engine's B is one
ordinary autograd pass, so each block is recomputed once per microbatch, in B, and W (which only
runs queued GEMMs) recomputes nothing: 32 in all. Under ``split="graph"`` W re-enters the graph
with its own ``autograd.grad`` calls, which replay B's recompute (issue 46; it was 44 here before,
torch's ScheduleZBVZeroBubble runs 56): 32 too. Gradients equal an unpipelined, uncheckpointed
reference.
"""

from __future__ import annotations

import pytest

from tests.engines import _compile_cases as cases
from zbpipe.testing import run_ranks


@pytest.fixture(scope="module")
def found() -> dict[str, dict]:
    """Both engines' runs in one process."""
    splits = ("deferred", "graph")
    (got,) = run_ranks(
        cases.several, 1, [("checkpointed_v_forwards", s) for s in splits], timeout=120
    )
    return dict(zip(splits, got, strict=True))


def test_deferred_engine_recomputes_each_checkpointed_block_once_per_microbatch(found):
    got = found["deferred"]
    assert got["forwards"] == 16 + 16, got
    assert got["worst"] < 1e-5


def test_graph_engine_recomputes_each_checkpointed_block_once_per_microbatch_too(found):
    got = found["graph"]
    assert got["forwards"] == 16 + 16, got
    assert got["worst"] < 1e-5
