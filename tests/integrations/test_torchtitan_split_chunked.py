"""The head's cost when torchtitan's loss is a ``ChunkedLossWrapper`` (issue 47): the head and
the loss run per sequence chunk inside the loss call, forward and backward at once, so the
whole head is F in the split's costs and keeps no logits until B; a plain loss keeps F = B = W.
The reference is the projection's FLOPs counted here from the tiny model's dimensions.
"""

from __future__ import annotations

import pytest
import torch
import torchtitan.distributed.pipeline_parallel as tt_pp
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

from tests.integrations import _torchtitan_cases as tiny
from zbpipe.integrations import torchtitan_split as ts
from zbpipe.integrations.names import lookup_zbpipe


def _meta_model():
    with torch.device("meta"):  # costs count parameters: no storage needed
        return tiny.tiny_llama3_config().build()


def test_a_chunked_loss_makes_the_head_all_forward():
    model, config = _meta_model(), tiny.tiny_llama3_config()
    plain = ts.model_layer_costs(model, config, tiny.SEQ, 2)
    chunked = ts.model_layer_costs(model, config, tiny.SEQ, 2, chunked=True)
    projection = 2.0 * (tiny.SEQ * 2) * tiny.DIM * tiny.VOCAB
    head = chunked[-1]
    assert head.names == ("norm", "lm_head")
    assert (head.f, head.b, head.w) == pytest.approx((3 * projection, 0.0, 0.0))
    assert (plain[-1].f, plain[-1].b, plain[-1].w) == pytest.approx((projection,) * 3)
    # the chunked loss keeps its input's gradient (fp32) and the norm's input, not the logits
    assert head.mem == pytest.approx(4.0 * (tiny.SEQ * 2) * 2 * tiny.DIM)
    assert plain[-1].mem == pytest.approx(4.0 * (tiny.SEQ * 2) * (tiny.DIM + 2 * tiny.VOCAB))
    assert chunked[:-1] == plain[:-1]  # the embedding and the layers are untouched


def test_the_chunked_wrapper_is_recognised_and_the_head_judged_up_to_its_max(monkeypatch):
    from torchtitan.config import ParallelismConfig, TrainingConfig

    import zbpipe.torchtitan as zt

    zt.install()
    monkeypatch.delenv(ts.ENV, raising=False)
    assert ts.chunked_loss(ChunkedLossWrapper.Config().build())
    assert not ts.chunked_loss(CrossEntropyLoss.Config().build())
    assert not ts.chunked_loss(None)

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="ZBV",
        pipeline_parallel_microbatch_size=1,
    )
    split = ts.schedule_split(
        lookup_zbpipe("ZBV"),
        model=_meta_model(),
        model_config=tiny.tiny_llama3_config(),
        parallelism=parallelism,
        training=TrainingConfig(local_batch_size=4, seq_len=tiny.SEQ),
        num_ranks=2,
        num_stages=4,
        default_parts=tt_pp._generate_llm_fqn_per_model_part(4, tiny.N_LAYERS, 1, 1),
        loss_fn=ChunkedLossWrapper.Config().build(),
    )
    assert split is not None
    assert split.head_scales[0] == 1.0 and split.head_scales[-1] == ts.HEAD_COST_MAX
    assert len(split.scenario_gains) == len(split.head_scales)
    assert min(split.scenario_gains) == split.worst_gain >= 1.0 - 1e-9
