"""Per-rank bodies of the stale-mode tests (2bw, stash, 2bw with weight prediction), and the
reference of the prediction rule, replayed on the unpipelined model in the test process."""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage

from tests.continuous import _continuous_cases as cc
from zbpipe.continuous import ScheduleContinuous
from zbpipe.testing.models import build_stages, lm_loss


def train(
    rank: int, world: int, m: int, n: int, mode: str, opt: str, correction: str | None
) -> dict:
    """n mini-batches then flush; this stage's parameters and the last stage's losses."""
    mod = build_stages(cc.CFG, world, seed=cc.SEED)[rank]
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = ScheduleContinuous(
        [stage],
        m,
        loss_fn=lm_loss,
        mode=mode,
        optimizer=lambda ps: cc.make_optimizer(opt, ps),
        correction=correction,
    )
    records = cc._feed(sched, rank, world, m, range(n))
    flushed = [(kk, [float(x) for x in ls]) for kk, ls in sched.flush()]
    return dict(
        params=cc._params(sched),
        records=records,
        flushed=flushed,
        max_live=sched.max_live_versions,
        own_params=all(type(p) is torch.nn.Parameter for p in sched.stage.submod.parameters()),
    )


def train_two_streams(rank: int, world: int, m: int, n1: int, n2: int, opt: str) -> dict:
    """2bw: n1 mini-batches, flush, n2 more on the same schedule, flush."""
    mod = build_stages(cc.CFG, world, seed=cc.SEED)[rank]
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = ScheduleContinuous(
        [stage], m, loss_fn=lm_loss, mode="2bw", optimizer=lambda ps: cc.make_optimizer(opt, ps)
    )
    cc._feed(sched, rank, world, m, range(n1))
    sched.flush()
    cc._feed(sched, rank, world, m, range(n1, n1 + n2))
    sched.flush()
    return dict(params=cc._params(sched), copies=sched.weight_copies)


def train_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    return [train(rank, world, *c) for c in cases]


def reference_predict(
    world: int, m: int, n: int, opt: str, horizon: float = 1.0
) -> list[dict[str, torch.Tensor]]:
    """2bw with weight prediction, replayed on the unpipelined model, one stage at a time.

    Each stage keeps its weights after every step, W(0), W(1), ...; mini-batch k runs (forward
    and backward) on P(max(k - 1, 0)), where P(0) = W(0) and P(v) = W(v) + h (W(v) - W(v - 1))
    (h = ``horizon``: 1 for correction="predict", 2 for "nesterov");
    its gradient, the mean over its microbatches, is then applied to the latest weights W(k).
    """
    mods = build_stages(cc.CFG, world, seed=cc.SEED)
    master = [dict(mod.named_parameters()) for mod in mods]
    opts = [cc.make_optimizer(opt, list(mod.parameters())) for mod in mods]
    weights = [[{k: v.detach().clone() for k, v in ps.items()}] for ps in master]  # W(v)

    def predicted(s: int, v: int) -> dict[str, torch.Tensor]:
        w = weights[s]
        if v == 0:
            return w[0]
        return {name: w[v][name] + horizon * (w[v][name] - w[v - 1][name]) for name in w[v]}

    for k in range(n):
        ids, tgt = cc.batch(k, m)
        acc: list[dict[str, torch.Tensor]] = [{} for _ in mods]
        versions = [predicted(s, max(k - 1, 0)) for s in range(world)]
        for x, y in zip(ids.tensor_split(m), tgt.tensor_split(m)):
            leaves = [
                {name: t.clone().requires_grad_() for name, t in versions[s].items()}
                for s in range(world)
            ]
            h = x
            for s, mod in enumerate(mods):
                h = torch.func.functional_call(mod, leaves[s], (h,))
            lm_loss(h, y).backward()
            for s in range(world):
                for name, t in leaves[s].items():
                    acc[s][name] = t.grad if name not in acc[s] else acc[s][name] + t.grad
        for s in range(world):
            for name, p in master[s].items():
                p.grad = acc[s][name] / m
            opts[s].step()
            opts[s].zero_grad(set_to_none=True)
            weights[s].append({name: p.detach().clone() for name, p in master[s].items()})
    return [{name: p.detach() for name, p in ps.items()} for ps in master]
