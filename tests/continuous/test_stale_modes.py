"""The stale continuous modes (2bw, stash) and 2bw's weight prediction (issue 29).

* the prediction's update rule on a one-weight model, against numbers computed by hand;
* the weight versions' bookkeeping: tied parameters swapped together, a recycled gradient
  buffer no pass wrote handed back as None (an optimizer must skip that parameter, as before),
  stash's copy made only for a forward a step overtakes (and autograd's refusal otherwise);
* on 2 gloo ranks: 2bw with prediction equals its rule replayed on the unpipelined model,
  stash's default (in-GEMM) summation follows its version rule, and two same-seed runs of every
  stale mode are bitwise identical.
"""

import numpy as np
import pytest
import torch
from torch import nn

from tests.continuous import _continuous_cases as cc
from tests.continuous import _stale_cases as sc
from zbpipe.continuous.versions import ModuleSlots, WeightVersions
from zbpipe.testing import run_ranks

N, M = 5, 3
# stash at p = 2 streams (a mini-batch's forwards straddling a step) only with m < 2p - 1; with
# more microbatches its plan is a sync order, faster there, and one version would be all it keeps
M_STASH = 2


def _two_bw_steps(correction: str | None, n: int) -> list[float]:
    """One stage holding one weight w (w0 = 1), loss w^2 / 2 (gradient w), SGD lr 0.1, one
    microbatch per mini-batch, run through WeightVersions in 2bw's stream order: F(k + 1) comes
    before B/W(k) and the step of k. Returns the master weight after each step."""
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    versions = WeightVersions(lin, "2bw", correction)
    forwards = {0: versions.acquire(0, 0)[1]}
    out = []
    for k in range(n):
        if k + 1 < n:
            forwards[k + 1] = versions.acquire(k + 1, k + 1)[1]  # F of k + 1 (2bw: version k)
        (w,) = forwards.pop(k)
        versions.prepare_grads((versions.uses[k], k))
        (0.5 * w.square()).sum().backward()  # B and W of k: dL/dw = w
        versions.release(k, next_minibatch=k + 2 if k + 1 < n else k + 1)
        (lin.weight.grad,) = versions.take_grads(k)
        versions.before_step(next_minibatch=k + 2 if k + 1 < n else k + 1)
        opt.step()
        versions.recycle_grads([lin.weight.grad])
        lin.weight.grad = None
        versions.updated(next_minibatch=k + 2 if k + 1 < n else k + 1)
        out.append(lin.weight.item())
    return out


def test_prediction_rule_on_a_hand_computed_example():
    """W(k+1) = W(k) - 0.1 g_k, with g_k the gradient at the weights mini-batch k ran on.

    sync runs k on W(k): 0.9, 0.81, 0.729, 0.6561.
    2bw runs k on W(k-1): g = 1, 1, W(1) = 0.9, W(2) = 0.8 -> 0.9, 0.8, 0.71, 0.63.
    predict runs k on P(k-1) = W(k-1) + (W(k-1) - W(k-2)), P(0) = W(0): g = 1, 1,
    P(1) = 0.9 + (0.9 - 1) = 0.8, P(2) = 0.8 + (0.8 - 0.9) = 0.7 -> 0.9, 0.8, 0.72, 0.65:
    two steps after the first, each closer to sync than 2bw's.
    nesterov runs k on W(k-1) + 2 (W(k-1) - W(k-2)): g = 1, 1, 0.9 - 0.2 = 0.7, 0.8 - 0.2 = 0.6
    -> 0.9, 0.8, 0.73, 0.67 (the gradient taken a step ahead of the weights it updates).
    """
    np.testing.assert_allclose(_two_bw_steps(None, 4), [0.9, 0.8, 0.71, 0.63], rtol=1e-6)
    np.testing.assert_allclose(_two_bw_steps("predict", 4), [0.9, 0.8, 0.72, 0.65], rtol=1e-6)
    np.testing.assert_allclose(_two_bw_steps("nesterov", 4), [0.9, 0.8, 0.73, 0.67], rtol=1e-6)


