"""Per-rank bodies of the ScheduleContinuous tests, and the references they are checked against.

The references run the whole (unpipelined) model in the test process; they share nothing with
the library but the model builder.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from zbpipe.continuous import ScheduleContinuous
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

CFG = TinyGPTConfig(tricky=True)
SEED = 5


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    raise ValueError(name)


def batch(k: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(CFG, batch=2 * m, step=k, seed=SEED)


# ---------------------------------------------------------------------------------------------
# rank side


def _schedule(
    rank: int,
    world: int,
    m: int,
    mode: str,
    opt: str,
    seed: int = SEED,
    split: str = "auto",
    exact: bool = False,
) -> ScheduleContinuous:
    mod = build_stages(CFG, world, seed=seed)[rank]
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    return ScheduleContinuous(
        [stage],
        m,
        loss_fn=lm_loss,
        mode=mode,
        optimizer=lambda ps: make_optimizer(opt, ps),
        split=split,
        exact=exact,
    )


def _feed(
    sched: ScheduleContinuous, rank: int, world: int, m: int, ks: range, pending: list | None = None
) -> list:
    records = []
    for k in ks:
        ids, tgt = batch(k, m)
        args = (ids,) if rank == 0 else ()
        out = sched.step(*args, target=tgt if rank == world - 1 else None)
        records.append((k, [(kk, [float(x) for x in ls]) for kk, ls in out]))
        if pending is not None:  # sends still held (their tensors alive) after this step
            pending.append(len(sched._sends))
    return records


def _params(sched: ScheduleContinuous) -> dict:
    # numpy: torch tensors would travel back through shared memory the exiting rank tears down
    return {n: p.detach().numpy().copy() for n, p in sched.stage.submod.named_parameters()}


def train(
    rank: int,
    world: int,
    m: int,
    n: int,
    mode: str,
    opt: str,
    split: str = "auto",
    exact: bool = False,
) -> dict:
    """n mini-batches then flush; this stage's parameters, the losses per call, live versions."""
    sched = _schedule(rank, world, m, mode, opt, split=split, exact=exact)
    pending: list[int] = []
    records = _feed(sched, rank, world, m, range(n), pending)
    flushed = [(kk, [float(x) for x in ls]) for kk, ls in sched.flush()]
    return dict(
        split=sched.split,
        params=_params(sched),
        records=records,
        flushed=flushed,
        steps=sched.minibatches_done,
        max_live=sched.max_live_versions,
        bound=sched.version_bound,
        pending_sends=pending,
        copies=sched.weight_copies,
        source=sched.parts.source,
    )


