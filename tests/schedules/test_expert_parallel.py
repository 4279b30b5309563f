"""Expert parallelism with pipeline parallelism (issue 39): EP = 2 x PP = 2 on 4 gloo ranks.

torchtitan's own token dispatch fails on gloo under its default SPMD backend (its list
``all_to_all`` refuses the uneven splits of a routing); zbpipe's EP model
(:mod:`zbpipe.testing.expert_parallel`) moves tokens the way torchtitan's functional path does,
with ``all_to_all_single`` and split sizes, which gloo runs. Each replica is a pipeline of its
own data; each stage's experts are split over the two ranks of an EP group, so every forward and
backward of a stage is a collective with the other replica's same stage: the replicas must run
the same plan. By default each schedule re-plans after its first step for the bytes it measured
(``measure_memory``); the replicas' routings differ, so do their bytes, and before issue 39 the
replicas re-planned apart and their all-to-alls paired one microbatch's forward with another's
backward (gloo: "Received data size doesn't match expected size"). The measurements are now
merged over every replica (``zbpipe.observe.profile.gather_stage_values``). Gradients are
compared with an unpipelined single-process model holding every expert, trained on both
replicas' batches (fp32: 1e-5 bounds the summation-order differences).
"""

from __future__ import annotations

from tests.schedules import _ep_cases as cases
from zbpipe.testing import run_ranks


def test_ep_x_pp_grads_equal_reference_under_each_schedule():
    """Default arguments (the plan re-made after step 1 for the bytes it measured: the replicas
    measure different bytes, their routings differ, and must still agree on one plan), then
    each engine by name."""
    runs = [
        ("ZBH1", {}),
        ("ZBV", {}),
        ("ZBVHalf", {}),
        ("ZBV", {"split": "graph"}),
        ("ZBH1", {"split": "deferred"}),
    ]
    results = run_ranks(cases.ep_pp_grads, 4, runs, timeout=240)
    for rank, got in enumerate(results):
        assert [name for name, _, _ in got] == [name for name, _ in runs], rank
        assert [split for _, split, _ in got[-2:]] == ["graph", "deferred"]
        for name, split, worst in got:
            assert worst < 1e-5, (rank, name, split, worst)
