"""Where ``continuous_speed.py``'s time goes: per-action timestamps of sync and 2bw, per rank.

Runs the benchmark's setup (2 gloo ranks, one thread each, 4 x Linear(1024)+ReLU per rank, 32
rows per microbatch, SGD, rounds of 6 mini-batches ending in ``flush()``), rounds of the chosen
modes interleaved, with a timer around each piece of the continuous runtime (installed on the
schedule's classes in the rank processes, so it costs two clock reads per piece):

* ``F`` / ``B`` / ``W``: an action's own time, without what is listed below;
* ``recv``: waiting for a receive (the peer has not sent yet: idle);
* ``send``: posting a send; ``opt``: ``optimizer.step()`` itself; ``step``: the rest of the
  schedule's optimizer step (gradients handed over, ``div_``, ``.grad`` reset); ``copy``: the
  weight versions' work around the step (``before_step`` / ``updated``: 2bw's one copy of the
  weights, a correction's extrapolation); the versions' per-microbatch work: ``acquire`` (the
  leaf set at F), ``install`` (the parameter slots, at F, B and W), ``grads`` (the gradient
  buffers offered at B, withdrawn at the last W, summed and recycled at the step) and
  ``release`` (at W);
* ``other``: the rest of the round (``step()``'s input split and bookkeeping, the stream
  frontier, ``flush()``'s waits, Python between actions);
* ``threads`` (CPU table only): the CPU time of the rank process's other threads (gloo's
  transport loop), from ``/proc/self/task/*/schedstat`` (Linux; nanoseconds).

For each mode and rank it prints the median over rounds of each piece, per mini-batch, and the
round's wall time per mini-batch; then the CPU time summed over the ranks (the ranks' own
threads and their other threads, and the whole process's, paired with sync's round by round).
``--dump`` keeps every round's events (per mode and rank).

Then it replays each mode's plan with those costs (``continuous_speed_model.replay``: F, B, W
per rank, the sends, bookkeeping and the rest spread over them, the step and copy after each
step), with the wall medians and with the CPU medians (what the run would take if no other
process took the cores), and 2bw's plan with sync's costs (what 2bw would take if it added no
work per action: the floor of its order). A replay close to the measured wall leaves nothing
for an ordering or communication overhead to hide in. ``--from-json`` replays a stored result.

    PYTHONPATH=src python benchmarks/continuous_speed_trace.py --m 2 --reps 8

Writes ``benchmarks/results/continuous_speed_trace.json``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

PIECES = (
    "F",
    "B",
    "W",
    "recv",
    "send",
    "acquire",
    "install",
    "grads",
    "release",
    "opt",
    "step",
    "copy",
    "other",
)
#: the versions' per-microbatch pieces (``prep`` in results stored before they were split)
PREP = ("prep", "acquire", "install", "grads", "release")


class _Clock:
    """Nested timers: each piece's time excludes the pieces timed inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # the same, in this thread's CPU time
        self.events: list[tuple[str, float, float, float]] = []  # name, start, end, own CPU
        self._stack: list[list[Any]] = []  # [name, start, children's time, start CPU, theirs]
        self.record = False

    def wrap(self, name: str, fn: Any) -> Any:
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [name, time.perf_counter(), 0.0, time.thread_time(), 0.0]
            clock._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                end, cpu_end = time.perf_counter(), time.thread_time()
                clock._stack.pop()
                spent, cpu = end - frame[1], cpu_end - frame[3]
                clock.totals[name] = clock.totals.get(name, 0.0) + spent - frame[2]
                clock.cpu[name] = clock.cpu.get(name, 0.0) + cpu - frame[4]
                if clock._stack:
                    clock._stack[-1][2] += spent
                    clock._stack[-1][4] += cpu
                if clock.record:
                    clock.events.append((name, frame[1], end, cpu - frame[4]))

        return timed


def _other_threads_cpu() -> float:
    """CPU seconds of this process's threads other than the calling one (Linux; else 0), from
    each thread's ``schedstat`` (nanoseconds)."""
    me = str(threading.get_native_id())
    total = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _instrument(clock: _Clock) -> None:
    """Timers on the continuous runtime's pieces (in this rank process only)."""
    import torch

    from zbpipe.continuous import actions
    from zbpipe.continuous.versions import ModuleSlots, WeightVersions
    from zbpipe.schedules.sends import PendingSends

    class _TimedWork:
        def __init__(self, work: Any) -> None:
            self._work = work

        def wait(self) -> Any:
            return clock.wrap("recv", self._work.wait)()

    post = actions._post
    actions._post = lambda op: _TimedWork(post(op))  # type: ignore[assignment]
    acts, wv = actions.ContinuousActions, WeightVersions
    for owner, attr, name in (
        (acts, "_forward", "F"),
        (acts, "_backward_input", "B"),
        (acts, "_backward_weight", "W"),
        (acts, "_optimizer_step", "step"),
        (wv, "updated", "copy"),
        (wv, "before_step", "copy"),
        (wv, "acquire", "acquire"),
        (wv, "prepare_grads", "grads"),
        (wv, "withdraw_offers", "grads"),
        (wv, "take_grads", "grads"),
        (wv, "recycle_grads", "grads"),
        (wv, "release", "release"),
    ):
        setattr(owner, attr, clock.wrap(name, getattr(owner, attr)))
    PendingSends.post = clock.wrap("send", PendingSends.post)  # type: ignore[method-assign]
    ModuleSlots.install = clock.wrap("install", ModuleSlots.install)  # type: ignore[method-assign]
    ModuleSlots.restore = clock.wrap("install", ModuleSlots.restore)  # type: ignore[method-assign]
    torch.optim.SGD.step = clock.wrap("opt", torch.optim.SGD.step)  # type: ignore[method-assign]


