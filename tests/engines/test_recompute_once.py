"""A checkpointed block recomputes once per microbatch under both engines (issue 46 item 2).

Non-reentrant ``torch.utils.checkpoint`` recomputes a region once per backward call. The
deferred engine's B is the one call (W runs queued GEMMs). The graph engine's W makes calls of
its own through the region's boundary nodes: it now replays the tensors B's recompute saved
(``zbpipe.engines.graph_recompute``) instead of running the block again, which also lets a
selectively checkpointed region (whose cache serves one call) train under ``split="graph"``.

Counted on one rank holding a 2-stage V (ZBV), 2 checkpointed MLP blocks per stage, m = 4: the
step's forwards are 2 stages x 2 blocks x 4 microbatches = 16, and one recompute each makes 32
(before this, the graph engine ran 44 under full checkpointing and refused selective).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.engines import _recompute_count_cases as cases
from tests.engines._checkpoint_cases import selective_context
from tests.engines._compile_cases import MLPBlock
from zbpipe.engines.graph_backward import backward_input
from zbpipe.memory.saved import SavedTensors
from zbpipe.testing import run_ranks


def test_each_block_recomputes_once_per_microbatch_under_both_engines():
    (got,) = run_ranks(cases.all_block_forwards, 1, timeout=180)
    forwards = 2 * 2 * 4  # stages x blocks x microbatches
    for name, r in got.items():
        split = name.split("/")[0]
        assert r["split"] == split, (name, r)
        assert r["forwards"] == 2 * forwards, (name, r)
        # microbatch gradients summed in another order than the reference's batch: rounding
        assert r["worst"] < 1e-5, (name, r)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_graph_b_then_w_equals_the_fused_backward_with_one_recompute(ac):
    """One stage, B and W by hand: each block runs its forward twice (the forward and B's
    recompute), and the gradients are bitwise those of one fused backward."""
    torch.manual_seed(0)
    blocks = [MLPBlock(), MLPBlock()]
    params = [p for b in blocks for p in b.parameters()]
    calls = [0]
    kwargs = {"context_fn": selective_context} if ac == "selective" else {}

    def run(block: MLPBlock, h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        out: torch.Tensor = block(h)
        return out

    def forward(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = checkpoint(run, b, x, use_reentrant=False, **kwargs)
        return x

    x = torch.randn(4, 3, 16, requires_grad=True)
    grad_out = torch.randn(4, 3, 16)
    forward(x).backward(grad_out)
    want = [x.grad.clone()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    calls[0] = 0
    saved = SavedTensors()
    with saved.hooks():
        y = forward(x)
    (gx,), wg = backward_input([y], [grad_out], [x], params, saved=saved)
    after_b = calls[0]
    wg.run()
    assert (after_b, calls[0]) == (4, 4)  # 2 forwards, 2 recomputes in B, none in W
    got = [gx] + [p.grad for p in params]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