def train_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Several ``train`` runs in one process group (starting processes is the slow part)."""
    return [train(rank, world, *c) for c in cases]


def checkpoint_resume(rank: int, world: int, m: int, mode: str, opt: str) -> dict:
    """3 mini-batches, flush, save; load into fresh objects (other init); 2 more.

    Compared with an uninterrupted run.
    """
    whole = _schedule(rank, world, m, mode, opt)
    _feed(whole, rank, world, m, range(5))
    whole.flush()

    first = _schedule(rank, world, m, mode, opt)
    _feed(first, rank, world, m, range(3))
    try:
        first.state_dict()
    except RuntimeError as e:
        refused = str(e)
    else:
        raise AssertionError("state_dict() with mini-batches in flight did not raise")
    first.flush()
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    resumed = _schedule(
        rank, world, m, mode, opt, seed=SEED + 100
    )  # different init: all must come from the file
    resumed.load_state_dict(state)
    _feed(resumed, rank, world, m, range(3, 5))
    resumed.flush()
    return dict(
        whole=_params(whole),
        resumed=_params(resumed),
        refused=refused,
        done=resumed.minibatches_done,
    )


# ---------------------------------------------------------------------------------------------
# references (test process)


def reference(
    world: int,
    m: int,
    n: int,
    opt: str,
    version_of: Callable[[int, int], int],
    *,
    mods: list[nn.Module] | None = None,
    batches: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] = batch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
) -> tuple[list, list]:
    """Replay a weight-version rule on the unpipelined model, one stage's module at a time.

    ``version_of(stage, g)`` is the number of optimizer steps of ``stage`` whose result the
    forward (and so the backward) of global microbatch ``g`` uses. Mini-batch k's gradient on
    each stage is the sum of its microbatches' gradients at those weights, divided by m; each
    stage's optimizer then steps once per mini-batch, in order. Returns (per stage parameters,
    per mini-batch losses). ``mods``, ``batches(k, m)``, ``loss_fn``: another model (this
    module's TinyGPT stages by default), its mini-batches and its loss.
    """
    mods = build_stages(CFG, world, seed=SEED) if mods is None else mods
    master = [dict(mod.named_parameters()) for mod in mods]
    opts = [make_optimizer(opt, list(mod.parameters())) for mod in mods]
    snaps = [{0: {k: v.detach().clone() for k, v in ps.items()}} for ps in master]
    losses = []
    for k in range(n):
        ids, tgt = batches(k, m)
        acc = [dict() for _ in mods]
        mb_losses = []
        for j, (x, y) in enumerate(zip(ids.tensor_split(m), tgt.tensor_split(m))):
            g = k * m + j
            leaves = [
                {name: t.clone().requires_grad_() for name, t in snaps[s][version_of(s, g)].items()}
                for s in range(world)
            ]
            h = x
            for s, mod in enumerate(mods):
                h = torch.func.functional_call(mod, leaves[s], (h,))
            loss = loss_fn(h, y)
            loss.backward()
            mb_losses.append(loss.item())
            for s in range(world):
                for name, t in leaves[s].items():
                    acc[s][name] = t.grad if name not in acc[s] else acc[s][name] + t.grad
        losses.append(mb_losses)
        for s in range(world):
            for name, p in master[s].items():
                p.grad = acc[s][name] / m
            opts[s].step()
            opts[s].zero_grad(set_to_none=True)
            snaps[s][k + 1] = {name: p.detach().clone() for name, p in master[s].items()}
    return [{name: p.detach() for name, p in ps.items()} for ps in master], losses


def plain_loop(world: int, m: int, n: int, opt: str) -> list[dict[str, torch.Tensor]]:
    """The ordinary synchronous training loop on the whole model (one optimizer, mean loss)."""
    mods = build_stages(CFG, world, seed=SEED)
    model = nn.Sequential(*mods)
    o = make_optimizer(opt, list(model.parameters()))
    for k in range(n):
        ids, tgt = batch(k, m)
        loss = torch.stack(
            [lm_loss(model(x), y) for x, y in zip(ids.tensor_split(m), tgt.tensor_split(m))]
        ).mean()
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
    return [{name: p.detach() for name, p in mod.named_parameters()} for mod in mods]


def fused_loop(world: int, m: int, n: int, opt: str) -> list[dict[str, torch.Tensor]]:
    """The synchronous loop a pipeline without a split backward runs: one fused backward per
    microbatch accumulating into ``.grad``, the sum divided by m (``scale_grads``), one step.

    Runs on one thread, as every rank does: the thread count changes how CPU kernels split
    their reductions (a bias's or an embedding's gradient sums over rows), hence the bits.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mods = build_stages(CFG, world, seed=SEED)
        model = nn.Sequential(*mods)
        o = make_optimizer(opt, list(model.parameters()))
        for k in range(n):
            ids, tgt = batch(k, m)
            for x, y in zip(ids.tensor_split(m), tgt.tensor_split(m)):
                lm_loss(model(x), y).backward()
            for p in model.parameters():
                p.grad.div_(m)
            o.step()
            o.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return [{name: p.detach() for name, p in mod.named_parameters()} for mod in mods]


def stash_versions(world: int, m: int, n: int) -> Callable[[int, int], int]:
    """Weight stashing's rule replayed on the plan's order: F uses the stage's latest version.

    The version of microbatch g on stage s is the number of optimizer steps stage s has taken
    before F(s, g) in its order; a step follows the m-th W of a mini-batch.
    """
    from zbpipe.planning.continuous.periods import plan_continuous

    plan = plan_continuous(world, m, n_minibatches=n, mode="stash")
    table: dict[tuple[int, int], int] = {}
    for acts in plan.order.values():
        steps, w = 0, {}
        for a in acts:
            if a.kind == "F":
                table[a.stage, a.microbatch] = steps
            elif a.kind == "W":
                k = a.microbatch // m
                w[k] = w.get(k, 0) + 1
                if w[k] == m:
                    steps += 1
    return lambda s, g: table[s, g]


def rel_err(a, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference tensor's largest magnitude."""
    a = torch.as_tensor(a)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def train_clipped(rank: int, world: int, m: int, n: int, max_norm: float) -> dict:
    """sync with post-validated global-norm clipping (SGD with momentum)."""
    mod = build_stages(CFG, world, seed=SEED)[rank]
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = ScheduleContinuous(
        [stage],
        m,
        loss_fn=lm_loss,
        optimizer=lambda ps: make_optimizer("sgd", ps),
        post_validate={"max_norm": max_norm},
    )
    _feed(sched, rank, world, m, range(n))
    sched.flush()
    return dict(params=_params(sched), statuses=[r.status for r in sched.step_reports])


def plain_loop_clipped(
    world: int, m: int, n: int, max_norm: float
) -> list[dict[str, torch.Tensor]]:
    """The ordinary loop with torch.nn.utils.clip_grad_norm_ over the whole model before each
    step.
    """
    mods = build_stages(CFG, world, seed=SEED)
    model = nn.Sequential(*mods)
    o = make_optimizer("sgd", list(model.parameters()))
    for k in range(n):
        ids, tgt = batch(k, m)
        torch.stack(
            [lm_loss(model(x), y) for x, y in zip(ids.tensor_split(m), tgt.tensor_split(m))]
        ).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        o.step()
        o.zero_grad(set_to_none=True)
    return [{name: p.detach() for name, p in mod.named_parameters()} for mod in mods]
