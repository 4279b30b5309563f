"""Planning time of the automatic heuristic (ZB-2p, ZB-1p) at p=32, m=256; prints and writes JSON."""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_table5 import profiled_costs  # noqa: E402
from zbpipe.planning.auto import plan_zb1p, plan_zb2p  # noqa: E402

costs = profiled_costs("28.3B", (10.402, 10.248, 7.698, 0.460))
out = {}
for gen in (plan_zb2p, plan_zb1p):
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gen(32, 256, costs)
        times.append(time.perf_counter() - t0)
    out[gen.__name__] = {"min": min(times), "median": statistics.median(times), "max": max(times)}
    print(
        f"{gen.__name__} p=32 m=256: min {min(times):.2f}s median {statistics.median(times):.2f}s max {max(times):.2f}s"
    )
Path("out").mkdir(exist_ok=True)
Path("out/auto_planning_time.json").write_text(json.dumps(out, indent=1))
