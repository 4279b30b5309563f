"""Per-rank bodies of tests/integrations/test_torch_parity.py: what torch's own schedule tests do,
on zbpipe.

Each body builds its stages from seeded modules, keeps an unpipelined copy as the reference and
compares against it; module level so spawned processes can import them.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import zbpipe
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

CFG = TinyGPTConfig(tricky=True)
CPU = torch.device("cpu")
IGNORED = "positional inputs are ignored"


def _mine(cls: type, world: int, rank: int) -> list[int]:
    return sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)


def _close(got, want, what: str) -> None:
    # fp32, same ops; only the order of summing microbatches differs from the reference
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda e: f"{what}: {e}")


def _check_grads(mods, ref, mine, what: str) -> int:
    n = 0
    for s in mine:
        for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
            assert p.grad is not None, f"{what}: stage {s} {name} has no gradient"
            _close(p.grad, q.grad, f"{what}: stage {s} {name}")
            n += 1
    return n


# ------------------------------------------------------------------ eval() between training steps
def eval_train_cycles(rank, world, schedule, m, options, cycles=3):
    """eval(), train step, eval(), ... (``cycles`` train steps, an eval before and after each).

    Called the way torch code often calls it: every rank passes the batch and the target (torch
    ignores inputs off stage 0 and targets off the last stage; zbpipe warns once, then ignores
    them). After each train step the gradients equal the unpipelined model's, then SGD steps both;
    each eval returns the unpipelined model's outputs and losses and leaves gradients alone.
    """
    cls = getattr(zbpipe, schedule)
    num_stages = world * cls.stages_per_rank
    mods = build_stages(CFG, num_stages, seed=3)
    ref = copy.deepcopy(nn.Sequential(*mods))
    mine = _mine(cls, world, rank)
    sched = cls(
        [PipelineStage(mods[s], s, num_stages, CPU) for s in mine], m, loss_fn=lm_loss, **options
    )
    params = [p for s in mine for p in mods[s].parameters()]
    opt, ref_opt = torch.optim.SGD(params, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    what = f"{schedule}{options} world={world} m={m}"
    checked = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cycle in range(cycles + 1):
            ids, tgt = synthetic_batch(CFG, 2 * m, step=100 + cycle)
            before = [None if p.grad is None else p.grad.clone() for p in params]
            losses: list = []
            with torch.no_grad():
                out = sched.eval(ids, target=tgt, losses=losses)
                ref_out = ref(ids)
                ref_losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
            for p, b in zip(params, before):
                same = p.grad is b is None or (b is not None and torch.equal(p.grad, b))
                assert same, f"{what} eval {cycle} changed a gradient"
            if num_stages - 1 in mine:
                _close(out, ref_out, f"{what} eval {cycle} outputs")
                _close(torch.stack(losses), torch.stack(ref_losses), f"{what} eval {cycle} losses")
            else:
                assert out is None and not losses, f"{what}: outputs off the last stage"
            if cycle == cycles:
                break
            opt.zero_grad()
            ref_opt.zero_grad()
            ids, tgt = synthetic_batch(CFG, 2 * m, step=cycle)
            losses = []
            sched.step(ids, target=tgt, losses=losses)
            ref_losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
            (torch.stack(ref_losses).sum() / m).backward()
            checked += _check_grads(mods, ref, mine, f"{what} train {cycle}")
            if num_stages - 1 in mine:
                _close(torch.stack(losses), torch.stack(ref_losses), f"{what} train {cycle} losses")
            opt.step()
            ref_opt.step()
        # eval(x) without a target (torch's would index the missing targets): outputs, no loss
        losses = []
        with torch.no_grad():
            out = sched.eval(ids, losses=losses)
        if num_stages - 1 in mine:
            _close(out, ref_out, f"{what} eval without target")
        assert not losses, f"{what}: losses without a target"
    ignored = [w for w in caught if IGNORED in str(w.message)]
    assert len(ignored) == (0 if 0 in mine else 1), f"{what}: {[str(w.message) for w in caught]}"
    return checked


def forward_only_steps(rank, world, schedule, m, steps=3):
    """A schedule built without loss_fn steps forward-only, step after step, like torch's."""
    cls = getattr(zbpipe, schedule)
    num_stages = world * cls.stages_per_rank
    mods = build_stages(CFG, num_stages, seed=4)
    ref = nn.Sequential(*copy.deepcopy(mods))
    mine = _mine(cls, world, rank)
    sched = cls([PipelineStage(mods[s], s, num_stages, CPU) for s in mine], m)
    for step in range(steps):
        ids, _ = synthetic_batch(CFG, 2 * m, step=step)
        out = sched.step(*((ids,) if 0 in mine else ()))
        if num_stages - 1 in mine:
            with torch.no_grad():
                _close(out, ref(ids), f"{schedule} forward-only step {step}")
    assert all(p.grad is None for s in mine for p in mods[s].parameters()), schedule
    return steps


