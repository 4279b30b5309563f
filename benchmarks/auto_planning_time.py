"""Planning time of the automatic heuristic (ZB-2p, ZB-1p) and of ZB-V at the paper's largest sizes.

Run: ``python benchmarks/auto_planning_time.py [--reps 3]``; prints min / median / max and writes
benchmarks/results/auto_planning_time.json. Time is the process's CPU time (planning is single-
threaded pure Python), so a busy machine slows the wall clock but barely this number. ZB-V's local
search stops after a wall-clock budget (``improve(max_seconds=...)``), so on a loaded machine it
searches less in the same time rather than taking longer.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_table5 import profiled_costs
from results_io import write_result

from zbpipe.planning import Costs
from zbpipe.planning.loop.heuristic import plan_zb1p, plan_zb2p
from zbpipe.planning.v.zbv import plan_zbv

COSTS_28B = profiled_costs("28.3B", (10.402, 10.248, 7.698, 0.460))  # the paper's Table 9
CASES = [  # (label, generator, p, m, costs)
    ("ZB2P 28.3B costs", plan_zb2p, 32, 128, COSTS_28B),
    ("ZB2P 28.3B costs", plan_zb2p, 32, 256, COSTS_28B),
    ("ZB1P 28.3B costs", plan_zb1p, 32, 128, COSTS_28B),
    ("ZB1P 28.3B costs", plan_zb1p, 32, 256, COSTS_28B),
    ("ZB2P unit costs", plan_zb2p, 32, 256, Costs()),
    ("ZB1P unit costs", plan_zb1p, 32, 256, Costs()),
    ("ZBV 28.3B costs (half-size chunks)", plan_zbv, 32, 128, COSTS_28B.split(2)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for label, gen, p, m, costs in CASES:
        times = []
        for _ in range(args.reps):
            t0 = time.process_time()
            gen(p, m, costs)
            times.append(time.process_time() - t0)
        row = {"plan": label, "p": p, "m": m, "cpu_seconds": times}
        row.update(min=min(times), median=statistics.median(times), max=max(times))
        rows.append(row)
        print(
            f"{label} p={p} m={m}: median {row['median']:.2f} s "
            f"(min {row['min']:.2f}, max {row['max']:.2f})"
        )
    print(
        f"wrote {write_result('auto_planning_time', {'clock': 'process CPU time', 'rows': rows})}"
    )


if __name__ == "__main__":
    main()
