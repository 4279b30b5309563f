"""What W carries per engine (the census behind ``split="auto"``), against counts by hand."""

from __future__ import annotations

import logging
import types

import pytest
from torch import nn

from tests.engines import _moe_cases as cases
from zbpipe.engines import choose_engine
from zbpipe.engines.weight_share import census, engine_shares

pytest.importorskip("torchtitan.models.common.moe")

E, D, H = cases.EXPERTS, cases.DIM, cases.HIDDEN


def _stages(*modules):
    return [types.SimpleNamespace(stage_index=i, submod=m) for i, m in enumerate(modules)]


def _converted():
    from torchtitan.models.common.moe import GroupedExperts

    class Float8LikeExperts(GroupedExperts):  # a converter's override of the seam
        def _grouped_mm(self, *, A, B_t, offs):  # noqa: N803 (torchtitan's names)
            return super()._grouped_mm(A=A, B_t=B_t, offs=offs)

    m = cases.grouped_experts()
    m.__class__ = Float8LikeExperts
    return m


def test_moe_layer_census_by_hand():
    stage = nn.ModuleDict({"moe": cases.moe_layer(top_k=2), "norm": nn.RMSNorm(D)})
    got = {c.kind: c for c in census(stage)}
    experts = 3 * E * H * D
    assert got["experts"].elements == experts and got["experts"].n_modules == 1
    assert got["experts"].flops_per_token == 2 * experts * 2 / E  # each token visits 2 of 4
    assert got["linear"].elements == E * D and got["linear"].flops_per_token == 2 * E * D
    assert got["vector"].elements == D and got["vector"].in_w == ("graph",)
    shares = engine_shares(_stages(stage))
    total_flops = 2 * experts * 2 / E + 2 * E * D + D
    assert shares["deferred"].elements == (experts + E * D) / (experts + E * D + D)
    assert shares["deferred"].flops == pytest.approx((total_flops - D) / total_flops)
    assert shares["graph"].elements == 1 and not shares["graph"].refused


def test_auto_defers_an_moe_stage_and_logs_what_w_carries(caplog):
    stage = nn.Sequential(cases.moe_layer())
    with caplog.at_level(logging.INFO, logger="zbpipe.engines"):
        assert choose_engine("auto", _stages(stage), "Test").name == "deferred"
    assert "stage 0: W would carry 100.00% of weight elements" in caplog.text
    assert "[1 Linears, 1 expert modules]" in caplog.text
    assert "chose the deferred engine" in caplog.text


def test_converted_experts_stay_in_b_and_auto_takes_the_graph_engine(caplog):
    stage = nn.ModuleList([_converted(), nn.Linear(D, D)])
    got = {c.kind: c for c in census(stage)}
    assert got["converted experts"].elements == 3 * E * H * D
    assert got["converted experts"].in_w == ("graph",)
    with caplog.at_level(logging.INFO, logger="zbpipe.engines"):
        assert choose_engine("auto", _stages(stage), "Test").name == "graph"
    assert "converted experts (" in caplog.text and "split='deferred'" in caplog.text


def test_compiled_converted_experts_still_get_the_deferred_engine(caplog):
    stage = nn.ModuleList([_converted(), nn.Linear(D, D)])
    stage[0].compile(backend="eager")
    shares = engine_shares(_stages(stage))
    assert shares["graph"].refused
    with caplog.at_level(logging.INFO, logger="zbpipe.engines"):
        assert choose_engine("auto", _stages(stage), "Test").name == "deferred"
    assert "refuses compiled stages" in caplog.text


def test_bmm_experts_count_as_deferred():
    got = {c.kind: c for c in census(cases.BatchedExperts())}
    assert got["experts"].n_modules == 1
    assert got["experts"].elements == E * D * 2 * H + E * H * D + 2 * E * D * D
