"""MoE experts inside ``torch.compile``\\ d code: their weight gradients wait for W there too.

Each module is compiled whole with ``fullgraph=True`` (a graph break would fail the compile),
then runs microbatches whose tokens per expert differ (experts with none among them): dynamo
must compile once (the routing is in the values of a tensor, not in the graph), B must leave
the expert weights' ``.grad`` alone, and after W the gradients must equal those of the same
module compiled without zbpipe. Kept small: compiling is the slow part (CI time).
"""

from __future__ import annotations

import pytest
import torch

from tests.engines import _moe_cases as cases
from zbpipe import _compat as C

pytest.importorskip("torchtitan.models.common.moe")


def _run(fused, split, inputs, backend, deferred):
    fused.compile(fullgraph=True, backend=backend)
    split.compile(fullgraph=True, backend=backend)
    engine = cases.engine_on(split)  # routes the compiled experts' weights
    counters = C.dynamo_counters()
    graphs = []
    for mb, args in enumerate(inputs):
        cases.fused_step(fused, *args)
        before = cases.grads(split)
        cases.split_step(engine, split, (0, mb), *args)
        for name in deferred:  # B left every weight it defers alone
            g = split.get_parameter(name).grad
            assert (g is None and before[name] is None) or torch.equal(g, before[name]), name
        engine.backward_weight((0, mb))
        graphs.append(counters["stats"]["unique_graphs"])
        for (name, p), q in zip(fused.named_parameters(), split.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert graphs[1:] == graphs[:-1], f"recompiled when the routing changed: {graphs}"
    # outside zbpipe (no store): the same graph, the gradient computed in place
    split.zero_grad(set_to_none=True)
    fused.zero_grad(set_to_none=True)
    cases.fused_step(fused, *inputs[0])
    cases.fused_step(split, *inputs[0])
    for (name, p), q in zip(fused.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] == graphs[-1], "recompiled outside zbpipe"
    assert sum(counters["graph_break"].values()) == 0


def test_compiled_grouped_experts_defer_under_inductor():
    torch._dynamo.reset()
    fused, split = cases.twins(cases.grouped_experts())
    inputs = [cases.routed_rows(counts, mb) for mb, counts in enumerate(cases.COUNTS)]
    _run(fused, split, inputs, "inductor", ("w1_EFD", "w2_EDF", "w3_EFD"))


def test_compiled_bmm_and_einsum_experts_defer():
    torch._dynamo.reset()
    fused, split = cases.twins(cases.BatchedExperts())
    torch.manual_seed(0)
    inputs = [(torch.randn(cases.EXPERTS, 5, cases.DIM),) for _ in range(2)]
    _run(fused, split, inputs, "aot_eager", ("gate_up", "down", "mix"))
