"""The graph engine is not chosen where it cannot keep a schedule's memory promise (issue 46).

On activation-checkpointed stages the graph engine holds, from B to W, each region's recomputed
saved tensors (zbpipe.engines.graph_recompute), measured at 1.3x (selective) to 5.3x (full) a
fused 1F1B's peak on 4 ranks (docs/results/memory-promise.md). Known before the first step: a
``checkpoint_wrapper`` in a stage and the plan's promise. So ``split="auto"`` takes the deferred
engine there (INFO, no warning: the graph engine was not chosen), and an explicit
``split="graph"`` runs with one WARNING naming ``split="deferred"``. The reference for each
choice is the same call on the same stage without the promise or without the wrapper (the graph
engine: the stage's convolution weight is what only it defers).
"""

from __future__ import annotations

import logging
import types

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.engines import _promise_refusal_cases as cases
from zbpipe import Costs, plan
from zbpipe.engines import choose_engine
from zbpipe.schedules.memory_promise import promise_words
from zbpipe.testing import run_ranks

PROMISE = "1F1B's peak"


def _stage(wrapped: bool) -> types.SimpleNamespace:
    block = cases.ConvBlock()
    return types.SimpleNamespace(
        stage_index=1, submod=nn.Sequential(checkpoint_wrapper(block) if wrapped else block)
    )


def _choose(caplog, split: str, wrapped: bool, promise: str | None) -> tuple[str, list]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zbpipe.engines"):
        name = choose_engine(split, [_stage(wrapped)], "Test", promise=promise).name
    return name, [r for r in caplog.records if r.name.startswith("zbpipe.engines")]


def test_auto_refuses_the_graph_engine_on_checkpointed_stages_with_a_promise(caplog):
    # the references: without the wrapper, or without a promise, auto takes the graph engine
    assert _choose(caplog, "auto", False, PROMISE)[0] == "graph"
    assert _choose(caplog, "auto", True, None)[0] == "graph"
    name, records = _choose(caplog, "auto", True, PROMISE)
    assert name == "deferred"
    assert not [r for r in records if r.levelno >= logging.WARNING]
    (line,) = [r.getMessage() for r in records if "checkpointed" in r.getMessage()]
    assert "stage 1's submodule '0'" in line and PROMISE in line and "split='graph'" in line


def test_explicit_graph_on_checkpointed_stages_warns_once_naming_deferred(caplog):
    name, records = _choose(caplog, "graph", True, PROMISE)
    assert name == "graph"  # the user's choice stands
    (warning,) = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert "split='deferred'" in warning and PROMISE in warning
    for wrapped, promise, split in ((False, PROMISE, "graph"), (True, None, "graph"),
                                    (True, PROMISE, "deferred")):  # fmt: skip
        _, quiet = _choose(caplog, split, wrapped, promise)
        assert not [r for r in quiet if r.levelno >= logging.WARNING], (wrapped, promise, split)


@pytest.mark.parametrize(
    ("name", "want"),
    [("ZBH1", "1F1B's peak"), ("ZB2P", "twice 1F1B's peak"), ("ZBV", "1F1B's peak"),
     ("ZBVMin", "V-Min's (p + 4) / 3 microbatches"), ("1F1B", None), ("ZBH2", None)],
)  # fmt: skip
def test_promise_words_follow_the_plan(name, want):
    p = plan(name, num_ranks=2, n_microbatches=4, costs=Costs())
    chunks = 2 if name.startswith("ZBV") else 1
    sched = types.SimpleNamespace(_num_stages=2 * chunks, pp_group_size=2, _n_microbatches=4)
    assert promise_words(sched, p) == want


def test_schedules_pass_their_promise_to_the_choice():
    """One rank, real schedules: ZBV's promise reaches the choice; 1F1B (fused) has none."""
    todo = [("ScheduleZBV", "auto", False), ("ScheduleZBV", "auto", True),
            ("ScheduleZBV", "graph", True), ("Schedule1F1BMulti", "graph", True)]  # fmt: skip
    (got,) = run_ranks(cases.choices, 1, todo, timeout=180)
    plain, auto, graph, fused = got
    assert plain["split"] == "graph" and not plain["info_ac"]  # the reference: no wrapper
    assert auto["split"] == "deferred" and len(auto["info_ac"]) == 1 and not auto["warnings"]
    assert graph["split"] == "graph" and len(graph["warnings"]) == 1
    assert fused["split"] == "graph" and not fused["warnings"]
