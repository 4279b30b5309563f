"""A bad configuration raises ValueError at construction, naming the fix, on every rank, fast."""

import pytest

from tests.schedules import _dist_cases as cases
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

EXPECTED_PHRASES = {
    "V schedule given one stage": "expects exactly 2 stage(s) per rank, got 1",
    "costs of the wrong length": "per-stage lists of length 3 but the plan has 2 stages",
    "negative costs": "Costs.f must be >= 0",
    "n_microbatches=0": "n_microbatches must be >= 1",
    "n_microbatches=2.0": "n_microbatches must be an int",
    "not a stage": "not a torch.distributed.pipelining.PipelineStage",
    "two stages per rank": "expects exactly 1 stage(s) per rank, got 2",
    "num_stages != ranks": "set num_stages=2 in every PipelineStage",
    "wrong stage index": "build PipelineStage(..., stage_index=i, ...) for i in",
}


def test_misconfigurations_raise_on_every_rank_without_hanging():
    # A rank that waited on a peer would hang until the launcher's 90 s deadline fails the test
    # (pg_timeout is shorter, so a stuck collective raises first): no stopwatch needed.
    per_rank = run_ranks(cases.construction_errors, 2, timeout=90)
    for rank, messages in enumerate(per_rank):
        for case, phrase in EXPECTED_PHRASES.items():
            assert phrase in messages[case], f"rank {rank} {case}: {messages[case]!r}"
