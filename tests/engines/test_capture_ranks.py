"""Both weight captures a user can get, on 2 real ranks over several steps.

The test suite runs with ``ZBPIPE_NATIVE=load`` (tests/conftest.py): once the ``native_capture``
fixture has built the native capture on a machine, every later rank of the suite loads it, so
the schedules' multi-rank tests exercise the native capture there and the output hook (what a
machine without a compiler runs from a schedule's second step on) nowhere. This test pins both:
``ZBPIPE_NATIVE=off`` (the output hook from the second step) and ``load`` (the native capture
where built), each for two steps of ZBH1 and ZBV, every step's gradients against the
unpipelined model's.
"""

from __future__ import annotations

import os

import torch

import zbpipe
from tests.schedules._dist_cases import CFG, reference_grads
from zbpipe.testing import run_ranks
from zbpipe.testing.models import build_stages, lm_loss, synthetic_batch


def _steps_with(rank: int, world: int, native: str, schedule: str, m: int) -> dict[str, object]:
    """Two steps of ``schedule`` under ``ZBPIPE_NATIVE=native``: the worst gradient error of
    each against the reference, and the capture the last step's Linears took."""
    from torch.distributed.pipelining import PipelineStage

    from zbpipe.engines.native import availability

    os.environ["ZBPIPE_NATIVE"] = native
    availability._SOURCE.clear()  # the process's source is read once: read it again
    cls = getattr(zbpipe, schedule)
    mods = build_stages(CFG, world * cls.stages_per_rank, seed=3)
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=3)
    ref, _ = reference_grads(mods, ids, tgt, m)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, len(mods), torch.device("cpu")) for s in mine]
    sched = cls(stages, m, loss_fn=lm_loss)
    worst = []
    for _ in range(2):  # the output hook (off) takes over at the second step
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        args = (ids,) if 0 in mine else ()
        sched.step(*args, target=tgt if len(mods) - 1 in mine else None)
        err = 0.0
        for s in mine:
            for p, q in zip(mods[s].parameters(), ref[s].parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                err = max(err, (p.grad - q.grad).abs().max().item())
        worst.append(err)
    capture = sched.seam.engine.capture
    return {"worst": worst, "native": capture.native is not None, "hook": capture.fast}


def _cases(rank: int, world: int) -> list[dict[str, object]]:
    return [
        _steps_with(rank, world, native, schedule, 4)
        for native in ("off", "load")
        for schedule in ("ScheduleZBH1", "ScheduleZBV")
    ]


def test_the_output_hook_and_the_native_capture_both_give_the_reference_grads():
    from zbpipe.engines.native import build_native

    built = build_native.target().is_built()
    for per_rank in run_ranks(_cases, 2, timeout=300):
        off_h1, off_v, load_h1, load_v = per_rank
        for r in (off_h1, off_v):  # the output hook from the second step on, never native
            assert not r["native"] and r["hook"], r
        for r in (load_h1, load_v):  # the native capture wherever it is built
            assert r["native"] == built, r
