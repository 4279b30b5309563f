"""Train a tiny GPT with a zbpipe schedule on CPU (gloo), printing the loss every step.

Two ways to launch, same script:

    python recipes/train_cpu.py --schedule ZBV --steps 20            # spawns 2 local ranks itself
    torchrun --nproc-per-node 2 recipes/train_cpu.py --schedule ZBH1  # or let torchrun start them

Each rank builds the whole model from the same seed, keeps the stages its schedule places on it
(ZBH1: stage r on rank r; ZBV: stages r and 2p-1-r), and runs ``step()``; the rank holding the
last stage prints the mean microbatch loss. Swap ``build_stages`` for your own model cut into
``world * stages_per_rank`` modules.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

SCHEDULES = ("ZBH1", "ZBV")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="ZBV",
        help="zbpipe schedule class (ScheduleZBH1/ScheduleZBV)",
    )
    p.add_argument(
        "--ranks", type=int, default=2, help="ranks to spawn when not started by torchrun"
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--microbatch-size", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    return p.parse_args(argv)


def train(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    """One rank's training loop (process group already initialised). Returns the losses it saw."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    import zbpipe
    from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

    cls = zbpipe.get_schedule_class(args.schedule)
    num_stages = world * cls.stages_per_rank
    cfg = TinyGPTConfig(vocab=64, hidden=args.hidden, seq=args.seq, heads=2, blocks_per_stage=1)
    modules = build_stages(cfg, num_stages, seed=0)  # same seed on every rank: same initial weights
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = cls(stages, n_microbatches=args.microbatches, loss_fn=lm_loss)
    params = [p for s in mine for p in modules[s].parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr)
    has_first, has_last = 0 in mine, num_stages - 1 in mine

    seen = []
    for step in range(args.steps):
        ids, tgt = synthetic_batch(cfg, args.microbatches * args.microbatch_size, step)
        opt.zero_grad(set_to_none=True)
        losses: list = []
        t0 = time.perf_counter()
        sched.step(*((ids,) if has_first else ()), target=tgt if has_last else None, losses=losses)
        opt.step()
        if has_last:
            loss = torch.stack(losses).mean().item()
            seen.append(loss)
            print(
                f"[{args.schedule}] step {step:3d}  loss {loss:.4f}  "
                f"{(time.perf_counter() - t0) * 1e3:6.1f} ms",
                flush=True,
            )
    return seen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun: one process per rank, env:// rendezvous
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    from zbpipe.testing import run_ranks  # spawns the ranks and never hangs (timeouts)

    run_ranks(train, args.ranks, args, timeout=60.0 + 10.0 * args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
