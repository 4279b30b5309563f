"""What a pipeline action costs the host: zbpipe's runtime against torch's, where Python dominates.

One process, one thread, one rank holding the whole pipeline (every stage local, no messages),
Llama-style blocks (benchmarks/llama_blocks.py) at shapes small enough that kernels are cheap
and the host's Python is most of a step: the regime a GPU step is in when its host cannot keep
up. Thread CPU time throughout; repetitions interleaved in a rotating order.

Two modes:

* ``attribute`` (default): per schedule, the step and each action kind (F, BW, B, W: the whole
  callback the runtime runs for it), F's own module forward (``forward_one_chunk``) and the
  loss, so ``F - forward - loss`` is the runtime's bookkeeping around a forward; torch's
  ``Schedule1F1B`` timed the same way (its F: ``forward_one_chunk`` and the loss). Rows with the
  tracer off and with ``measure_memory=False`` say what those cost in a step that is not the
  first; the first step (the one ``measure_memory`` probes) is timed apart on fresh schedules.
  Then the pieces: one ``nn.Linear`` call against the deferred engine's patched Linear (F, and
  F + its backward through a store, as a fused BW through the store runs it), and the
  non-finite loss check of a step.
* ``compare --before REV``: the same step timings in child processes alternating between the
  zbpipe of git revision ``REV`` (its ``src/``, extracted to a temporary folder) and this
  checkout's, ``--pairs`` pairs; per schedule the paired ratio after/before of the medians and
  each side's ratio to torch's ``Schedule1F1B`` in the same child. ``--before-env`` and
  ``--after-env`` (``KEY=VALUE``, repeatable) set a side's environment: ``--before HEAD
  --before-env ZBPIPE_NATIVE=off --after-env ZBPIPE_NATIVE=wait`` times the Python capture
  against the native one on the same code.

    PYTHONPATH=src python benchmarks/host_overhead.py --out host_overhead_attribution
    PYTHONPATH=src python benchmarks/host_overhead.py compare --before HEAD~1 --out host_overhead
    PYTHONPATH=src python benchmarks/host_overhead.py compare --before HEAD \
        --before-env ZBPIPE_NATIVE=off --after-env ZBPIPE_NATIVE=wait --out host_overhead_native

Writes benchmarks/results/<--out>.json; docs/results/host-time.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import extract_src, short_rev  # noqa: E402

#: row -> (class, options); "torch:1F1B" is torch's Schedule1F1B. ZBV rows hold the same blocks
#: as two stages (V placement on one rank); the others one stage.
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch:1F1B": ("torch", {}),
    "1F1BMulti": ("Schedule1F1BMulti", {}),
    "1F1BMulti trace=False": ("Schedule1F1BMulti", {"trace": False}),
    "1F1BMulti measure_memory=False": ("Schedule1F1BMulti", {"measure_memory": False}),
    "1F1BMulti exact": ("Schedule1F1BMulti", {"exact": True}),
    "ZBH1": ("ScheduleZBH1", {}),
    "ZBH1 graph": ("ScheduleZBH1", {"split": "graph"}),
    "ZBV": ("ScheduleZBV", {}),
}
#: rows the compare mode times (and what the issue's targets name)
COMPARED = ("torch:1F1B", "1F1BMulti", "1F1BMulti exact", "ZBH1", "ZBH1 graph", "ZBV")


def _setup() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class Timed:
    """Thread CPU nanoseconds spent in wrapped callables, per tag, per step."""

    def __init__(self) -> None:
        self.step: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(
        self, tag: str, fn: Callable[..., Any], mb: Callable[[Any], int] | None = None
    ) -> Callable[..., Any]:
        """``fn`` timed under ``tag``; with ``mb`` (its first argument -> microbatch), also
        under ``tag mb0`` or ``tag mb>0``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                ns = time.thread_time_ns() - t
                self.step[tag] += ns
                self.calls[tag] += 1
                if mb is not None:
                    sub = f"{tag} mb0" if mb(args[0]) == 0 else f"{tag} mb>0"
                    self.step[sub] += ns
                    self.calls[sub] += 1

        return timed

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        out = (dict(self.step), dict(self.calls))
        self.step.clear()
        self.calls.clear()
        return out


