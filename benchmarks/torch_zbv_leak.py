"""What torch's ScheduleZBVZeroBubble and zbpipe's ZB-V keep alive after each step (issue 19).

Run: ``PYTHONPATH=src python benchmarks/torch_zbv_leak.py [--steps 6]`` (2 gloo ranks, under a
minute on 2 shared cores); prints a table and writes benchmarks/results/torch_zbv_leak.json.

Written to show a leak in torch's ZBVZeroBubble, it showed one in zbpipe's memory meter: the
meter's saved-tensor holders kept each tensor itself, which made a reference cycle through
autograd's graph (holder -> tensor -> grad_fn -> ... -> the node that saved it -> holder), so no
graph of a split backward was ever freed once watched. With the meter fixed (it holds detached
aliases, and weakly), torch's schedule keeps nothing from step to step either.

2 ranks, V placement, 4 chunks of Linear(256)-GELU-Linear(256), 64 rows per microbatch, m = 4.
Each step is measured two ways:
  * ``SavedActivationMeter`` (begin_step / end_step): the step's own peak of the bytes held for
    backward (saved tensors, the deferred queue, pending sends: for torch's schedule its saved
    tensors and sends, not the gradients its split records for W), and the bytes still held after
    the step and a ``gc.collect()`` (per-step growth);
  * an independent count: a weak reference to every tensor saved during the step (wrapped around
    ``zbpipe.memory.saved.SavedTensors._pack``, which the meter's torch hook and zbpipe's runtime
    use), counted alive after the step and ``gc.collect()``. Of those, ``alive_input_buffers`` are
    the buffers a stage receives its inputs into (torch allocates them once and reuses them every
    step: m per stage, never growing) and ``alive_local_inputs`` the inputs the stage before it
    on the same rank handed over (V placement): torch's stage keeps those until the next step,
    zbpipe drops them after the receiving stage's backward.
The two must agree on who keeps what. Memory only: nothing here is timed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

HIDDEN, ROWS, M = 256, 64, 4


def _chunk(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _count_sends(stage, meter) -> None:
    """Count each tensor a torch stage hands to a send until its storage is freed, as zbpipe's
    stage seam does for its own schedules (torch's split keeps its recorded gradients unseen)."""
    from zbpipe.memory.saved import count_until_freed

    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        ops_of = getattr(stage, name)

        def counted(mb, _ops_of=ops_of):
            ops = _ops_of(mb)
            for op in ops:
                count_until_freed(op.tensor, meter)
            return ops

        setattr(stage, name, counted)


def _input_buffers(stages: list, handed: bool) -> set:
    """Storages of the stages' input buffers: received (``handed=False``) or handed over by the
    stage before on this rank."""
    import torch

    from zbpipe.memory.saved import storage_ptr

    local = {st.stage_index for st in stages}
    return {
        storage_ptr(info.buffer)
        for st in stages
        if (st.stage_index - 1 in local) == handed
        for infos in st.args_recv_info.values()
        for info in infos
        # torch 2.11's first stage holds placeholders for the model's inputs, with no buffer
        if isinstance(getattr(info, "buffer", None), torch.Tensor)
    }


def measure(rank: int, world: int, schedule: str, steps: int) -> list[dict]:
    """Per step on this rank: meter peak / retained / carried bytes and alive saved tensors."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    import zbpipe
    from zbpipe._compat import with_local_stage_init
    from zbpipe.memory import SavedActivationMeter
    from zbpipe.memory.saved import SavedTensors, storage_ptr

    saved_refs: list[weakref.ref] = []
    pack = SavedTensors._pack

    def counting_pack(self, t):
        if storage_ptr(t) not in self._skip:  # parameters live on by design: not activations
            saved_refs.append(weakref.ref(t))
        return pack(self, t)

    SavedTensors._pack = counting_pack  # this process only
    n_stages = 2 * world
    mine = (rank, n_stages - 1 - rank)
    stages = [PipelineStage(_chunk(s), s, n_stages, torch.device("cpu")) for s in mine]
    meter = SavedActivationMeter()
    if schedule == "torch:ZBVZeroBubble":
        for st in stages:
            meter.attach(st)  # its saved tensors
            _count_sends(st, meter)  # and, as zbpipe's seam reports them, what it sends
        # torch 2.11's own stage set-up sends to the neighbour stage on its own rank, which
        # gloo cannot: zbpipe's fix of that one-time set-up (torch's class on >= 2.13)
        sched = with_local_stage_init(ScheduleZBVZeroBubble)(stages, M, loss_fn=_loss)
    else:
        memory = {"ZBV": "zb", "ZBVHalf": "half", "ZBVMin": "min"}[schedule]
        sched = zbpipe.ScheduleZBV(stages, M, loss_fn=_loss, memory=memory)
        sched.attach_meter(meter)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M * ROWS, HIDDEN, generator=gen)
    y = torch.randn(M * ROWS, HIDDEN, generator=gen)
    rows = []
    for _ in range(steps):
        saved_refs.clear()
        meter.begin_step()
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
        gc.collect()
        s = meter.end_step()
        alive = [r() for r in saved_refs]
        alive = [t for t in alive if t is not None]
        received, handed = _input_buffers(stages, False), _input_buffers(stages, True)
        buffers = [t for t in alive if storage_ptr(t) in received]
        local_inputs = [t for t in alive if storage_ptr(t) in handed]
        rows.append(
            {
                "peak_bytes": s.peak_bytes,
                "retained_bytes": s.retained_bytes,
                "carried_bytes": s.carried_bytes,
                "saved_tensors": len(saved_refs),
                "alive_tensors": len(alive),
                "alive_bytes": sum(t.untyped_storage().nbytes() for t in alive),
                "alive_input_buffers": len(buffers),
                "alive_input_buffer_bytes": sum(t.untyped_storage().nbytes() for t in buffers),
                "alive_local_inputs": len(local_inputs),
            }
        )
    SavedTensors._pack = pack
    return rows


def main() -> None:
    from results_io import write_result

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    mib = 2**20
    out = {}
    for schedule in ("torch:ZBVZeroBubble", "ZBV"):
        per_rank = run_ranks(measure, 2, schedule, args.steps, timeout=600)
        out[schedule] = {f"rank{r}": rows for r, rows in enumerate(per_rank)}
        for r, rows in enumerate(per_rank):
            peaks = " ".join(f"{x['peak_bytes'] / mib:.2f}" for x in rows)
            grow = " ".join(f"{x['retained_bytes'] / mib:.2f}" for x in rows)
            alive = " ".join(
                f"{x['alive_tensors']}({x['alive_input_buffers']},{x['alive_local_inputs']})"
                for x in rows
            )
            print(f"{schedule:20s} rank {r}: peak MiB/step {peaks} | retained MiB/step {grow}")
            print(
                f"{'':20s}         alive saved tensors (receive buffers, local hand-offs) "
                f"after each step: {alive}"
            )
    config = {"hidden": HIDDEN, "rows": ROWS, "microbatches": M, "ranks": 2, "steps": args.steps}
    print(f"wrote {write_result('torch_zbv_leak', {'config': config, 'results': out})}")


if __name__ == "__main__":
    main()
