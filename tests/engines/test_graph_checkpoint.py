"""Activation checkpointing under the split backward, per AC flavour, with checkpointed blocks
ending in weight-free ops (issue 39).

Non-reentrant checkpointing saves a region's inputs and recomputes the region once per backward
call, at the first unpack inside it. The graph engine's B tags each saved tensor with the kind of
node unpacking it and frees the activation-only ones after B; W's own backward calls ask for the
region's inputs again (and replay B's recompute since issue 46). When the region's first node
in B is weight-free (``tanh(linear(x))``, an MoE's combine) the recompute's unpack of the
inputs used to be tagged activation-only and freed, and W's recompute found them gone
("autograd asked for a saved tensor that was already released").

Selective checkpointing (a ``context_fn`` from ``create_selective_checkpoint_contexts``, as
torchtitan's ``SelectiveAC``) hands each saved op output to one backward call only. The graph
engine's W replays B's recompute instead of recomputing (issue 46), so both forms (the wrapper,
a call in a forward) train under ``split="graph"`` on torch 2.13+. ``split="auto"`` on these
Linear-only blocks takes the deferred engine whether wrapped or not (it defers all their weight
work; which engine ``auto`` takes for a wrapper is tests/engines/test_auto_split_selective.py's
and test_graph_promise_refusal.py's). The deferred engine's B is the one backward call and
splits both flavours.

Gradients are compared with an unpipelined, uncheckpointed copy: the recompute replays the same
ops on the same inputs, so the only difference is the order microbatch gradients are summed in
(fp32, 4 microbatches: 1e-6 bounds it). The runs that succeed share one launch of a rank.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.engines import _checkpoint_cases as cases
from zbpipe.engines.graph_backward import backward_input
from zbpipe.memory.saved import SavedTensors
from zbpipe.testing import run_ranks

TOL = 1e-6


#: the cases that succeed, as v_step_grads's (ending, ac, split[, wrapper]), run in one launch
RUNS = [
    *((ending, "full", split) for ending in cases.ENDINGS for split in ("graph", "deferred")),
    *((ending, "selective", "deferred") for ending in cases.ENDINGS),
    *((ending, "none", "auto", True) for ending in cases.ENDINGS),
]


@pytest.fixture(scope="module")
def runs() -> dict[tuple, dict]:
    (got,) = run_ranks(cases.several, 1, RUNS, timeout=300)
    return dict(zip(RUNS, got, strict=True))


@pytest.mark.parametrize("split", ["graph", "deferred"])
@pytest.mark.parametrize("ending", cases.ENDINGS)
def test_full_checkpointing_grads_equal_reference(runs, ending, split):
    got = runs[ending, "full", split]
    assert got["split"] == split
    assert got["worst"] < TOL, got


@pytest.mark.parametrize("ending", cases.ENDINGS)
def test_selective_checkpointing_in_the_forward_grads_equal_reference(runs, ending):
    got = runs[ending, "selective", "deferred"]
    assert got["worst"] < TOL, got


@pytest.mark.parametrize("ending", cases.ENDINGS)
def test_auto_split_trains_a_selective_checkpoint_wrapper(runs, ending):
    """torchtitan's form (``checkpoint_wrapper(block, context_fn=...)``) under ``split="auto"``:
    the deferred engine (Linear-only blocks: it defers all their weight work), gradients equal
    to the unpipelined, unwrapped reference."""
    got = runs[ending, "none", "auto", True]
    assert got["split"] == "deferred"
    assert got["worst"] < TOL, got


def test_graph_engine_trains_a_selective_checkpoint_wrapper():
    (got,) = run_ranks(cases.v_step_grads, 1, "tanh", "none", "graph", True, timeout=120)
    assert got["split"] == "graph"
    assert got["worst"] < TOL, got


def test_graph_engine_trains_selective_checkpointing_in_a_forward():
    (got,) = run_ranks(cases.v_step_grads, 1, "tanh", "selective", "graph", timeout=120)
    assert got["worst"] < TOL, got


@pytest.mark.parametrize("ending", cases.ENDINGS)
def test_b_keeps_what_ws_recompute_needs_and_frees_the_rest(ending):
    """One stage, B and W by hand: after B the checkpointed region's input is still held (W's
    calls through the region unpack it, then replay B's recompute) while the activation-only
    tensor saved outside the region (the input of ``sin``) is freed; W then gives the reference
    gradients."""
    torch.manual_seed(0)
    inner = cases.Inner(ending)
    x = torch.randn(4, 8, requires_grad=True)
    grad_out = torch.randn(4, 8)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(x)
        return h + checkpoint(inner, h, use_reentrant=False)

    forward(x).backward(grad_out)
    want = [x.grad.clone()] + [p.grad.clone() for p in inner.parameters()]
    inner.zero_grad(set_to_none=True)

    saved = SavedTensors()
    with saved.hooks():
        y = forward(x)
    held = {h.tensor.data_ptr(): h for h in saved.holders if h.tensor is not None}
    (gx,), wg = backward_input([y], [grad_out], [x], list(inner.parameters()), saved=saved)
    kept = [ptr for ptr, h in held.items() if h.tensor is not None]
    freed = [ptr for ptr, h in held.items() if h.tensor is None]
    assert kept and freed, (kept, freed)
    assert x.data_ptr() in freed  # sin's input: only SinBackward, an activation node, used it
    wg.run()
    got = [gx] + [p.grad for p in inner.parameters()]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL)