def test_2bw_on_the_master_applies_each_update_a_minibatch_late():
    """The last stage's 2bw (mini-batches apart: all passes of k before any of k + 1): the
    update of k - 1 runs after k's passes, where k's would run, so k finds version k - 1 in the
    master itself. Same one-weight model as above: the hand-computed 2bw weights
    0.9, 0.8, 0.71, 0.63, with no copy of the weights until the last update, which copies the
    version the next stream's first mini-batch still needs (flush)."""
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    versions = WeightVersions(lin, "2bw", on_master=True)
    n, out = 4, []

    def step(k, next_minibatch):
        (lin.weight.grad,) = versions.take_grads(k)
        versions.before_step(next_minibatch)
        opt.step()
        versions.recycle_grads([lin.weight.grad])
        lin.weight.grad = None
        versions.updated(next_minibatch)
        out.append(lin.weight.item())

    for k in range(n):
        key, (w,) = versions.acquire(k, k, overtaken=False)
        assert w.data_ptr() == lin.weight.data_ptr(), "runs on the master"
        versions.prepare_grads(key)
        (0.5 * w.square()).sum().backward()  # B and W of k: dL/dw = w
        versions.release(k, next_minibatch=k + 1)
        if k >= 1:
            step(k - 1, next_minibatch=k + 1)
    assert versions.copies == 0 and out == pytest.approx([0.9, 0.8, 0.71], rel=1e-6)
    step(n - 1, next_minibatch=n)  # flush(): mini-batch n will run on version n - 1
    assert out[-1] == pytest.approx(0.63, rel=1e-6)
    assert versions.copies == 1
    kept = versions.store[versions.version_for(n)]
    assert kept[0].data_ptr() != lin.weight.data_ptr() and kept[0].item() == pytest.approx(0.71)


@pytest.mark.parametrize("odd_layout", [False, True], ids=["same-layout", "odd-layout"])
def test_the_flush_copy_of_a_lagged_stage_goes_into_the_last_gradient_buffers(odd_layout):
    """flush() on a lagged stage copies the version the next stream's first mini-batch needs
    into the buffers of the gradient stepped before (no fresh pages), and training across the
    flush follows the hand-computed 2bw weights: W(k + 1) = W(k) - 0.1 W(k - 1) (dL/dw = w on
    W(k - 1)), from 1, 0.9: 0.8, 0.71, 0.63, then 0.559, 0.496 in the second stream. A buffer
    whose layout is not its weight's is not taken: that weight gets a buffer of its own."""
    lin = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    versions = WeightVersions(lin, "2bw", on_master=True)
    out, grads = [], []

    def step(k, next_minibatch):
        (g,) = versions.take_grads(k)
        if odd_layout:  # a gradient in another layout than the weight's
            g = g.t().contiguous().t()
        lin.weight.grad = g
        grads.append(g)
        versions.before_step(next_minibatch)
        opt.step()
        versions.recycle_grads([lin.weight.grad])
        lin.weight.grad = None
        versions.updated(next_minibatch)
        out.append(lin.weight[0, 0].item())

    def run(k):
        key, (w,) = versions.acquire(k, k, overtaken=False)
        versions.prepare_grads(key)
        (0.5 * w.square()).sum().backward()
        versions.release(k, next_minibatch=k + 1)

    for k in range(4):
        run(k)
        if k >= 1:
            step(k - 1, next_minibatch=k + 1)
    version_3 = lin.weight.detach().clone()
    step(3, next_minibatch=4)  # flush(): mini-batch 4 will run on version 3
    kept = versions.store[versions.version_for(4)][0]
    same = kept.data_ptr() == grads[-2].data_ptr()  # the gradient of mini-batch 2
    assert same is not odd_layout, "the copy goes into the gradient buffer iff it fits"
    assert kept.stride() == lin.weight.stride()
    assert torch.equal(kept, version_3) and kept[0, 0].item() == pytest.approx(0.71)
    versions.forget_leaf_sets()  # the stream's end (ScheduleContinuous._reset_stream)
    versions.drop_spare_grads()
    for k in range(4, 6):
        run(k)
        if k >= 5:
            step(k - 1, next_minibatch=k + 1)
    step(5, next_minibatch=6)
    assert out == pytest.approx([0.9, 0.8, 0.71, 0.63, 0.559, 0.496], rel=1e-6)
    assert versions.copies == 2