def build(row: str, args: argparse.Namespace, timed: Timed | None) -> tuple[Any, list[Any]]:
    """The schedule of ``row`` on its own copy of the blocks (one stage); with ``timed``, its
    actions, forward and loss wrapped by timers."""
    import torch
    from llama_blocks import build_chunks, mse_loss
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import zbpipe

    cls_name, options = ROWS[row]
    cpu = torch.device("cpu")
    chunks = 2 if cls_name == "ScheduleZBV" else 1
    dt = torch.float32
    mods = build_chunks(args.hidden, args.blocks, chunks, seed=0, dtype=dt, device=cpu)
    stages = [PipelineStage(mod, i, chunks, cpu) for i, mod in enumerate(mods)]
    if cls_name == "torch":
        sched: Any = Schedule1F1B(stages[0], args.microbatches, loss_fn=mse_loss)
    else:
        cls = getattr(zbpipe, cls_name)
        sched = cls(stages, args.microbatches, loss_fn=mse_loss, **options)
    if timed is not None:
        for stage in stages:
            stage.forward_one_chunk = timed.wrap("forward", stage.forward_one_chunk, int)
            stage.backward_one_chunk = timed.wrap("torch backward", stage.backward_one_chunk)
        sched._maybe_compute_loss = timed.wrap("loss", sched._maybe_compute_loss)
        if cls_name != "torch":
            _time_actions(sched, timed)
    return sched, mods


def _time_actions(sched: Any, timed: Timed) -> None:
    """Time each compute action's whole call, as the action loop makes it (its binders' calls
    wrapped; the schedule binds its actions again at its next step)."""
    from zbpipe import _compat as C

    kinds = {C.FORWARD: "F", C.BACKWARD_INPUT: "B", C.BACKWARD_WEIGHT: "W"}
    kinds[C.FULL_BACKWARD] = "BW"
    binders = dict(sched.action_binders)
    for ctype, kind in kinds.items():

        def bind(s: Any, action: Any, binder: Any = binders[ctype], kind: str = kind) -> Any:
            call = binder(s, action)
            mb = action.microbatch_index
            return timed.wrap(f"action {kind}", call, lambda ctx, mb=mb: mb)

        binders[ctype] = bind
    sched.action_binders = binders  # this instance only
    sched._program = None


