"""Every gradient after one step of ten schedule cases on 2 gloo ranks, saved or compared bitwise.

A refactor that should change nothing (issue 28 moved every module) is checked with it:

    python benchmarks/grads_fingerprint.py save before.pt     # on the old commit
    python benchmarks/grads_fingerprint.py save after.pt      # on the new one
    python benchmarks/grads_fingerprint.py compare before.pt after.pt

``ZBPIPE_NATIVE=off`` and ``ZBPIPE_NATIVE=wait`` (the native weight capture, from a
schedule's second step on) compare the Python capture with the native one; each rank says
which it had loaded.

``save PATH --steps 2`` records the gradients of each case's second step instead (gradients
zeroed between): the first step of a schedule measures memory (its saved-tensor holders make
the deferred Linears take their general path) and the second runs the plan made from it, what
training runs.

The cases cover both engines, loop and V placement, every V memory mode, ZB-H1's exact mode,
ZB-H2, the automatic schedule and zbpipe's 1F1B, on the tiny GPT of ``zbpipe.testing.models``
(seeded; the same bits on the same machine and torch). Only public names are imported, so the
script runs unchanged on both sides of a move.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.pipelining import PipelineStage

import zbpipe
from zbpipe.testing import run_ranks
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

CASES = [
    ("ScheduleZBH1", 4, {}),
    ("ScheduleZBH1", 5, {"split": "graph"}),
    ("ScheduleZBH1", 4, {"exact": True}),
    ("ScheduleZBH2", 4, {}),
    ("ScheduleZBAuto", 6, {}),
    ("Schedule1F1BMulti", 4, {}),
    ("ScheduleZBV", 4, {}),
    ("ScheduleZBV", 4, {"memory": "half"}),
    ("ScheduleZBV", 4, {"memory": "min"}),
    ("ScheduleZBV", 5, {"split": "graph"}),
]


def _rank(rank: int, world: int, steps: int = 1) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, m, options in CASES:
        cls = getattr(zbpipe, name)
        cfg = TinyGPTConfig()
        n = world * cls.stages_per_rank
        mods = build_stages(cfg, n, seed=3)
        ids, tgt = synthetic_batch(cfg, batch=2 * m, step=3)
        mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
        stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
        sched = cls(stages, m, loss_fn=lm_loss, **options)
        args = (ids,) if 0 in mine else ()
        for _ in range(steps):
            for s in mine:
                mods[s].zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            sched.step(*args, target=tgt if n - 1 in mine else None, losses=losses)
        for s in mine:
            for pname, p in mods[s].named_parameters():
                out[f"{name}{options} m={m} stage {s} {pname}"] = p.grad.clone()
        out[f"{name}{options} m={m} losses"] = [loss.detach().clone() for loss in losses]
    # which capture the deferred Linears could take (ZBPIPE_NATIVE: the native one where its
    # extension is loaded, from a schedule's second step on); said, not saved, so a fingerprint
    # made with it compares with one made without
    print(f"rank {rank}: native weight capture loaded: {'zbpipe_native_capture' in sys.modules}")
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


def main(argv: list[str]) -> int:
    steps = 1
    if len(argv) == 4 and argv[0] == "save" and argv[2] == "--steps":
        steps, argv = int(argv[3]), argv[:2]
    if len(argv) == 2 and argv[0] == "save":
        ranks = run_ranks(_rank, 2, steps, timeout=300)
        torch.save(ranks, argv[1])
        print(f"saved {sum(len(r) for r in ranks)} entries to {argv[1]}")
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        old, new = torch.load(argv[1]), torch.load(argv[2])
        differ = [
            f"rank {r}: {key}"
            for r, (a, b) in enumerate(zip(old, new))
            for key in sorted(set(a) | set(b))
            if key not in a or key not in b or not _same(a[key], b[key])
        ]
        total = sum(len(r) for r in old)
        print("\n".join(differ) or f"bitwise equal: {total} entries")
        return 1 if differ else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
