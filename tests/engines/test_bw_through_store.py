"""A fused BW run through the deferred store (``StageSeam.assign``): every BW of a stage but its
first of the step is B with each Linear's weight GEMM accumulating into ``.grad`` at once.

One gloo rank holding the whole pipeline (``Schedule1F1BMulti``: all BW), m = 4, against the
same model's plain loop (``loss / m`` backward per microbatch, the scaling torch's schedules
apply). Checked: the gradients (fp32 rounding: the GEMM adds inside its blocked loop), that the
later BWs really took the store (the Linear weights' ``.grad`` is the tensor the first BW
created, added to in place), that a post-accumulate hook fires once per microbatch as in the
plain loop (its weight's GEMMs wait for W, which fires it), that a tensor hook
(``register_hook``) that doubles the gradient sees it every microbatch (such a weight is not
deferred), and the same for ``split="graph"``.
"""

import copy

import pytest
import torch
from torch import nn

from tests.schedules._losses import mse
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

M = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.GELU(),
        nn.LayerNorm(32),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 8),
    )


def _count(fired: dict, key: str) -> None:
    fired[key] += 1


def _one_rank(rank: int, world: int, split: str, hook: str | None) -> dict:
    from torch.distributed.pipelining import PipelineStage

    import zbpipe

    torch.set_num_threads(1)
    model = _model()
    ref = copy.deepcopy(model)
    x, y = torch.randn(M * 3, 16), torch.randn(M * 3, 8)
    fired = {"pipe": 0, "ref": 0}
    for net, key in ((model, "pipe"), (ref, "ref")):
        if hook == "post-accumulate":
            net[3].weight.register_post_accumulate_grad_hook(lambda p, k=key: _count(fired, k))
        elif hook == "tensor":  # changes the gradient: deferral must not skip it
            net[3].weight.register_hook(
                lambda g, k=key: fired.__setitem__(k, fired[k] + 1) or 2 * g
            )
    for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True):
        (mse(ref(xs), ys) / M).backward()

    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    sched = zbpipe.Schedule1F1BMulti([stage], M, loss_fn=mse, split=split)
    first_grads = {}
    run_bw = sched.seam.full_backward

    def remember_first(stage, mb, *args):  # the .grad tensors microbatch 0's BW created
        run_bw(stage, mb, *args)
        if mb == 0:
            first_grads.update({n: p.grad for n, p in model.named_parameters()})

    sched.seam.full_backward = remember_first
    sched.step(x, target=y)
    same_tensor = {
        n: model.get_parameter(n).grad is g for n, g in first_grads.items() if g is not None
    }
    diffs = {
        n: ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    }
    return {"diffs": diffs, "fired": fired, "same_tensor": same_tensor, "split": sched.split}


CASES = [
    ("deferred", None),
    ("deferred", "post-accumulate"),
    ("deferred", "tensor"),
    ("graph", None),
    ("graph", "tensor"),
]


def _all_cases(rank: int, world: int) -> list[dict]:
    return [_one_rank(rank, world, split, hook) for split, hook in CASES]


def test_bw_through_store_matches_the_plain_loop():
    """Every case in one process (starting one is the slow part)."""
    (results,) = run_ranks(_all_cases, 1, timeout=180)
    for (split, hook), res in zip(CASES, results, strict=True):
        case = f"split={split} hook={hook}"
        assert res["split"] == split, case
        worst = max(res["diffs"].values())
        assert worst < 1e-5, (case, res["diffs"])
        if hook:
            assert res["fired"] == {"pipe": M, "ref": M}, (case, res["fired"])
        # Linear weights: the first BW created .grad; later BWs added into that very tensor
        # (inside the GEMM with the deferred engine, AccumulateGrad's in-place add with graph)
        linear = {n: v for n, v in res["same_tensor"].items() if n in ("0.weight", "3.weight")}
        assert linear and all(linear.values()), (case, res["same_tensor"])
