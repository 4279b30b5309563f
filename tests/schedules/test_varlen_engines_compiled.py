"""Compiled code under ``variable_shapes=True`` with both split engines and V placement: every
step brings new lengths, the gradients equal the eager unpipelined model's, and dynamo compiles
a bounded number of graphs, all in the first step (docs/use/varlen.md, "Compiled code").

One launch of 2 gloo ranks runs every case, each from an empty compile cache, backend
aot_eager (inductor by hand: docs/results/varlen.md): ZB-V, V-Half and ZB-1p under the deferred
engine over blocks compiled in place, and ZB-V under ``split="graph"`` over eager blocks whose
weight-free cores (attention, the MLP's activation) are compiled functions (the graph engine
refuses compiled blocks: tests/engines/test_compiled_every_schedule.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.schedules import _varlen_engines_compiled_cases as cases
from zbpipe import _compat as C
from zbpipe.testing import run_ranks

#: two steps of 4 microbatches, every length new (none of 1: dynamo specializes 0 and 1)
DRAWS = [[7, 29, 13, 50], [9, 31, 12, 44]]
#: V placement under both engines, V-Half and ZB-1p under the deferred one (ZB-H1 with compiled
#: blocks: test_varlen_compiled.py)
CASES = [
    ("ScheduleZBV", "deferred", "blocks", "aot_eager"),
    ("ScheduleZBV", "graph", "cores", "aot_eager"),
    ("ScheduleZBVHalf", "deferred", "blocks", "aot_eager"),
    ("ScheduleZB1P", "deferred", "blocks", "aot_eager"),
]


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    """Per case, per rank, what :func:`cases.compiled_case` returned (each rank's gradients
    were compared with the eager unpipelined model's after every step, in the rank)."""
    per_rank = run_ranks(cases.compiled_cases, 2, CASES, DRAWS, timeout=300)
    return [[rank[j] for rank in per_rank] for j in range(len(CASES))]


@pytest.mark.dist
@pytest.mark.parametrize("j", range(len(CASES)), ids=["-".join(c[:3]) for c in CASES])
def test_compiled_varlen_gradients_and_graph_bound(results, j):
    _, split, _, _ = CASES[j]
    for rank, got in enumerate(results[j]):
        assert got["engine"] == split, got
        assert got["worst"] < 1e-5, (rank, got)  # fp32 rounding (the rank's assert_close held)
        assert got["breaks"] == 0, (rank, got)
        # the documented bound: at most 2 graphs per compiled block or function on a rank, all
        # in the first step (a received input: one for the first length, one symbolic; a marked
        # input: one symbolic, and one more where the shape rule's fake forward runs it)
        first, *later = got["graphs"]
        assert 0 < first <= 2 * got["compiled"], (rank, got)
        assert all(n == first for n in later), (rank, got)


def test_graph_engine_says_what_to_do_about_donated_buffers():
    """A compiled function whose backward donates its buffers refuses the graph engine's
    retain_graph=True: B says how to compile it instead."""
    from zbpipe.engines.graph import GraphEngine

    torch.compiler.reset()
    attend = torch.compile(cases._attend, backend="aot_eager", fullgraph=True)
    lin = torch.nn.Linear(8, 24)
    x = torch.randn(1, 5, 8, requires_grad=True)
    q, k, v = lin(x).view(1, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    for t in (q, k, v):  # as CoreBlock does (a static-shape graph of it donates nothing)
        C.mark_dynamic(t, 2)
    with C.donated_buffers(True):
        out = attend(q, k, v)
    engine = GraphEngine()
    with pytest.raises(RuntimeError, match=r"stage 0's graph .*_compat.donated_buffers\(False\)"):
        engine.backward_input(
            (0, 0), [out], [torch.ones_like(out)], [x], lambda: list(lin.parameters()), None
        )