# ------------------------------------------------------------------ torch's dw_builder
class _LinearWithoutWeightGrad(torch.autograd.Function):
    """``x @ w.T + b`` whose backward gives only the input gradient and queues ``(x, grad)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.layer.chunk_queue.append((ctx.layer, x, grad))
        return grad @ weight, None, None, None


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad += g


class DwLinear(nn.Module):
    """A Linear whose weight gradient only a dw_builder runner computes (unless ``reference``)."""

    def __init__(self, width: int, queue: list) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.bias = nn.Parameter(torch.randn(width) * 0.1)
        self.chunk_queue = queue
        self.reference = False

    def forward(self, x):
        if self.reference:  # the unpipelined reference: ordinary autograd, weights included
            return F.linear(x, self.weight, self.bias)
        return _LinearWithoutWeightGrad.apply(x, self.weight, self.bias, self)

    def weight_pass(self, x, grad) -> None:
        _accumulate(self.weight, grad.T @ x)
        _accumulate(self.bias, grad.sum(0))


class DwChunk(nn.Module):
    """Two weight-deferring Linears around an ordinary Linear (its gradient comes in B)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.queue: list = []
        self.dw1, self.mid, self.dw2 = (
            DwLinear(width, self.queue),
            nn.Linear(width, width),
            DwLinear(width, self.queue),
        )

    def forward(self, x):
        return self.dw2(torch.tanh(self.mid(torch.tanh(self.dw1(x)))))

    def dw_builder(self):
        """torch calls this right after a microbatch's backward: that backward queued the last two
        entries (torch's metadata inference may have queued others before the first step)."""
        entries, self.queue[:] = self.queue[-2:], []
        return lambda: [layer.weight_pass(x, g) for layer, x, g in entries]


def _mse(out, target):
    return F.mse_loss(out, target)


def dw_builder_grads(rank, world, schedule, m, options, steps=2):
    """Stages built with dw_builder: after each step the gradients equal the reference's."""
    cls = getattr(zbpipe, schedule)
    num_stages = world * cls.stages_per_rank
    torch.manual_seed(11)
    width = 16
    mods = [DwChunk(width) for _ in range(num_stages)]
    ref = copy.deepcopy(nn.Sequential(*mods))
    for layer in ref.modules():
        if isinstance(layer, DwLinear):
            layer.reference = True
    mine = _mine(cls, world, rank)
    stages = [
        PipelineStage(mods[s], s, num_stages, CPU, dw_builder=mods[s].dw_builder) for s in mine
    ]
    sched = cls(stages, m, loss_fn=_mse, **options)
    checked = 0
    for step in range(steps):
        for mod in (*mods, ref):
            mod.zero_grad()
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * m, width, generator=gen), torch.randn(2 * m, width, generator=gen)
        sched.step(*((x,) if 0 in mine else ()), target=y if num_stages - 1 in mine else None)
        (sum(_mse(ref(a), b) for a, b in zip(x.chunk(m), y.chunk(m))) / m).backward()
        checked += _check_grads(mods, ref, mine, f"{schedule}{options} dw_builder step {step}")
    return checked


