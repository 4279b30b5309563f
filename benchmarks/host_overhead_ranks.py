"""Host-bound steps on 2 gloo ranks: zbpipe's schedules against torch's ``Schedule1F1B``.

The shapes of benchmarks/host_overhead.py (Llama-style blocks, hidden 64, seq 32, 4 blocks,
m = 8; Python is most of a step) split over two processes, one thread each: torch's
``Schedule1F1B``, ``Schedule1F1BMulti`` and ``ScheduleZBH1`` hold 2 blocks per rank, ``ScheduleZBV``
1 block per chunk (rank 0: chunks 0 and 3, rank 1: 1 and 2). Each schedule trains its own copy
of the same blocks; repetitions are interleaved in a rotating order, each step starts after a
barrier, and its time is the slower rank's wall clock (a pipeline waits, so thread time would
miss the bubbles). Reported: the median step and its ratio to torch's ``Schedule1F1B`` paired
per repetition (min-max).

Rows named ``<schedule> late-recv``, ``lead-1``, ``lead-2`` and ``all-first`` run the schedule
with each receive posted where torch's lowering puts it (just before the action that waits for
it: zbpipe's default), one or two compute actions ahead, or every receive of the step first
(zbpipe.schedules.action_loop.RECEIVE_LEAD, set while the row's program is bound).
Per rank and row (medians over the repetitions, milliseconds): ``own_step``, the rank's own
wall clock; ``busy``, the compute actions' traced spans (zbpipe's tracer; torch's stage wrapped
by ``attach_stage_tracer``), which start after their receive was waited for; in zbpipe's rows
``recv_wait`` (compute actions waiting for their receives, and for the sends those prove
complete), ``recv_post`` and ``send_post`` (posting them), ``send_wait_end`` (the sends waited
for at the step's end); ``other``, the rest (the runtime's bookkeeping; for torch everything
but its compute: torch's posting and waiting are not separated); ``busy_F``, ``busy_B``,
``busy_W``, ``busy_BW``: ``busy`` by action kind.

    PYTHONPATH=src python benchmarks/host_overhead_ranks.py --reps 30 --out host_overhead_2ranks

Writes benchmarks/results/<--out>.json; docs/results/host-time.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: row -> (class, options); "torch:1F1B" is torch's Schedule1F1B
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch:1F1B": ("torch", {}),
    "1F1BMulti": ("Schedule1F1BMulti", {}),
    "ZBH1": ("ScheduleZBH1", {}),
    "ZBV": ("ScheduleZBV", {}),
}
DEFAULT_ROWS = ("torch:1F1B", "1F1BMulti", "ZBH1", "ZBV")
#: a row name's suffix -> how far ahead receives are posted (action_loop.RECEIVE_LEAD):
#: " late-recv" where torch's lowering puts them, " lead-N" N compute actions ahead
LEADS = {" late-recv": 0, " lead-1": 1, " lead-2": 2, " all-first": None}
for _row in ("1F1BMulti", "ZBH1", "ZBV"):
    for _suffix in LEADS:
        ROWS[_row + _suffix] = ROWS[_row]


def _build(row: str, rank: int, world: int, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    import torch
    from llama_blocks import build_chunks, mse_loss
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import zbpipe

    cls_name, options = ROWS[row]
    cpu = torch.device("cpu")
    v = cls_name == "ScheduleZBV"
    n = 2 * world if v else world
    mods = build_chunks(args.hidden, args.blocks, n, seed=0, dtype=torch.float32, device=cpu)
    if cls_name == "torch":
        stage = PipelineStage(mods[rank], rank, n, cpu)
        return Schedule1F1B(stage, args.microbatches, loss_fn=mse_loss), [stage]
    cls = getattr(zbpipe, cls_name)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, n, cpu) for s in mine]
    return cls(stages, args.microbatches, loss_fn=mse_loss, **options), stages


#: what the attribution times inside zbpipe's steps: (module, attribute, part)
TIMED_PARTS = (
    ("zbpipe.schedules.planned_actions", "wait_receive", "recv_wait"),
    ("zbpipe._compat", "post_receive", "recv_post"),
    ("zbpipe.schedules.sends", "PendingSends.post", "send_post"),
    ("zbpipe.schedules.sends", "PendingSends.wait_all", "send_wait_end"),
)
PARTS = ("own_step", "busy", *(part for _, _, part in TIMED_PARTS))
#: the busy time by action kind (inside ``busy``, not added again)
KINDS = ("F", "B", "W", "BW")


class _Timers:
    """Seconds spent in each of :data:`TIMED_PARTS` (wrapped where zbpipe looks them up: a
    module global or a class attribute), per step."""

    def __init__(self) -> None:
        import importlib

        self.seconds = {part: 0.0 for _, _, part in TIMED_PARTS}
        for module, name, part in TIMED_PARTS:
            owner: Any = importlib.import_module(module)
            *path, attr = name.split(".")
            for p in path:
                owner = getattr(owner, p)
            setattr(owner, attr, self._timed(getattr(owner, attr), part))

    def _timed(self, inner: Any, part: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[part] += time.perf_counter() - t

        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        for part in self.seconds:
            self.seconds[part] = 0.0
        return out


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Long because it is the whole per-rank run: build, warm up (late rows with the lowering's
    receive placement), then the interleaved timed steps and each step's attribution."""
    import torch
    import torch.distributed as dist

    from zbpipe.observe.trace import Tracer, attach_stage_tracer
    from zbpipe.patching import patch
    from zbpipe.schedules import action_loop

    torch.set_num_threads(1)
    rows = list(args.rows)
    runs = {row: _build(row, rank, world, args) for row in rows}
    tracers = {}
    for row, (sched, stages) in runs.items():
        if row == "torch:1F1B":
            tracers[row] = Tracer(rank=rank)
            for st in stages:
                attach_stage_tracer(st, tracers[row])
        else:
            tracers[row] = sched.tracer
    timers = _Timers()
    torch.manual_seed(1)
    x = torch.randn(args.microbatches, args.seq, args.hidden)
    y = torch.randn_like(x)

    def one_step(row: str) -> tuple[float, dict[str, float]]:
        sched, stages = runs[row]
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        tracers[row].clear()
        timers.take()
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(*((x,) if first else ()), target=y if last else None)
        mine = time.perf_counter() - t0
        took = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        events = tracers[row].events
        by_kind = {f"busy_{k}": sum(e.end - e.start for e in events if e.kind == k) for k in KINDS}
        busy = sum(e.end - e.start for e in events)
        return float(took.item()), {"own_step": mine, "busy": busy, **timers.take(), **by_kind}

    for row in rows:  # warm-up: shape inference, the first step's memory probe, the allocator
        lead = [v for suffix, v in LEADS.items() if row.endswith(suffix)]
        undo = patch(action_loop, "RECEIVE_LEAD", lead[0]) if lead else None
        for _ in range(2):  # the program is bound in these steps and kept
            one_step(row)
        if undo is not None:
            undo.undo()
    times: dict[str, list[float]] = {row: [] for row in rows}
    keys = (*PARTS, *(f"busy_{k}" for k in KINDS))
    parts: dict[str, dict[str, list[float]]] = {row: {k: [] for k in keys} for row in rows}
    for rep in range(args.reps):
        k = rep % len(rows)
        for row in rows[k:] + rows[:k]:
            step, got = one_step(row)
            times[row].append(step)
            for key, v in got.items():
                parts[row][key].append(v)
    return {"step_s": times, "parts": parts}


