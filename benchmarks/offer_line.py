"""What the memory re-plan's log line costs when no plan within the promise beats 1F1B (issue 37).

The line (``zbpipe.schedules.memory_promise.cost_line``) then offers the schedules of the
placement that would, which plans each of them: Python on rank 0 in the middle of a V schedule's
first step. Timed here offline, as ``test_memory_promise.py`` sets it up (V-Min's bytes under the
graph engine on the 4-rank GPT of ``v_budget.py``, p = 4, m = 8), the line with every candidate
planned (``leave_out=()``, before) against the line that leaves out the schedule whose plan was
just made (after), repetitions interleaved, one thread.

Run:  PYTHONPATH=src python benchmarks/offer_line.py [--reps 15]
Writes benchmarks/results/offer_line.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import torch
    from results_io import write_result

    from zbpipe.planning import Costs, plan, simulate
    from zbpipe.schedules import memory_promise as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    p, m = 4, 8
    f, b = [0.904] + [0.855] * 6 + [1.97], [0.196] + [0.145] * 6 + [0.19]
    c = Costs(mem_f=f, mem_b=b, mem_w=[-(x + y) for x, y in zip(f, b)])
    sched = SimpleNamespace(pp_group_size=p, _n_microbatches=m, _num_stages=2 * p, layout="v")
    chosen = plan("ZBVMin", p, m, costs=c)
    t_1f1b = mp.onef1b_makespan(sched, c)
    assert simulate(chosen, c).makespan > t_1f1b  # the case where the line offers faster ones
    sides = {"before": (), "after": ("ZBVMin",)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(args.reps):
        for side in sides if rep % 2 == 0 else reversed(list(sides)):
            t0 = time.perf_counter()
            mp.offer_faster(sched, c, None, t_1f1b, leave_out=sides[side])
            times[side].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"offer: before {med['before']:.1f} ms, after {med['after']:.1f} ms (medians)")
    write_result("offer_line", {"config": {"p": p, "m": m, "reps": args.reps},
                                "median_ms": med, "times_s": times})  # fmt: skip


if __name__ == "__main__":
    main()