def test_on_master_is_plain_2bw_only():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="on_master is for mode='2bw' without a correction"):
        WeightVersions(lin, "2bw", "predict", on_master=True)
    with pytest.raises(ValueError, match="on_master is for mode='2bw' without a correction"):
        WeightVersions(lin, "stash", on_master=True)


def test_prediction_is_2bw_only():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs mode='2bw'"):
        WeightVersions(lin, "stash", "predict")
    with pytest.raises(ValueError, match="correction must be one of"):
        WeightVersions(lin, "2bw", "momentum")


def test_tied_parameters_are_swapped_together_and_restored():
    a, b = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
    b.weight = a.weight
    module = nn.Sequential(a, b)
    params = list(module.parameters())
    assert len(params) == 1
    slots = ModuleSlots(module, params)
    leaf = params[0].detach().clone().requires_grad_()
    slots.install("v", [leaf])
    assert module[0].weight is leaf and module[1].weight is leaf
    slots.restore()
    assert module[0].weight is params[0] and module[1].weight is params[0]
    assert list(module.parameters()) == params


def test_a_recycled_gradient_buffer_nothing_took_leaves_the_gradient_none():
    """A parameter the mini-batch never used keeps grad None (AdamW then skips it, weight decay
    included), although the buffer of its last gradient was offered to its leaf."""
    used, unused = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
    module = nn.ModuleList([used, unused])
    versions = WeightVersions(module, "stash")
    versions.recycle_grads([torch.ones(2, 2), torch.ones(2, 2)])  # a previous step's gradients
    key, (w_used, _w_unused) = versions.acquire(0, 0)
    versions.prepare_grads(key)
    (w_used.sum()).backward()
    versions.release(0, next_minibatch=1)
    g_used, g_unused = versions.take_grads(0)
    assert g_unused is None
    assert torch.equal(g_used, torch.ones(2, 2))  # zeroed, then the one pass added into it


def _stash_step(lin, opt, versions, k):
    """The optimizer step of mini-batch k as the runtime runs it (gradient 1 everywhere)."""
    lin.weight.grad = torch.ones_like(lin.weight)
    opt.step()
    lin.weight.grad = None
    versions.updated(next_minibatch=k + 1)


