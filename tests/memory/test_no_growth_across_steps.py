"""No schedule keeps more alive after step 9 than after step 4, and none keeps a saved tensor.

Every zbpipe schedule class, both split engines, loop and V placement, three models (a Linear
chain, the tricky tiny GPT, the GPT with its output head tied to the embedding), 10 training
steps on 2 gloo ranks; counts of distinct storages (``_leak_cases``) after steps 4 and 9 (a
re-plan happens after step 0; five steps apart, anything a step leaves behind grows the count
five times over; this ran 21 steps, counted at 5 and 20, before issue 45):

* both counts equal (no growth);
* no saved storage alive but torch's reused receive buffers (nothing left of any step).

V placement hands a stage's output to the next stage on the same rank: torch's stage kept
each handed tensor until the next step (m activations and m gradients per step on that rank);
zbpipe drops them after the receiving stage's backward. A memory meter must change nothing:
the metered cases must not grow either, nor torch's own ScheduleZBVZeroBubble watched by the
meter (whose saved-tensor holders once made a reference cycle with each graph, so every graph
of a split backward outlived its step: the "torch leak" benchmarks/torch_zbv_leak.py reported).
One process group for every case (starting processes is the slow part).
"""

import gc

import pytest
import torch
from torch import nn

from tests.memory import _leak_cases as leak
from tests.memory import _saved_census as census
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

STEPS = 10
COUNTED = [4, STEPS - 1]
D, G = "deferred", "graph"
CASES = [  # (schedule, options, model, metered): every engine meets every model and placement
    ("ScheduleZBH1", {"split": D}, "linear", False),
    ("ScheduleZBH1", {"split": G}, "gpt", False),
    ("ScheduleZBH2", {"split": D}, "gpt", False),
    ("ScheduleZBH2", {"split": G}, "linear", False),
    ("ScheduleZBAuto", {"split": D}, "linear", False),
    ("ScheduleZBAuto", {"split": G}, "gpt", False),
    ("Schedule1F1BMulti", {"split": D}, "gpt", False),
    ("Schedule1F1BMulti", {"split": G}, "linear", False),
    ("ScheduleZBV", {"split": D, "memory": "zb"}, "linear", False),
    ("ScheduleZBV", {"split": G, "memory": "zb"}, "gpt-tied", False),
    ("ScheduleZBV", {"split": D, "memory": "half"}, "gpt-tied", False),
    ("ScheduleZBV", {"split": G, "memory": "half"}, "gpt", False),
    ("ScheduleZBV", {"split": D, "memory": "min"}, "gpt", False),
    ("ScheduleZBV", {"split": G, "memory": "min"}, "linear", False),
    ("ScheduleZBV", {"split": D}, "gpt-tied", True),
    ("ScheduleZBV", {"split": G}, "linear", True),
    (leak.TORCH_ZBV, {}, "linear", True),
]


def test_the_counts_see_a_graph_kept_from_every_step():
    """The counting itself: a graph kept per step grows both counts; freed, neither grows."""
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    state = census.module_state_storages([net])
    for keep in (True, False):
        kept, counts = [], []
        with leak.frozen_gc(), census.SavedCensus() as saved:
            for _ in range(3):
                y = net(torch.randn(4, 8)).sum()
                if keep:
                    kept.append(y)
                del y
                gc.collect()
                counts.append((len(saved.alive(state)), leak._tensor_storages(state)))
        growing = all(b[0] > a[0] and b[1] > a[1] for a, b in zip(counts, counts[1:]))
        assert growing if keep else len(set(counts)) == 1, (keep, counts)


@pytest.mark.timeout(600)  # the run below has its own deadline
def test_no_schedule_keeps_more_after_step_9_than_after_step_4():
    """(Was test_no_schedule_keeps_more_after_step_20_than_after_step_5: the same counts over
    fewer steps.)"""
    per_rank = run_ranks(leak.counts_per_step, 2, CASES, STEPS, COUNTED, timeout=540)
    failures = []
    for rank, results in enumerate(per_rank):
        assert len(results) == len(CASES)
        for result, (name, *_rest) in zip(results, CASES, strict=True):
            early, late = result["rows"]
            where = f"rank {rank} {result['case']}"
            for what in ("saved", "tensors", "meter_live"):
                if late[what] > early[what]:
                    failures.append(
                        f"{where}: {what} grew from {early[what]} after step {early['step']} "
                        f"to {late[what]} after step {late['step']}"
                    )
            # torch's own stage keeps what a local stage handed over until the next step
            if name != leak.TORCH_ZBV and late["left"]:
                mib = sum(b for b, _ in late["left"]) / 2**20
                failures.append(
                    f"{where}: {len(late['left'])} saved storages ({mib:.3f} MiB) alive after "
                    f"step {late['step']}, shapes {[s for _, s in late['left']][:8]}"
                )
    assert not failures, "\n".join(failures)