# ------------------------------------------------------------------ ScheduleContinuous
def continuous_dw_builder(rank, world, m, n=3):
    """ScheduleContinuous (sync) trains dw_builder stages like a plain SGD loop; 2bw refuses."""
    torch.manual_seed(12)
    width = 16
    mods = [DwChunk(width) for _ in range(world)]
    ref = copy.deepcopy(nn.Sequential(*mods))
    for layer in ref.modules():
        if isinstance(layer, DwLinear):
            layer.reference = True
    stage = PipelineStage(mods[rank], rank, world, CPU, dw_builder=mods[rank].dw_builder)
    try:
        zbpipe.ScheduleContinuous([stage], m, loss_fn=_mse, mode="2bw", optimizer=lambda ps: None)
    except ValueError as e:
        assert "dw_builder runs in mode='sync' only" in str(e), e
    else:
        raise AssertionError("2bw accepted a dw_builder stage")
    sched = zbpipe.ScheduleContinuous(
        [stage], m, loss_fn=_mse, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(n):
        gen = torch.Generator().manual_seed(50 + k)
        x, y = torch.randn(2 * m, width, generator=gen), torch.randn(2 * m, width, generator=gen)
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        ref_opt.zero_grad()
        (sum(_mse(ref(a), b) for a, b in zip(x.chunk(m), y.chunk(m))) / m).backward()
        ref_opt.step()
    sched.flush()
    for (name, p), (_, q) in zip(mods[rank].named_parameters(), ref[rank].named_parameters()):
        _close(p.detach(), q.detach(), f"continuous dw_builder stage {rank} {name}")
    return n


def continuous_eval_refused(rank, world):
    """ScheduleContinuous only trains: torch's eval() raises instead of training."""
    stage = PipelineStage(build_stages(TinyGPTConfig(), world)[rank], rank, world, CPU)
    sched = zbpipe.ScheduleContinuous(
        [stage], 2, loss_fn=lm_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    try:
        sched.eval()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("ScheduleContinuous.eval() ran")


CLASSES = [
    ("ScheduleZBH1", {}),
    ("ScheduleZBH2", {}),
    ("ScheduleZBAuto", {"memory_limit": "1p"}),
    ("ScheduleZBV", {}),
    ("Schedule1F1BMulti", {}),
]


def every_class(m):
    """The cases each world size runs on every class, with ``m`` microbatches."""
    return (
        [("eval_train_cycles", name, m, opts) for name, opts in CLASSES]
        + [("forward_only_steps", name, m) for name, _ in CLASSES]
        + [("dw_builder_grads", name, m, opts) for name, opts in CLASSES]
    )


def parity_cases(rank, world, cases):
    """Run ``(body name, *args)`` cases in one process group (spawning is the slow part)."""
    return [globals()[name](rank, world, *args) for name, *args in cases]


# ------------------------------------------------------------------ a missing output gradient
def output_gradient_missing(rank, world, schedule, m):
    """``output_args`` computed under no_grad: torch's metadata then says stage 0's output gets
    no gradient. zbpipe's B used to skip it silently (no weight gradients on stage 0)."""
    cls = getattr(zbpipe, schedule)
    mods = build_stages(TinyGPTConfig(), world, seed=6)
    ids, tgt = synthetic_batch(TinyGPTConfig(), 2 * m, step=6)
    x = ids.chunk(m)[0]
    with torch.no_grad():
        outs = [x]
        for mod in mods:
            outs.append(mod(outs[-1]))
    stage = PipelineStage(
        mods[rank], rank, world, CPU, input_args=(outs[rank],), output_args=(outs[rank + 1],)
    )
    sched = cls([stage], m, loss_fn=lm_loss)
    sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
    return "finished"
