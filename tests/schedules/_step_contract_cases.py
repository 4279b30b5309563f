"""Per-rank bodies of the step()-contract tests (module level so spawned processes import them).

Each runs the same model and data twice on fresh copies: once as a whole batch
(``step(x, target=y)``), once the way torch 2.14 and torchtitan 0.3's Trainer call ``step``
(``arg_mbs`` on the first stage's rank only, ``kwarg_mbs`` on every rank, ``target_mbs`` on the
last stage's rank, ``loss_kwargs``, ``return_outputs=False``).
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage

import zbpipe
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

CFG = TinyGPTConfig(tricky=True)
#: A power of two: scaling a loss by it scales every gradient exactly (no rounding), so the two
#: forms can be compared at fp32 tolerance with the scale divided out.
SCALE = 4.0


def scaled_loss(logits: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """torch passes loss_kwargs as ``loss_fn(output, target, **loss_kwargs)``."""
    return lm_loss(logits, target) * scale


def _run(rank, world, cls, m, seed, *, split: bool, options):
    mods = build_stages(CFG, world * cls.stages_per_rank, seed=seed)
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=seed)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    last = len(mods) - 1
    stages = [PipelineStage(mods[s], s, len(mods), torch.device("cpu")) for s in mine]
    sched = cls(stages, m, loss_fn=scaled_loss, **options)
    losses: list = []
    if split:
        out = sched.step(
            arg_mbs=[(x,) for x in ids.chunk(m)] if 0 in mine else None,
            kwarg_mbs=[{} for _ in range(m)],
            target_mbs=list(tgt.chunk(m)) if last in mine else None,
            losses=losses,
            loss_kwargs={"scale": SCALE},
            return_outputs=False,
        )
    else:
        out = sched.step(
            *((ids,) if 0 in mine else ()), target=tgt if last in mine else None, losses=losses
        )
    grads = {f"{s}.{n}": p.grad.clone() for s in mine for n, p in mods[s].named_parameters()}
    return grads, [x.detach() for x in losses], out


def split_equals_whole(rank, world, cases, seed=2):
    """For each ``(schedule class name, m, options)``: grads and losses of the microbatch form,
    divided by SCALE, equal the whole-batch form's. Returns the largest grad difference per case."""
    worst = []
    for name, m, options in cases:
        cls = getattr(zbpipe, name)
        g_whole, l_whole, _ = _run(rank, world, cls, m, seed, split=False, options=options)
        g_split, l_split, out = _run(rank, world, cls, m, seed, split=True, options=options)
        assert out is None, "return_outputs=False returns nothing"
        assert g_split.keys() == g_whole.keys()
        for key, g in g_whole.items():
            # Same ops on the same microbatches; only the scale differs (exact in fp32).
            torch.testing.assert_close(g_split[key] / SCALE, g, rtol=1e-6, atol=1e-7, msg=key)
        assert len(l_split) == len(l_whole)
        for a, b in zip(l_split, l_whole):
            torch.testing.assert_close(a / SCALE, b, rtol=1e-6, atol=1e-7)
        worst.append(max((g_split[k] / SCALE - g).abs().max().item() for k, g in g_whole.items()))
    return worst


def outputs_are_returned(rank, world, m=4, seed=3):
    """return_outputs=True (torch's default) with microbatches returns the merged last output."""
    cls = zbpipe.ScheduleZBH1
    mods = build_stages(CFG, world, seed=seed)
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=seed)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = cls([stage], m, loss_fn=scaled_loss)
    out = sched.step(
        arg_mbs=[(x,) for x in ids.chunk(m)] if rank == 0 else None,
        target_mbs=list(tgt.chunk(m)) if rank == world - 1 else None,
    )
    if rank != world - 1:
        return out is None
    with torch.no_grad():
        x = ids
        for mod in mods:
            x = mod(x)
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-6)
    return True


def continuous_split_equals_whole(rank, world, m=4, n=3, seed=4):
    """ScheduleContinuous: the same losses and parameters after flush from either form."""
    from zbpipe.continuous import ScheduleContinuous

    results = []
    for split in (False, True):
        mod = build_stages(CFG, world, seed=seed)[rank]
        stage = PipelineStage(mod, rank, world, torch.device("cpu"))
        sched = ScheduleContinuous(
            [stage],
            m,
            loss_fn=scaled_loss,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
        )
        records = []
        for k in range(n):
            ids, tgt = synthetic_batch(CFG, batch=2 * m, step=k, seed=seed)
            first, last = rank == 0, rank == world - 1
            if split:
                # loss_kwargs scale 1.0: the optimizer step must see the same gradients
                out = sched.step(
                    arg_mbs=[(x,) for x in ids.chunk(m)] if first else None,
                    target_mbs=list(tgt.chunk(m)) if last else None,
                    loss_kwargs={"scale": 1.0},
                )
            else:
                out = sched.step(*((ids,) if first else ()), target=tgt if last else None)
            records += out
        records += sched.flush()
        losses = [[float(x) for x in ls] for _, ls in records]
        params = {k: v.detach().clone() for k, v in mod.named_parameters()}
        results.append((losses, params))
    (l0, p0), (l1, p1) = results
    assert l0 == l1
    for k in p0:
        torch.testing.assert_close(p1[k], p0[k], rtol=0, atol=0, msg=k)
    return True
