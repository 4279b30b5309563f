"""Per-rank body of tests/schedules/test_graph_memory_promise.py (module level: spawned processes
import it): the graph engine's held peaks under checkpointing, by the independent meter."""

from __future__ import annotations

import torch

from tests.schedules import _memory_promise_cases as cases


def checkpointed_graph_rows(rank: int, world: int, m: int, names: list) -> dict:
    """Under full and selective checkpointing (graph engine, defaults), per schedule of
    ``names``: the held peak of the step after the re-plan and the re-made plan's predicted
    peak (:func:`tests.schedules._memory_promise_cases.checkpointed_rows`)."""
    torch.set_num_threads(1)
    return {
        ac: cases.checkpointed_rows(rank, world, m, {"ac": ac, "vocab": 64}, names, split="graph")
        for ac in ("full", "selective")
    }