def _paired(times: list[float], base: list[float]) -> dict[str, float]:
    r = [a / b for a, b in zip(times, base, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def _attribution(
    per_rank: list[dict[str, Any]], rows: tuple[str, ...]
) -> dict[str, dict[int, dict[str, float]]]:
    """Per row and rank, medians in ms: its own step, busy, receive waits, and the rest."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for row in rows:
        out[row] = {}
        for rank, res in enumerate(per_rank):
            p = res["parts"][row]
            timed = [sum(p[k][i] for k in PARTS[1:]) for i in range(len(p["own_step"]))]
            other = [s - t for s, t in zip(p["own_step"], timed)]
            med = {k: statistics.median(v) * 1e3 for k, v in p.items()}
            out[row][rank] = {**med, "other": statistics.median(other) * 1e3}
    return out


def add_shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The host-bound shapes (hidden 64, seq 32, 4 blocks, m = 8) as options; send_cost.py
    shares them."""
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)


def main() -> None:
    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(ap)
    ap.add_argument("--reps", type=int, default=20, help="interleaved repetitions")
    ap.add_argument(
        "--rows", default=",".join(DEFAULT_ROWS), help="rows to time (torch:1F1B first)"
    )
    ap.add_argument("--out", default=None, help="results file name (benchmarks/results/)")
    args = ap.parse_args()
    args.rows = tuple(args.rows.split(","))
    if args.rows[0] != "torch:1F1B":
        ap.error("--rows must start with torch:1F1B (the baseline)")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    per_rank = run_ranks(_rank_main, 2, args, timeout=1800)
    res = per_rank[0]
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    base = res["step_s"]["torch:1F1B"]
    table = {}
    print(
        f"2 gloo ranks, hidden {args.hidden}, seq {args.seq}, {args.blocks} blocks, "
        f"m = {args.microbatches}, {args.reps} interleaved repetitions (wall clock, slower rank)"
    )
    for row in args.rows:
        t = res["step_s"][row]
        q = _paired(t, base)
        table[row] = {"step_ms": statistics.median(t) * 1e3, "ratio_to_torch_1f1b": q}
        print(
            f"{row:12} {statistics.median(t) * 1e3:8.2f} ms  vs torch 1F1B {q['median']:.3f} "
            f"({q['min']:.3f}-{q['max']:.3f})"
        )
    attribution = _attribution(per_rank, args.rows)
    for row, ranks in attribution.items():
        print(
            f"  {row:18} "
            + "  ".join(
                f"rank {r}: " + " ".join(f"{k} {v:.2f}" for k, v in a.items())
                for r, a in ranks.items()
            )
        )
    if args.out:
        from results_io import write_result

        config = {k: getattr(args, k) for k in ("hidden", "seq", "blocks", "microbatches", "reps")}
        config["rows"] = list(args.rows)
        config["ZBPIPE_NATIVE"] = os.environ.get("ZBPIPE_NATIVE", "unset")  # the weight capture
        config["loadavg_before_after"] = [load_before, load_after]
        data = {
            "config": config,
            "rows": table,
            "attribution_ms": attribution,
            "step_s": res["step_s"],
            "parts_s": [r["parts"] for r in per_rank],
        }
        print("wrote", write_result(args.out, data))


if __name__ == "__main__":
    main()
