"""The graph engine's plan under activation checkpointing counts what its W holds (issue 46
item 3), on 2 gloo ranks, measured by the meter that shares nothing with zbpipe
(``tests/memory/_independent_meter.py``).

From B to W the graph engine keeps every tensor a checkpointed region's recompute saved (W
replays that recompute instead of running the region again: :mod:`zbpipe.engines.
graph_recompute`), far more than the region's inputs the forward kept. The probe is told about
them, so the plan re-made for the measured bytes predicts a peak the step after the re-plan
does not exceed, under full and selective checkpointing. (What that peak is against torch
1F1B's, and the schedules' promises without checkpointing on 4 ranks:
docs/results/memory-promise.md, ``benchmarks/memory_promise.py --engines graph``.)
"""

from __future__ import annotations

import pytest

from tests.schedules import _graph_memory_cases as cases
from zbpipe.testing import run_ranks

P, M = 2, 4
NAMES = ["ZBH1", "ZBV"]
#: a twentieth, as the 4-rank promise tests: the meter sees what plans leave out (a send's
#: buffer until it is let go of, the loss's scalars)
TOL = 1.05


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(cases.checkpointed_graph_rows, P, M, NAMES, timeout=300)


@pytest.mark.dist
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_checkpointed_graph_engine_holds_no_more_than_its_plan_predicts(per_rank, ac):
    for name in NAMES:
        measured = max(r[ac][name]["measured"] for r in per_rank)
        predicted = per_rank[0][ac][name]["predicted"]
        assert measured <= TOL * predicted, (name, measured / predicted)
