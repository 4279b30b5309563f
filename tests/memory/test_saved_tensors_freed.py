"""Every zbpipe schedule leaves no saved tensor alive after a step (ScheduleContinuous: after
``flush()``), counted independently of zbpipe's own bookkeeping (``_saved_census.SavedCensus``:
a storage weak reference to every tensor autograd saves, by whichever hook packs it).

2 gloo ranks, the tricky tiny GPT, m = 4, two steps per case, every case in one process group
(starting processes is the slow part). Not counted: parameters and buffers (module state), and
the buffers torch's ``PipelineStage`` receives inputs into and reuses every step (see
``stage_input_buffers``): an input a local stage handed over (V placement) must be freed.
"""

import gc

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from tests.memory import _saved_census as census
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

PLANNED = [
    ("ScheduleZBH1", {}),
    ("ScheduleZBH1", {"exact": True}),
    ("ScheduleZBH2", {}),
    ("ScheduleZBAuto", {"memory_limit": "1p"}),
    ("ScheduleZBAuto", {"memory_limit": "2p"}),
    ("ScheduleZBV", {"memory": "zb"}),
    ("ScheduleZBV", {"memory": "half"}),
    ("ScheduleZBV", {"memory": "min"}),
    ("Schedule1F1BMulti", {}),
]
CASES = [
    (name, {**options, "split": split})
    for split in ("deferred", "graph")
    for name, options in PLANNED + [("ScheduleContinuous", {})]
]


def _census_sees_a_kept_graph(inner_hooks: bool) -> None:
    """The census itself: a graph kept alive shows its saved tensors; freed, it shows none."""
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    state = census.module_state_storages([net])
    x = torch.randn(4, 8)
    with census.SavedCensus() as c:
        if inner_hooks:  # someone else's hooks, pushed inside the census: wrapped, still counted
            with saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
                y = net(x).sum()
        else:
            y = net(x).sum()
    gc.collect()
    assert c.alive(state), f"inner_hooks={inner_hooks}: a live graph's saved tensors not seen"
    y.backward()
    del y, x  # x too: the first Linear saved it
    gc.collect()
    assert c.alive(state) == [], f"inner_hooks={inner_hooks}: freed tensors counted alive"


def test_no_saved_tensor_alive_after_a_step_for_every_schedule_and_split():
    _census_sees_a_kept_graph(inner_hooks=False)
    _census_sees_a_kept_graph(inner_hooks=True)
    per_rank = run_ranks(census.alive_after_each_step, 2, CASES, timeout=600)
    failures = []
    for rank, results in enumerate(per_rank):
        assert len(results) == len(CASES)
        for result in results:
            for k, s in enumerate(result["steps"]):
                assert s["saved"] > 0, f"rank {rank} {result['case']}: the census saw no save"
                if s["alive"]:
                    mib = sum(b for b, _ in s["alive"]) / 2**20
                    failures.append(
                        f"rank {rank} {result['case']} step {k}: {len(s['alive'])} saved "
                        f"storages alive ({mib:.2f} MiB), shapes {[w for _, w in s['alive']][:8]}"
                    )
    assert not failures, "\n".join(failures)