def _rank_main(rank: int, world: int, m: int, a: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from continuous_speed import _build

    clock = _Clock()
    _instrument(clock)
    names = a.modes
    runs = {name: _build(name, rank, world, m, a)["sched"] for name in names}
    torch.manual_seed(7)
    data = [
        (torch.randn(m * a.rows, a.hidden), torch.randn(m * a.rows, a.hidden))
        for _ in range(a.minibatches)
    ]

    def one_round(name: str, record: bool) -> dict[str, Any]:
        sched = runs[name]
        dist.barrier()
        clock.totals, clock.cpu = {}, {}
        clock.events = []
        clock.record = record
        t0, c0, h0 = time.perf_counter(), time.thread_time(), _other_threads_cpu()
        for x, y in data:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        sched.flush()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        helpers = _other_threads_cpu() - h0
        n = len(data)
        out = {k: clock.totals.get(k, 0.0) / n for k in PIECES if k != "other"}
        out["other"] = wall / n - sum(out.values())
        out["wall"] = wall / n
        out_cpu = {k: clock.cpu.get(k, 0.0) / n for k in PIECES if k != "other"}
        out_cpu["other"] = cpu / n - sum(out_cpu.values())
        out_cpu["wall"] = cpu / n
        out_cpu["threads"] = helpers / n
        return {
            "pieces": out,
            "cpu": out_cpu,
            "events": [(e, s - t0, t - t0, c) for e, s, t, c in clock.events] if record else [],
        }

    for name in names:
        one_round(name, False)
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(a.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            per[name].append(one_round(name, a.dump))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, per)
    return gathered if rank == 0 else None


def _costs(med: dict[str, float], m: int) -> tuple[dict[str, float], float]:
    """Per-microbatch F, B, W (the sends, bookkeeping and the rest spread over them), and what
    follows each step (the step and the copy), from one rank's medians per mini-batch."""
    extra = (med["send"] + sum(med.get(k, 0.0) for k in PREP) + med["other"]) / 3
    after = med["step"] + med.get("opt", 0.0) + med["copy"]
    return {k.lower(): (med[k] + extra) / m for k in "FBW"}, after


def replays(rows: dict[str, Any], m: int, n: int, modes: tuple[str, ...]) -> dict[str, Any]:
    """The plans replayed with the measured costs (see the module docstring)."""
    from continuous_speed_model import replay

    from zbpipe.planning.continuous.periods import plan_continuous

    out: dict[str, Any] = {}
    for key in ("median_ms", "cpu_median_ms"):
        if any(key not in rows[f"{mode}/rank{r}"] for mode in modes for r in (0, 1)):
            continue
        res: dict[str, Any] = {}
        for label, plan_mode, cost_mode in (
            *((mode, mode, mode) for mode in modes),
            *((("2bw_with_sync_costs", "2bw", "sync"),) if {"2bw", "sync"} <= set(modes) else ()),
        ):
            per = {r: _costs(rows[f"{cost_mode}/rank{r}"][key], m) for r in (0, 1)}
            idle: dict[int, float] = {}
            span = replay(
                plan_continuous(2, m, n_minibatches=n, mode=plan_mode),  # type: ignore[arg-type]
                {r: c for r, (c, _) in per.items()},
                {r: after for r, (_, after) in per.items()},
                0.0,
                idle,
            )
            res[label] = {
                "ms_per_minibatch": span / n,
                "idle_ms_per_minibatch": [idle[r] / n for r in (0, 1)],
            }
            if label in modes:
                res[label]["measured_wall_ms"] = max(
                    rows[f"{label}/rank{r}"]["median_ms"]["wall"] for r in (0, 1)
                )
        if "sync" in res:
            for r in res.values():
                r["ratio_to_sync"] = r["ms_per_minibatch"] / res["sync"]["ms_per_minibatch"]
        out["wall_costs" if key == "median_ms" else "cpu_costs"] = res
    return out


def _both_ranks(gathered: list[Any], modes: tuple[str, ...]) -> dict[str, Any]:
    """CPU time per mini-batch summed over the ranks, per piece (each round's sum, then the
    median over rounds), the ranks' own threads and their other threads apart; with sync among
    the modes, each mode's total paired with sync's round by round (rounds run interleaved)."""
    out: dict[str, Any] = {}
    keys = (*PIECES, "wall", "threads")
    for name in modes:
        n = len(gathered[0][name])
        sums = [
            {k: sum(per[name][i]["cpu"][k] for per in gathered) for k in keys} for i in range(n)
        ]
        med = {k: statistics.median(x[k] for x in sums) * 1e3 for k in keys}
        totals = [x["wall"] + x["threads"] for x in sums]
        row: dict[str, Any] = {"median_ms": med, "total_ms": statistics.median(totals) * 1e3}
        row["total_rounds_ms"] = [t * 1e3 for t in totals]
        out[name] = row
    if "sync" in out:
        base = out["sync"]["total_rounds_ms"]
        for row in out.values():
            row["total_ratio_to_sync"] = statistics.median(
                t / b for t, b in zip(row["total_rounds_ms"], base)
            )
    return out


def _print_both_ranks(m: int, both: dict[str, Any]) -> None:
    print(f"\nm={m}, CPU time summed over the ranks, ms per mini-batch (median of the rounds)")
    cols = (*PIECES, "wall", "threads")
    heads = (*PIECES, "thread", "others")
    print(f"{'mode':>8} " + " ".join(f"{k:>7}" for k in heads) + "   process  vs sync")
    for name, row in both.items():
        print(
            f"{name:>8} "
            + " ".join(f"{row['median_ms'][k]:7.2f}" for k in cols)
            + f"   {row['total_ms']:7.2f}  {row.get('total_ratio_to_sync', float('nan')):.3f}"
        )


def _print_replays(m: int, rep: dict[str, Any]) -> None:
    for which, res in rep.items():
        print(f"\nm={m}, plans replayed with the {which.replace('_', ' ')} (ms per mini-batch)")
        for label, r in res.items():
            measured = r.get("measured_wall_ms")
            print(
                f"{label:>20} {r['ms_per_minibatch']:7.2f}  idle "
                + " ".join(f"{x:5.2f}" for x in r["idle_ms_per_minibatch"])
                + f"  vs sync {r.get('ratio_to_sync', float('nan')):.3f}"
                + (f"  (measured wall {measured:.2f})" if measured is not None else "")
            )


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_result

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=8, help="interleaved rounds per mode")
    ap.add_argument("--minibatches", type=int, default=6, help="mini-batches per round")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--modes", default="sync,2bw")
    ap.add_argument("--dump", action="store_true", help="keep every round's events")
    ap.add_argument("--out", default=None)
    ap.add_argument("--from-json", default=None, help="replay a stored result instead of running")
    a = ap.parse_args()
    a.modes = tuple(a.modes.split(","))
    if a.from_json:
        with open(a.from_json) as f:
            stored = json.load(f)
        cfg = stored["config"]
        for key, rows in stored["results"].items():
            if key.startswith("m="):
                m = int(key[2:])
                rows["replay"] = replays(rows, m, cfg["minibatches"], tuple(cfg["modes"]))
                _print_replays(m, rows["replay"])
        stored["config"]["replayed_from"] = os.path.basename(a.from_json)
        write_result(
            "continuous_speed_trace",
            {"config": stored["config"], "results": stored["results"]},
            a.out,
        )
        return
    results: dict[str, Any] = {
        "loadavg_start": [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    }
    for m in a.m:
        gathered = run_ranks(_rank_main, 2, m, a, timeout=1800, pg_timeout=600)[0]
        rows: dict[str, Any] = {}
        for what, label in (("pieces", "wall time"), ("cpu", "CPU time of the rank's thread")):
            print(f"\nm={m}, {a.reps} interleaved rounds, {label}, ms per mini-batch (median)")
            cols = (*PIECES, "wall", *(("threads",) if what == "cpu" else ()))
            heads = (*PIECES, "total", *(("threads",) if what == "cpu" else ()))
            print(f"{'mode':>8} {'rank':>4} " + " ".join(f"{k:>7}" for k in heads))
            for name in a.modes:
                for r, per in enumerate(gathered):
                    rounds = per[name]
                    med = {k: statistics.median(x[what][k] for x in rounds) * 1e3 for k in cols}
                    row = rows.setdefault(f"{name}/rank{r}", {})
                    row["median_ms" if what == "pieces" else "cpu_median_ms"] = med
                    row["rounds_ms" if what == "pieces" else "cpu_rounds_ms"] = [
                        {k: v * 1e3 for k, v in x[what].items()} for x in rounds
                    ]
                    row["events"] = [x["events"] for x in rounds]
                    print(f"{name:>8} {r:>4} " + " ".join(f"{med[k]:7.2f}" for k in cols))
        rows["both_ranks"] = _both_ranks(gathered, a.modes)
        _print_both_ranks(m, rows["both_ranks"])
        rows["replay"] = replays(rows, m, a.minibatches, a.modes)
        _print_replays(m, rows["replay"])
        results[f"m={m}"] = rows
    results["loadavg_end"] = [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    config = {k: v for k, v in vars(a).items() if k != "out"}
    write_result("continuous_speed_trace", {"config": config, "results": results}, path=a.out)


if __name__ == "__main__":
    main()