def test_stash_copies_the_weights_only_for_a_forward_a_step_overtakes():
    """stash: a forward whose backward passes end before the next step runs on the master
    itself (no copy); the first forward a step overtakes gets the latest version copied out, and
    keeps its values through the step."""
    lin = nn.Linear(2, 2, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    versions = WeightVersions(lin, "stash")
    _key, (w0,) = versions.acquire(0, 0, overtaken=False)
    assert w0.data_ptr() == lin.weight.data_ptr()
    versions.release(0, next_minibatch=1)
    _stash_step(lin, opt, versions, 0)
    before = lin.weight.detach().clone()
    _key, (w1,) = versions.acquire(1, 1, overtaken=True)  # a step comes before its backward
    assert w1.data_ptr() != lin.weight.data_ptr() and torch.equal(w1, before)
    _stash_step(lin, opt, versions, 1)
    assert torch.equal(w1, before) and torch.equal(lin.weight.detach(), before - 0.5)
    assert versions.peak == 2


def test_stash_on_the_master_fails_loudly_if_a_step_overtakes_it():
    """The safety net of running on the master: were a step to come before the backward of a
    forward told it would not, autograd refuses the backward (no silently wrong gradient)."""
    lin = nn.Linear(2, 2, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    versions = WeightVersions(lin, "stash")
    _key, (w,) = versions.acquire(0, 0, overtaken=False)
    loss = w.square().sum()  # saves w for its backward
    _stash_step(lin, opt, versions, 0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_engine_writes_a_first_product_into_the_offered_buffer():
    """The deferred W's first product goes into the offered buffer (no fresh allocation), with
    the bits of the product it would otherwise have stolen; the next one adds inside the GEMM."""
    from zbpipe.engines.accumulate import GRAD_BUFFER, add_product

    torch.manual_seed(0)
    weight = torch.randn(4, 3).requires_grad_()
    x, g = torch.randn(5, 3), torch.randn(5, 4)
    buf = torch.full((4, 3), 7.0)
    setattr(weight, GRAD_BUFFER, buf)
    with torch.no_grad():
        add_product(weight, x, g, None)
        assert weight.grad is buf and torch.equal(buf, g.t().mm(x))
        add_product(weight, x, g, None)  # the offer was used once
    assert weight.grad is buf and not hasattr(weight, GRAD_BUFFER)


@pytest.fixture(scope="module")
def runs():
    cases = [
        (M, N, "2bw", "sgd", "predict"),
        (M, N, "2bw", "adamw", "predict"),
        (M_STASH, N, "stash", "sgd", None),
        (M, N, "2bw", "adamw", None),
        (M_STASH, N, "stash", "adamw", None),
        (M, N, "2bw", "adamw", "predict"),
        (M, N, "2bw", "sgd", "nesterov"),
    ]
    cases += cases[3:6]  # three of them again: determinism
    out = run_ranks(sc.train_cases, 2, cases, timeout=240)
    return {i: [out[r][i] for r in range(2)] for i in range(len(cases))}


@pytest.mark.dist
def test_2bw_two_streams_on_one_schedule_follow_the_version_rule():
    """flush() in the middle of 2bw training changes nothing: mini-batch k still runs on
    W(k - 1) across the flush (on the last stage that version survives the flush as the one
    copy flush makes). Reference: the rule replayed over all mini-batches as one run."""
    out = run_ranks(sc.train_two_streams, 2, M, 2, N - 2, "adamw", timeout=120)
    ref, _ = cc.reference(2, M, N, "adamw", lambda s, g: max(g // M - 1, 0))
    _assert_close(out, ref, "adamw", 5e-6, "2bw adamw, two streams")
    assert [o["copies"] for o in out] == [N, 2], "one copy per step on stage 0, per flush on 1"


@pytest.mark.dist
def test_2bw_nesterov_follows_its_rule(runs):
    ref = sc.reference_predict(2, M, N, "sgd", horizon=2.0)
    _assert_close(runs[6], ref, "sgd", 1e-6, "2bw+nesterov sgd")


def _assert_close(per_rank, ref, opt, tol, what):
    for r in range(2):
        for name, want in ref[r].items():
            a, b = torch.as_tensor(per_rank[r]["params"][name]), want
            if opt == "adamw" and name.endswith("qkv.bias"):  # see test_continuous._skip
                h = cc.CFG.hidden
                a, b = torch.cat([a[:h], a[2 * h :]]), torch.cat([b[:h], b[2 * h :]])
            err = cc.rel_err(a, b)
            assert err <= tol, f"{what}: rank {r} {name} off by {err:.2e} (tolerance {tol:g})"


@pytest.mark.dist
@pytest.mark.parametrize("case,opt", [(0, "sgd"), (1, "adamw")])
def test_2bw_prediction_follows_its_rule(runs, case, opt):
    # tolerances as in test_continuous.py (fp32, another summation order than the reference's)
    tol = {"sgd": 1e-6, "adamw": 5e-6}[opt]
    _assert_close(runs[case], sc.reference_predict(2, M, N, opt), opt, tol, f"2bw+predict {opt}")
    assert all(r["max_live"] <= 2 for r in runs[case]), "prediction needs no third version"


@pytest.mark.dist
def test_stash_default_summation_follows_its_version_rule(runs):
    ref, _ = cc.reference(2, M_STASH, N, "sgd", cc.stash_versions(2, M_STASH, N))
    _assert_close(runs[2], ref, "sgd", 1e-6, "stash sgd")
    assert runs[2][0]["max_live"] == 2, "stage 0 runs a mini-batch on two versions"


@pytest.mark.dist
def test_prediction_changes_the_update(runs):
    a, b = runs[3][0]["params"], runs[5][0]["params"]  # 2bw vs 2bw+predict, AdamW, stage 0
    assert any(not np.allclose(a[n], b[n], rtol=1e-4) for n in a)


@pytest.mark.dist
@pytest.mark.parametrize("case", [3, 4, 5], ids=["2bw", "stash", "2bw+predict"])
def test_stale_modes_are_bitwise_deterministic(runs, case):
    first, second = runs[case], runs[case + 4]
    for r in range(2):
        for name, value in first[r]["params"].items():
            assert np.array_equal(value, second[r]["params"][name]), (
                f"rank {r} {name}: two same-seed runs differ"
            )
        assert first[r]["records"] == second[r]["records"], "losses differ between the runs"
        assert first[r]["own_params"], "the module must hold its own parameters between calls"
