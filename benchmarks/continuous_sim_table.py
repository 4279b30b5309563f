"""The continuous schedule against flushed steps, from the simulator (the table of
docs/use/continuous.md).

For each (p, m, N mini-batches, costs) it simulates
  * ``continuous``: ``plan_continuous`` in sync mode, and in 2bw / stash mode;
  * ``zbh1_flushed``: N ZB-H1 steps with a flush between them (each step's timeline shifted by
    the previous steps' makespans; what a global clip or NaN check before every step costs);
  * ``zbh1_joined``: ZB-H1's per-rank orders of N steps joined under the sync rule, no barrier;
  * ``onef1b_flushed``: N flushed 1F1B steps.
Makespans in the cost model's time units; bubble rates by the paper's formula.

Run: ``PYTHONPATH=src python benchmarks/continuous_sim_table.py`` (a few seconds, no torch);
writes benchmarks/results/continuous_sim_table.json. Simulator only: nothing is timed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import write_result

from zbpipe.planning.continuous.periods import plan_continuous
from zbpipe.planning.core import Action, loop_placement, make_plan
from zbpipe.planning.costs import Costs
from zbpipe.planning.loop.onef1b import plan_1f1b
from zbpipe.planning.loop.zbh1 import plan_zbh1
from zbpipe.planning.metrics import bubble_rate
from zbpipe.planning.simulator import simulate

CASES = [  # (p, m, N, costs label, costs)
    (4, 8, 20, "unit", Costs()),
    (8, 16, 8, "unit", Costs()),
    (8, 16, 8, "f=1, b=1.5, w=0.5, comm=0.1", Costs(f=1, b=1.5, w=0.5, comm=0.1)),
]


def flushed(one, n: int) -> dict:
    """N copies of one step's simulated timeline, each starting when the previous one ended."""
    spans = {
        r: [
            (iv.start + k * one.makespan, iv.end + k * one.makespan) for k in range(n) for iv in ivs
        ]
        for r, ivs in one.timeline.items()
    }
    return {"makespan": n * one.makespan, "bubble_rate": bubble_rate(spans)}


def joined(p: int, m: int, n: int, costs: Costs) -> dict:
    """ZB-H1's orders of N steps joined per rank (the simulator's dependencies keep sync's rule)."""
    segment = plan_zbh1(p, m, costs=costs, exact=True).order
    orders = {
        r: [Action(a.stage, a.kind, a.microbatch + k * m) for k in range(n) for a in acts]
        for r, acts in segment.items()
    }
    r = simulate(make_plan("ZBH1xN", p, n * m, loop_placement(p, p), orders), costs)
    return {"makespan": r.makespan, "bubble_rate": r.bubble_rate}


def row(p: int, m: int, n: int, label: str, costs: Costs) -> dict:
    out: dict = {"p": p, "m": m, "N": n, "costs": label}
    for mode in ("sync", "2bw", "stash"):
        r = simulate(plan_continuous(p, m, costs, n_minibatches=n, mode=mode), costs)
        out[f"continuous_{mode}"] = {"makespan": r.makespan, "bubble_rate": r.bubble_rate}
    out["zbh1_flushed"] = flushed(simulate(plan_zbh1(p, m, costs=costs), costs), n)
    out["zbh1_joined"] = joined(p, m, n, costs)
    out["onef1b_flushed"] = flushed(simulate(plan_1f1b(p, m, costs=costs), costs), n)
    return out


def main() -> None:
    rows = [row(*case) for case in CASES]
    for r in rows:
        cells = "  ".join(
            f"{k} {v['makespan']:.1f} ({v['bubble_rate']:.3f})"
            for k, v in r.items()
            if isinstance(v, dict)
        )
        print(f"p={r['p']} m={r['m']} N={r['N']} {r['costs']}: {cells}")
    print(f"wrote {write_result('continuous_sim_table', {'rows': rows})}")


if __name__ == "__main__":
    main()