def _batch(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(1)
    x = torch.randn(args.microbatches, args.seq, args.hidden)
    return x, torch.randn_like(x)


def _step(sched: Any, mods: list[Any], x: Any, y: Any) -> int:
    for mod in mods:
        mod.zero_grad(set_to_none=True)
    t = time.thread_time_ns()
    sched.step(x, target=y)
    return time.thread_time_ns() - t


def step_times(
    rows: list[str], args: argparse.Namespace, timed: Timed | None = None
) -> dict[str, Any]:
    """Per row: thread ns per step over ``args.reps`` interleaved repetitions (and, with
    ``timed``, the per-step ns and calls of each timed piece)."""
    x, y = _batch(args)
    runs = {}
    for row in rows:
        runs[row] = build(row, args, timed)
        for _ in range(2):  # warm-up: shape inference, the probed first step, the allocator
            _step(*runs[row], x, y)
    if timed is not None:
        timed.take()
    steps: dict[str, list[int]] = {row: [] for row in rows}
    pieces: dict[str, list[dict[str, int]]] = {row: [] for row in rows}
    calls: dict[str, dict[str, int]] = {}
    for rep in range(args.reps):
        k = rep % len(rows)
        for row in rows[k:] + rows[:k]:
            steps[row].append(_step(*runs[row], x, y))
            if timed is not None:
                ns, n = timed.take()
                pieces[row].append(ns)
                calls[row] = n
    return {"step_ns": steps, "pieces_ns": pieces, "calls": calls}


def first_step_times(args: argparse.Namespace, reps: int) -> dict[str, list[int]]:
    """The first step() of a fresh 1F1BMulti with and without measure_memory (the probed step;
    shape inference runs in both)."""
    x, y = _batch(args)
    out: dict[str, list[int]] = {"measure_memory=True": [], "measure_memory=False": []}
    for rep in range(reps):
        order = list(out) if rep % 2 == 0 else list(reversed(out))
        for name in order:
            row = "1F1BMulti" if name.endswith("True") else "1F1BMulti measure_memory=False"
            sched, mods = build(row, args, None)
            out[name].append(_step(sched, mods, x, y))
    return out


def linear_pieces(args: argparse.Namespace, n: int = 3000) -> dict[str, float]:
    """Microseconds per call: a Linear of one block's ``qkv`` shape, plain and patched (the
    capture a schedule's steps after the first take: the output hook where zbpipe has one,
    engines/weight_capture.py; the autograd.Function on older revisions)."""
    import torch
    from torch import nn

    from zbpipe.engines.deferred import WeightGradStore
    from zbpipe.engines.linear_patch import StoreSlot, patch_linears

    def best(fn: Callable[[], Any], calls: int) -> float:
        runs = []
        for _ in range(7):
            t = time.thread_time_ns()
            for _ in range(calls):
                fn()
            runs.append((time.thread_time_ns() - t) / calls / 1e3)
        return min(runs)

    h = args.hidden
    plain = nn.Linear(h, 3 * h, bias=False)
    patched = nn.Linear(h, 3 * h, bias=False)
    slot = StoreSlot()
    patch_linears(patched, slot)
    x = torch.randn(args.seq, h, requires_grad=True)
    plain.weight.grad = torch.zeros_like(plain.weight)
    patched.weight.grad = torch.zeros_like(patched.weight)
    store = WeightGradStore()
    try:
        from zbpipe.engines.weight_capture import CaptureState

        store.capture = CaptureState(fast=True)
    except ImportError:  # a revision before the output hook
        pass
    store.immediate = True  # a fused BW through the store: each GEMM accumulated in B

    def fwd_bwd(lin: nn.Module) -> None:
        y = lin(x)
        y.backward(torch.ones_like(y))

    def in_b(lin: nn.Module) -> None:
        store.deferring = True
        fwd_bwd(lin)
        store.deferring = False

    out = {"F plain Linear": best(lambda: plain(x), n)}
    slot.store = store
    out["F patched Linear, store in slot"] = best(lambda: patched(x), n)
    out["F+B plain Linear"] = best(lambda: fwd_bwd(plain), n // 3)
    out["F+B patched Linear through the store"] = best(lambda: in_b(patched), n // 3)
    slot.store = None
    return out


def nonfinite_check(args: argparse.Namespace, n: int = 2000) -> float:
    """Microseconds of one step's non-finite loss check (``m`` scalar losses)."""
    import torch

    from zbpipe.schedules.nonfinite import NonfiniteLosses

    losses = [torch.rand(()) for _ in range(args.microbatches)]
    check = NonfiniteLosses(rank=0)
    runs = []
    for _ in range(7):
        t = time.thread_time_ns()
        for _ in range(n):
            check.record(losses)
        runs.append((time.thread_time_ns() - t) / n / 1e3)
    return min(runs)


def _median_per(values: list[dict[str, int]], tag: str, per: int) -> float | None:
    got = [v.get(tag) for v in values]
    if not any(got):
        return None
    return statistics.median(g or 0 for g in got) / per / 1e3


def attribute(args: argparse.Namespace) -> dict[str, Any]:
    rows = list(ROWS)
    timed = Timed()
    res = step_times(rows, args, timed)
    m = args.microbatches
    table: dict[str, Any] = {}
    torch_f = None
    for row in rows:
        pieces, calls = res["pieces_ns"][row], res["calls"][row]
        entry: dict[str, Any] = {"step_ms": statistics.median(res["step_ns"][row]) / 1e6}
        forward = _median_per(pieces, "forward", calls["forward"])  # per stage forward
        loss = _median_per(pieces, "loss", calls["loss"])  # per call (none off the last stage)
        if row == "torch:1F1B":
            entry["F_us"] = torch_f = (forward or 0) + (loss or 0)
            entry["BW_us"] = _median_per(pieces, "torch backward", m)
        else:
            for kind in ("F", "B", "W", "BW"):
                tag = f"action {kind}"
                if calls.get(tag):
                    entry[f"{kind}_us"] = _median_per(pieces, tag, calls[tag])
            # per F action: its module forward, and its share of the losses (one in chunks F)
            share = (loss or 0) * calls["loss"] / calls["action F"]
            entry["F_around_forward_us"] = entry["F_us"] - (forward or 0) - share
            for part in ("mb0", "mb>0"):
                tag = f"action F {part}"
                entry[f"F_{part}_us"] = _median_per(pieces, tag, calls[tag])
                entry[f"forward_{part}_us"] = _median_per(pieces, f"forward {part}", calls[tag])
        kinds = ("forward", "loss", "torch backward") if row == "torch:1F1B" else ("action",)
        outside = [
            step - sum(ns for tag, ns in p.items() if tag.startswith(kinds) and "mb" not in tag)
            for step, p in zip(res["step_ns"][row], pieces)
        ]
        entry["outside_actions_us"] = statistics.median(outside) / 1e3
        entry["forward_us"], entry["loss_us"] = forward, loss
        entry["step_ratio_to_torch"] = _paired(res["step_ns"][row], res["step_ns"]["torch:1F1B"])
        table[row] = entry
    for entry in table.values():
        entry["F_minus_torch_F_us"] = entry["F_us"] - (torch_f or 0)
    exact, multi = table["1F1BMulti exact"], table["1F1BMulti"]
    linears = 5 * args.blocks  # LlamaBlock: qkv, proj, gate, up, down
    fn_in_f = multi["forward_mb>0_us"] - exact["forward_mb>0_us"]
    derived = {
        "linears_per_F": linears,
        # a microbatch after the first: 1F1BMulti's F runs the patched Linears' capture (its BW
        # goes through the store), exact's runs plain Linears; the same forward otherwise
        "weight_capture_in_F_us": fn_in_f,
        "weight_capture_per_linear_us": fn_in_f / linears,
        "F_minus_torch_F_us": multi["F_us"] - table["torch:1F1B"]["F_us"],
        "BW_minus_torch_BW_us": multi["BW_us"] - table["torch:1F1B"]["BW_us"],
        "outside_actions_minus_torch_us": multi["outside_actions_us"]
        - table["torch:1F1B"]["outside_actions_us"],
    }
    first = first_step_times(args, args.first_reps)
    return {
        "rows": table,
        "derived": derived,
        "step_ns": res["step_ns"],
        "first_step_ms": {k: statistics.median(v) / 1e6 for k, v in first.items()},
        "first_step_ns": first,
        "linear_us": linear_pieces(args),
        "nonfinite_check_us": nonfinite_check(args),
    }


def _paired(times: list[float], base: list[float]) -> dict[str, float]:
    r = [a / b for a, b in zip(times, base, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def print_attribution(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"hidden {args.hidden}, seq {args.seq}, {args.blocks} blocks, m = {args.microbatches}: "
        "thread CPU us per action (median over repetitions)"
    )
    print(
        f"{'schedule':32} {'step ms':>8} {'vs torch':>8} {'F':>7} {'fwd':>7} {'around':>7} "
        f"{'BW':>7} {'B':>7} {'W':>7}"
    )
    for row, e in res["rows"].items():

        def f(k: str, e: dict[str, Any] = e) -> str:
            v = e.get(k)
            return f"{v:7.0f}" if isinstance(v, float) else f"{'':7}"

        print(
            f"{row:32} {e['step_ms']:8.2f} {e['step_ratio_to_torch']['median']:8.3f} {f('F_us')} "
            f"{f('forward_us')} {f('F_around_forward_us')} {f('BW_us')} {f('B_us')} {f('W_us')}"
        )
    for row, e in res["rows"].items():
        if "F_mb0_us" in e:
            print(
                f"{row:32} F mb0 {e['F_mb0_us']:6.0f} (forward {e['forward_mb0_us']:6.0f})  "
                f"F mb>0 {e['F_mb>0_us']:6.0f} (forward {e['forward_mb>0_us']:6.0f})  "
                f"outside actions {e['outside_actions_us']:6.0f} us/step"
            )
        else:
            print(f"{row:32} outside actions {e['outside_actions_us']:6.0f} us/step")
    print("derived:", {k: round(v, 1) for k, v in res["derived"].items()})
    print("first step ms:", {k: round(v, 2) for k, v in res["first_step_ms"].items()})
    print("per Linear call us:", {k: round(v, 2) for k, v in res["linear_us"].items()})
    print(f"non-finite loss check per step: {res['nonfinite_check_us']:.1f} us")


# ---------------------------------------------------------------- before/after in child processes
def child(args: argparse.Namespace) -> None:
    import zbpipe

    res = step_times(list(args.rows.split(",")), args)
    linear = linear_pieces(args)
    print(
        "RESULT "
        + json.dumps({"zbpipe": zbpipe.__file__, "step_ns": res["step_ns"], "linear_us": linear})
    )


def rerun_at(rev: str) -> None:
    """Run this command again (without ``--rev``) on the zbpipe of git revision ``rev``."""
    argv = sys.argv[1:]
    i = argv.index("--rev")
    argv = argv[:i] + argv[i + 2 :]
    with tempfile.TemporaryDirectory() as tmp:
        src = extract_src(rev, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(src), "HOST_OVERHEAD_REV": short_rev(rev)}
        subprocess.run([sys.executable, __file__, *argv], env=env, check=True)


def _env_pairs(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict (a side's environment in ``compare``)."""
    bad = [s for s in items if "=" not in s]
    if bad:
        raise SystemExit(f"host_overhead.py: expected KEY=VALUE, got {bad}")
    return dict(s.split("=", 1) for s in items)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    rev = short_rev(args.before)
    rows = args.rows.split(",")
    sides: dict[str, list[dict[str, list[int]]]] = {"before": [], "after": []}
    linear: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    side_env = {"before": _env_pairs(args.before_env), "after": _env_pairs(args.after_env)}
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {"before": extract_src(args.before, Path(tmp)), "after": ROOT / "src"}
        for pair in range(args.pairs):
            for side in ("before", "after") if pair % 2 == 0 else ("after", "before"):
                env = {**os.environ, **side_env[side], "PYTHONPATH": str(srcs[side])}
                cmd = [
                    sys.executable,
                    __file__,
                    "child",
                    "--rows",
                    ",".join(rows),
                    "--hidden",
                    str(args.hidden),
                    "--seq",
                    str(args.seq),
                    "--blocks",
                    str(args.blocks),
                    "--microbatches",
                    str(args.microbatches),
                    "--reps",
                    str(args.reps),
                ]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")][-1]
                got = json.loads(line[len("RESULT ") :])
                if not got["zbpipe"].startswith(str(srcs[side])):
                    raise RuntimeError(f"{side}: the child imported {got['zbpipe']}")
                sides[side].append(got["step_ns"])
                linear[side].append(got["linear_us"])
    med = {
        s: [{r: statistics.median(v[r]) for r in rows} for v in runs] for s, runs in sides.items()
    }
    results: dict[str, Any] = {}
    for row in rows:
        after = [p[row] for p in med["after"]]
        before = [p[row] for p in med["before"]]
        results[row] = {
            "before_step_ms": statistics.median(before) / 1e6,
            "after_step_ms": statistics.median(after) / 1e6,
            "after_over_before": _paired(after, before),
            "before_vs_torch": _paired(before, [p["torch:1F1B"] for p in med["before"]]),
            "after_vs_torch": _paired(after, [p["torch:1F1B"] for p in med["after"]]),
        }
        # each side against the torch row of its own child (the control the change cannot touch,
        # timed in the same process), then after over before, pair by pair
        rel = {s: [p[row] / p["torch:1F1B"] for p in med[s]] for s in med}
        results[row]["after_over_before_vs_torch"] = _paired(rel["after"], rel["before"])
    pieces = {
        piece: {
            "before_us": statistics.median(p[piece] for p in linear["before"]),
            "after_us": statistics.median(p[piece] for p in linear["after"]),
            "after_over_before": _paired(
                [p[piece] for p in linear["after"]], [p[piece] for p in linear["before"]]
            ),
        }
        for piece in linear["after"][0]
    }
    after_rev = short_rev("HEAD")
    return {
        "before_rev": rev,
        "after_rev": after_rev,
        "before_env": side_env["before"],
        "after_env": side_env["after"],
        "results": results,
        "linear_us": pieces,
        "step_ns": sides,
    }


def print_compare(res: dict[str, Any]) -> None:
    print(
        f"before = {res['before_rev']} {res['before_env']}, after = this checkout "
        f"{res['after_env']}; medians of per-child medians; "
        "'norm': after/before of each side's ratio to torch's 1F1B in its own child"
    )
    print(
        f"{'schedule':18} {'before ms':>9} {'after ms':>9} {'after/before (min-max)':>26} "
        f"{'vs torch before':>15} {'after':>7}"
    )
    for row, r in res["results"].items():
        q = r["after_over_before"]
        print(
            f"{row:18} {r['before_step_ms']:9.2f} {r['after_step_ms']:9.2f} "
            f"{q['median']:10.3f} ({q['min']:.3f}-{q['max']:.3f}) "
            f"{r['before_vs_torch']['median']:15.3f} {r['after_vs_torch']['median']:7.3f} "
            f"norm {r['after_over_before_vs_torch']['median']:.3f}"
        )
    for piece, r in res["linear_us"].items():
        q = r["after_over_before"]
        print(
            f"{piece:40} before {r['before_us']:6.2f} us after {r['after_us']:6.2f} us "
            f"after/before {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "mode", nargs="?", default="attribute", choices=("attribute", "compare", "child")
    )
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20, help="interleaved repetitions (per child)")
    ap.add_argument("--first-reps", type=int, default=6, help="fresh schedules for the first step")
    ap.add_argument("--before", default="HEAD", help="compare: the git revision to measure against")
    ap.add_argument("--pairs", type=int, default=8, help="compare: before/after child pairs")
    ap.add_argument("--rows", default=",".join(COMPARED), help="compare: the rows to time")
    ap.add_argument("--out", default=None, help="results file name (benchmarks/results/)")
    for side in ("before", "after"):
        ap.add_argument(
            f"--{side}-env",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"compare: set this in the {side} side's children (repeatable)",
        )
    ap.add_argument(
        "--rev", default=None, help="attribute: measure the zbpipe of this git revision instead"
    )
    args = ap.parse_args()
    if args.mode == "attribute" and args.rev is not None:
        rerun_at(args.rev)
        return
    _setup()
    if args.mode == "child":
        child(args)
        return
    from results_io import write_result

    config = {k: getattr(args, k) for k in ("hidden", "seq", "blocks", "microbatches", "reps")}
    config["ZBPIPE_NATIVE"] = os.environ.get("ZBPIPE_NATIVE", "unset")  # the weight capture
    config["zbpipe"] = os.environ.get("HOST_OVERHEAD_REV", "this checkout")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    if args.mode == "attribute":
        res = attribute(args)
        print_attribution(res, args)
    else:
        config["pairs"] = args.pairs
        res = compare(args)
        print_compare(res)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    config["loadavg_before_after"] = [load_before, load_after]
    if args.out:
        print("wrote", write_result(args.out, {"mode": args.mode, "config": config, **res}))


if __name__ == "__main__":
    main()
