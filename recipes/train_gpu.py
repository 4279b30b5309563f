"""GPU pipeline training with a zbpipe schedule: under torchrun (NCCL), or on a single GPU.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER:29500 \\
        recipes/train_gpu.py --schedule ZBV          # see recipes/torchrun_gpu.sh
    python recipes/train_gpu.py --schedule ZBV       # one GPU: every stage on one rank
    python recipes/train_gpu.py --device cpu --steps 2 --hidden 32 --seq 16 --vocab 64 \\
        --heads 2 --microbatches 4 --microbatch-size 2   # the CPU smoke test (CI)

Under torchrun every process is one pipeline rank (the whole world is one pipeline: world size =
pipeline ranks). Each builds the model from the same seed, keeps the stages its schedule places
on it (ZBH1/ZBAuto: one stage per rank; ZBV: stages r and 2p-1-r), moves them to
``cuda:LOCAL_RANK`` and steps. Started without torchrun, the script is a one-rank pipeline: all
of the schedule's stages (ZBV: two chunks) on one device, handing activations and gradients
over locally (two processes cannot share one GPU for a pipeline: NCCL refuses a duplicate GPU).
The rank holding the last stage logs the loss. Replace ``build_stages`` and the synthetic
batches with your model and data loader; keep the stage count ``world * stages_per_rank``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

SCHEDULES = ("ZBV", "ZBH1", "ZBAuto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="ZBV",
        help="ZBV: 2 chunks per rank, near-zero bubble at 1F1B memory; ZBH1: 1 stage per rank, "
        "1F1B memory; ZBAuto: 1 stage per rank, twice 1F1B memory, near-zero bubble",
    )
    p.add_argument(
        "--device",
        default="cuda",
        help="without torchrun only: cuda, cuda:N or cpu (cpu: a smoke test of the script)",
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument(
        "--microbatches",
        type=int,
        default=32,
        help="microbatches per step (>= 2 x ranks keeps ZB bubbles small)",
    )
    p.add_argument("--microbatch-size", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--hidden", type=int, default=1024, help="model width")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument(
        "--blocks-per-stage", type=int, default=2, help="transformer blocks per pipeline stage"
    )
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument(
        "--profile-costs",
        action="store_true",
        help="costs='profile': measure per-stage F/B/W times on the first steps and re-plan",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="NCCL process-group timeout (a hung peer fails the job after this long)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write the last step's Chrome trace here (rank 0); draw it "
        "with: zbpipe draw --trace FILE --png out.png",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before any CUDA call, so --help works on a CPU-only machine

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    import zbpipe
    from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

    device = init_group(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cls = zbpipe.get_schedule_class(args.schedule)
        num_stages = world * cls.stages_per_rank
        cfg = TinyGPTConfig(
            vocab=args.vocab,
            hidden=args.hidden,
            seq=args.seq,
            heads=args.heads,
            blocks_per_stage=args.blocks_per_stage,
        )
        mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
        # Same seed everywhere: identical initial weights. A real model would build only its own
        # stages (e.g. on the meta device, then materialise) instead of all of them on CPU.
        modules = build_stages(cfg, num_stages, seed=0)
        stages = [PipelineStage(modules[s].to(device), s, num_stages, device) for s in mine]
        options = {"costs": "profile"} if args.profile_costs else {}
        sched = cls(stages, n_microbatches=args.microbatches, loss_fn=lm_loss, **options)
        params = [p for s in mine for p in modules[s].parameters()]
        opt = torch.optim.AdamW(params, lr=args.lr, fused=device.type == "cuda")
        has_first, has_last = 0 in mine, num_stages - 1 in mine
        if rank == 0:
            print(
                f"{cls.__name__}: {world} ranks, {num_stages} stages, "
                f"{args.microbatches} microbatches; "
                f"rank 0 holds stages {mine}",
                flush=True,
            )

        for step in range(args.steps):
            # Every rank draws the same synthetic batch; only the first/last stage ranks use it.
            ids, tgt = synthetic_batch(cfg, args.microbatches * args.microbatch_size, step)
            ids, tgt = ids.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            losses: list = []
            synchronize(device)
            t0 = time.perf_counter()
            sched.step(
                *((ids,) if has_first else ()), target=tgt if has_last else None, losses=losses
            )
            opt.step()
            synchronize(device)
            if has_last:
                loss = torch.stack(losses).mean().item()
                print(
                    f"[rank {rank}] step {step:4d}  loss {loss:.4f}  "
                    f"{(time.perf_counter() - t0) * 1e3:8.1f} ms",
                    flush=True,
                )
        if args.trace:
            trace = sched.tracer.gather()  # collective: every rank takes part
            if rank == 0:
                trace.write_chrome(args.trace)
                print(
                    f"measured bubble rate of the last step: {trace.bubble_rate:.1%}; "
                    f"trace in {args.trace}"
                )
    finally:
        dist.destroy_process_group()
    return 0


def init_group(args: argparse.Namespace) -> Any:
    """Join the job's process group; return this rank's device.

    Under torchrun: NCCL, ``cuda:LOCAL_RANK``. Otherwise a one-rank group on ``--device``
    (a pipeline stage needs a group even when every stage is local): gloo for the CPU-side
    object collectives, and NCCL for CUDA tensors should torch's stage set-up send any.
    """
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=args.timeout_s)
    if "LOCAL_RANK" in os.environ:
        device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
        torch.cuda.set_device(device)
        # device_id binds the communicator to this GPU eagerly (no guessing at first use).
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: pass --device cpu for a smoke test")
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def synchronize(device: Any) -> None:
    """Wait for the device (step times measure the work, not the launches)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    raise SystemExit(main())
