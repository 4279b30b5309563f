"""What the tracer's span costs per action, timed alone: this checkout's against a git revision's.

zbpipe's schedules open one :class:`~zbpipe.observe.trace.Tracer` span around every compute
action (F, B, W, BW). Here an empty ``with tracer.span(...)`` body in a loop of 1000, the loop
without the span subtracted, best of 20 loops, in child processes alternating between the
zbpipe of ``--before`` (its ``src/``, extracted to a temporary folder) and this checkout's,
``--pairs`` pairs; also a disabled tracer's span (``trace=False``) and reading 1000 recorded
events (``Tracer.events``, best of 10). Wall clock (perf_counter).

    PYTHONPATH=src python benchmarks/tracer_span.py --before main --pairs 6 --out tracer_span

Writes benchmarks/results/<--out>.json; docs/results/host-time.md quotes it.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import extract_src, short_rev  # noqa: E402


def child() -> None:
    """Time one zbpipe's span (the one on PYTHONPATH); print one RESULT line."""
    import zbpipe
    from zbpipe.observe.trace import Tracer

    def loop(tracer: Any, n: int) -> float:
        span = tracer.span
        t0 = time.perf_counter()
        for i in range(n):
            with span("F", 0, i):
                pass
        return time.perf_counter() - t0

    def empty(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            pass
        return time.perf_counter() - t0

    out: dict[str, Any] = {"zbpipe": zbpipe.__file__}
    for name, enabled in (("span_us", True), ("disabled_span_us", False)):
        tracer = Tracer(enabled=enabled)
        best = []
        for _ in range(20):
            tracer.clear()
            best.append(loop(tracer, 1000))
        base = min(empty(1000) for _ in range(20))
        out[name] = (min(best) - base) / 1000 * 1e6
        if enabled:  # reading the events builds them (lazily, after the change): best of 10
            reads = []
            for _ in range(10):
                tracer.clear()
                loop(tracer, 1000)
                t0 = time.perf_counter()
                assert len(tracer.events) == 1000
                reads.append(time.perf_counter() - t0)
            out["read_1000_events_us"] = min(reads) * 1e6
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="compare", choices=("compare", "child"))
    ap.add_argument("--before", default="HEAD", help="the git revision to measure against")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--out", default=None, help="results file name (benchmarks/results/)")
    args = ap.parse_args()
    if args.mode == "child":
        child()
        return
    sides: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {"before": extract_src(args.before, Path(tmp)), "after": ROOT / "src"}
        for pair in range(args.pairs):
            for side in ("before", "after") if pair % 2 == 0 else ("after", "before"):
                env = {**os.environ, "PYTHONPATH": str(srcs[side])}
                run = subprocess.run(
                    [sys.executable, __file__, "child"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                line = [s for s in run.stdout.splitlines() if s.startswith("RESULT ")][-1]
                got = json.loads(line[len("RESULT ") :])
                if not got["zbpipe"].startswith(str(srcs[side])):
                    raise RuntimeError(f"{side}: the child imported {got['zbpipe']}")
                sides[side].append(got)
    keys = ("span_us", "disabled_span_us", "read_1000_events_us")
    summary = {
        side: {k: statistics.median(r[k] for r in runs) for k in keys}
        for side, runs in sides.items()
    }
    for side, s in summary.items():
        print(f"{side:6} " + "  ".join(f"{k} {v:.3f}" for k, v in s.items()))
    if args.out:
        from results_io import write_result

        data = {
            "config": {
                "before": short_rev(args.before),
                "after": short_rev("HEAD"),
                "pairs": args.pairs,
            },
            "median": summary,
            "runs": sides,
        }
        print("wrote", write_result(args.out, data))


if __name__ == "__main__":
    main()
