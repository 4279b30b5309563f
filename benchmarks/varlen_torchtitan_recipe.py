"""recipes/varlen_torchtitan_blocks.py's step times: torchtitan's llama3 debug model on packed
documents of different lengths, ZB-H1 and ZB-V, microbatches cost-ordered or in data order.

    PYTHONPATH=src python benchmarks/varlen_torchtitan_recipe.py --reps 2 --steps 12

Each repetition launches 2 gloo ranks once per (schedule, order), interleaved, and runs the
recipe's own loop (its default sizes: 1024-token rows of log-normal documents, median 48, 4
microbatches, 6 layers). Step 0 (torch's shape inference, the shape rule's first symbolic
forward) is reported apart. Every token is real: tokens/s counts them all. Not a comparison with
padding (benchmarks/varlen.py is); an example's throughput, with the order's effect beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "varlen_torchtitan_blocks.py"
CONFIGS = [("ZBH1", False), ("ZBH1", True), ("ZBV", False), ("ZBV", True)]


def _recipe() -> Any:
    name = "varlen_torchtitan_blocks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, RECIPE)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_recipe(rank: int, world: int, argv: list[str]) -> list[dict[str, float]]:
    recipe = _recipe()
    return recipe.train(rank, world, recipe.parse_args(argv))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2, help="launches per configuration")
    ap.add_argument("--steps", type=int, default=12, help="steps per launch")
    ap.add_argument("--out", default="", help="result path (default: benchmarks/results/)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from results_io import cpu_model, write_result

    from zbpipe.testing import run_ranks

    raw: dict[str, dict[str, list]] = {}
    t0 = time.perf_counter()
    for _ in range(args.reps):
        for schedule, data_order in CONFIGS:
            argv = ["--schedule", schedule, "--steps", str(args.steps)]
            argv += ["--data-order"] if data_order else []
            per_rank = run_ranks(run_recipe, 2, argv, timeout=120 + 20 * args.steps)
            (records,) = [r for r in per_rank if r]  # the last stage's rank
            key = f"{schedule}/{'data order' if data_order else 'cost order'}"
            got = raw.setdefault(key, {"first_step_s": [], "step_s": [], "loss": []})
            got["first_step_s"].append(records[0]["seconds"])
            got["step_s"].extend(r["seconds"] for r in records[1:])
            got["loss"].append([r["loss"] for r in records])
            tokens = int(records[0]["tokens"])
    results = {}
    for key, got in raw.items():
        med = statistics.median(got["step_s"])
        results[key] = {
            **got,
            "step_s_median": med,
            "step_s_min": min(got["step_s"]),
            "step_s_max": max(got["step_s"]),
            "tokens_per_s_median": tokens / med,
        }
        print(
            f"{key:16s} step {med * 1e3:6.1f} ms median ({min(got['step_s']) * 1e3:.1f}-"
            f"{max(got['step_s']) * 1e3:.1f}), {tokens / med:6.0f} real tokens/s; first step "
            f"{statistics.median(got['first_step_s']) * 1e3:.1f} ms; last loss "
            f"{got['loss'][-1][-1]:.4f}"
        )
    data = {
        "cpu": cpu_model(),
        "seconds": time.perf_counter() - t0,
        "tokens_per_step": tokens,
        "reps": args.reps,
        "steps": args.steps,
        "results": results,
    }
    write_result("varlen_torchtitan_recipe", data, path=args.out or None)


if __name__ == "__main__":
    main()
