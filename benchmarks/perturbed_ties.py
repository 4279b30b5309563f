"""Plans made for equal times, run on unequal ones: what choosing among ties by drawn costs gains.

The memory re-plan plans ZB-V, V-Half and V-Min for the measured bytes with equal F, B and W times
(none are measured in the first step), where many orders tie; ``perturbed_ties`` chooses among the
ties the one least slowed by cost sets drawn around the planned ones
(``zbpipe.planning.search.perturbed``). This script draws random cases (p in 2-4, m in 2p-4p,
each chunk's bytes after F in [0.6, 1.6] units and its change at B in [-0.3, 0.8] of that, so the
promise often forces a re-made order) and, for each, the "real" times the plan never saw (F
within 15% of 1, B 0.9-1.4 and W 0.6-1.2 times that, the model-wide factor drawn once per case
and each stage within 15% of it), and simulates under the real times:

* the generator's plan for equal times (``perturbed_ties=0``, before this option),
* the plan chosen among ties (``perturbed_ties=4``, what the re-plan now asks for),
* the plan for the real times (what measuring the times would give: the bound).

Reported: the mean, min and max ratio to the generator's plan, how many cases got faster or
slower, and the planning time of each. Pure simulation (no torch, no ranks): the planning times
are this machine's.

Run:  PYTHONPATH=src python benchmarks/perturbed_ties.py [--cases 40]
      [--schedules ZBV,ZBVHalf,ZBVMin]
Writes benchmarks/results/perturbed_ties.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any


def draw_case(rng: random.Random) -> tuple[int, int, Any, Any]:
    """``(p, m, costs with bytes and equal times, the same bytes with the "real" times)``."""
    from zbpipe.planning import Costs

    p = rng.choice([2, 3, 4])
    m = rng.choice([2 * p, 3 * p, 4 * p])
    n = 2 * p
    mem_f = [rng.uniform(0.6, 1.6) for _ in range(n)]
    mem_b = [f * rng.uniform(-0.3, 0.8) for f in mem_f]
    mem = dict(mem_f=mem_f, mem_b=mem_b, mem_w=[-(f + b) for f, b in zip(mem_f, mem_b)])
    w_factor, b_factor = rng.uniform(0.6, 1.2), rng.uniform(0.9, 1.4)
    real = Costs(
        **mem,
        f=[rng.uniform(0.85, 1.15) for _ in range(n)],
        b=[b_factor * rng.uniform(0.85, 1.15) for _ in range(n)],
        w=[w_factor * rng.uniform(0.85, 1.15) for _ in range(n)],
    )
    return p, m, Costs(**mem), real


def run(name: str, cases: int, seed: int) -> dict[str, Any]:
    from zbpipe.planning import plan, simulate

    rng = random.Random(seed)
    ratios, bounds, t_gen, t_ties, skipped = [], [], [], [], 0
    for _ in range(cases):
        p, m, equal_times, real = draw_case(rng)
        try:
            t0 = time.perf_counter()
            generator = plan(name, p, m, costs=equal_times)
            t1 = time.perf_counter()
        except ValueError:  # no plan fits the mode's budget with these bytes
            skipped += 1
            continue
        chosen = plan(name, p, m, costs=equal_times, perturbed_ties=4)
        t2 = time.perf_counter()
        bound = plan(name, p, m, costs=real)
        t_gen.append(t1 - t0)
        t_ties.append(t2 - t1)
        base = simulate(generator, real).makespan
        ratios.append(simulate(chosen, real).makespan / base)
        bounds.append(simulate(bound, real).makespan / base)
    return {
        "cases": len(ratios),
        "skipped": skipped,
        "ratio": {"mean": statistics.mean(ratios), "min": min(ratios), "max": max(ratios)},
        "faster": sum(r < 0.999 for r in ratios),
        "slower": sum(r > 1.001 for r in ratios),
        "bound_mean": statistics.mean(bounds),
        "planning_ms_generator": statistics.mean(t_gen) * 1e3,
        "planning_ms_ties": statistics.mean(t_ties) * 1e3,
        "ratios": ratios,
    }


def main() -> None:
    from results_io import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--schedules", default="ZBV,ZBVHalf,ZBVMin")
    args = ap.parse_args()
    out = {}
    for name in args.schedules.split(","):
        r = out[name] = run(name, args.cases, args.seed)
        q = r["ratio"]
        print(
            f"{name}: {r['cases']} cases ({r['skipped']} without a plan); chosen among ties / "
            f"generator's under the real times: mean {q['mean']:.4f} (min {q['min']:.3f}, max "
            f"{q['max']:.3f}), faster in {r['faster']}, slower in {r['slower']}; planned for the "
            f"real times: {r['bound_mean']:.4f}; planning {r['planning_ms_generator']:.1f} ms -> "
            f"{r['planning_ms_ties']:.1f} ms"
        )
    write_result("perturbed_ties", {"config": vars(args), "results": out})


if __name__ == "__main__":
    main()
