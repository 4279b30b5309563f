"""What ``continuous_speed.py`` could reach: the continuous plans replayed with measured costs.

Measures, in this one process and one thread (no other rank running), the costs of one
microbatch on one stage of ``continuous_speed.py``'s model (4 x Linear(1024)+ReLU, 32 rows): F,
B (input gradient), W (weight gradient), the optimizer step (``div_`` by m and SGD, what every
mode runs after a mini-batch's last W) and one copy of the stage's weights (2bw's price per step
on a stage whose mini-batches overlap: not on the last stage, which applies each update a
mini-batch late instead; ``2bw_copy_everywhere`` replays the runtime before that change).
Then replays each mode's plan (``plan_continuous``, p = 2, the benchmark's N mini-batches per
round, warm-up and drain included) as soon as possible with those costs, charging the step (and
2bw's copy) after each mini-batch's last W on each rank, where the runtime runs it; ``comm`` is
added to every cross-rank dependency. ``2bw_plain_stream`` is 2bw's plan before issue 29's
planning change (W right after each B, PipeDream's warm-up), replayed with the same costs. The
ratio 2bw / sync is the best the real run could show if the two ranks did not slow each other
down (they share 2 cores, the memory bus, and here other sessions' processes: then sync's
bubbles are partly paid back as a faster peer or another process's time, which narrows the
real gap).

    PYTHONPATH=src python benchmarks/continuous_speed_model.py      # about 30 s

Writes ``benchmarks/results/continuous_speed_model.json``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import write_result

from zbpipe.planning.continuous.periods import ContinuousParts, plan_continuous, step_positions
from zbpipe.planning.continuous.stale_orders import minibatches_apart, stream_parts
from zbpipe.planning.core import Plan, loop_placement, make_plan


def _median_ms(fn: Any, n: int = 80) -> float:
    fn()
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(hidden: int, layers: int, rows: int, m: int) -> dict[str, float]:
    """Per-microbatch F, B, W and per-step step / copy times in ms (one thread)."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mod = nn.Sequential(*[x for _ in range(layers) for x in (nn.Linear(hidden, hidden), nn.ReLU())])
    x = torch.randn(rows, hidden, requires_grad=True)
    params = list(mod.parameters())

    def forward() -> None:
        with torch.no_grad():
            mod(x)

    def forward_b() -> None:
        torch.autograd.grad(mod(x).sum(), [x])

    # W as the deferred engine runs it: per Linear, grad_output^T @ input added into the
    # weight's gradient (a buffer kept across steps, as the runtime keeps it), bias: a row sum
    acts = [torch.randn(rows, hidden) for _ in range(layers)]
    gouts = [torch.randn(rows, hidden) for _ in range(layers)]
    wgrads = [torch.zeros(hidden, hidden) for _ in range(layers)]

    def weight_pass() -> None:
        for a, g, wg in zip(acts, gouts, wgrads):
            wg.addmm_(g.t(), a)
            g.sum(0)

    grads = [torch.randn_like(p) for p in params]
    opt = torch.optim.SGD(params, lr=1e-3)
    bufs = [torch.empty_like(p) for p in params]

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
            g.div_(m)
        opt.step()

    def copy() -> None:
        with torch.no_grad():
            for b, p in zip(bufs, params):
                b.copy_(p)

    f, fb = _median_ms(forward), _median_ms(forward_b)
    w = _median_ms(weight_pass)
    return {"f": f, "b": fb - f, "w": w, "step": _median_ms(step), "copy": _median_ms(copy)}


def plain_stream(p: int, m: int, n: int) -> Plan:
    """2bw's plan before issue 29's planning change: 1F1B with W right after B, w_r = p - 1 - r."""
    parts = stream_parts(p, m, [min(m, p - 1 - r) for r in range(p)])
    orders = ContinuousParts(*parts, m, "2bw", 0.0, "").join(n)
    meta = {"step_after": step_positions(orders, m, n)}
    return make_plan("2bw-plain", p, n * m, loop_placement(p, p), orders, **meta)


def replay(
    plan: Plan,
    cost: dict[str, float] | dict[int, dict[str, float]],
    after_step: float | dict[int, float],
    comm: float,
    idle: dict[int, float] | None = None,
) -> float:
    """Makespan of ``plan`` run as soon as possible, ``after_step`` (per rank, or the same on
    every rank) after each optimizer step. ``cost``: ``{"f": .., "b": .., "w": ..}``, or one
    such dict per rank. ``idle``, if given, gets each rank's waiting time (before its first
    action included)."""
    p = len(plan.order)
    after = after_step if isinstance(after_step, dict) else dict.fromkeys(plan.order, after_step)
    per_rank: dict[int, dict[str, float]] = {
        r: cost[r] if r in cost else cost  # type: ignore[misc]
        for r in plan.order
    }
    waited = dict.fromkeys(plan.order, 0.0)
    steps = {r: set(plan.meta["step_after"][r]) for r in plan.order}
    end: dict[tuple[str, int, int], float] = {}
    pos = dict.fromkeys(plan.order, 0)
    free = dict.fromkeys(plan.order, 0.0)
    left = sum(len(a) for a in plan.order.values())
    while left:
        moved = False
        for r, acts in plan.order.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                s, g = a.stage, a.microbatch
                dep = {
                    "F": ("F", s - 1, g) if s > 0 else None,
                    "B": ("B", s + 1, g) if s < p - 1 else None,
                    "W": ("B", s, g),
                }[a.kind]
                if dep is not None and dep not in end:
                    break
                ready = 0.0 if dep is None else end[dep] + (comm if dep[1] != s else 0.0)
                waited[r] += max(0.0, ready - free[r])
                end[(a.kind, s, g)] = max(free[r], ready) + per_rank[r][a.kind.lower()]
                free[r] = end[(a.kind, s, g)] + (after[r] if pos[r] in steps[r] else 0.0)
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError("replay stuck: the plan is inconsistent")
    if idle is not None:
        idle.update(waited)
    return max(free.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--minibatches", type=int, default=6, help="mini-batches per round")
    ap.add_argument("--comm", type=float, nargs="+", default=[0.0, 0.5], help="ms per message")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None, help="default benchmarks/results/<script name>.json")
    a = ap.parse_args()
    n = a.minibatches
    results: dict[str, Any] = {}
    cost = measure(a.hidden, a.layers, a.rows, 2)  # (the step's div_ costs the same for any m)
    print("costs, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in cost.items()))
    for m in a.m:
        rows: dict[str, Any] = {}
        for comm in a.comm:
            per = {}
            sync, stale = (plan_continuous(2, m, n_minibatches=n, mode=x) for x in ("sync", "2bw"))
            # the runtime copies where a rank's mini-batches overlap (zbpipe.continuous.versions)
            apart = {r: minibatches_apart(acts, m) for r, acts in stale.order.items()}
            copies = {r: 0.0 if apart[r] else cost["copy"] for r in stale.order}
            step = cost["step"]
            for label, plan, extra in (
                ("sync", sync, 0.0),
                ("2bw", stale, copies),
                ("2bw_copy_everywhere", stale, cost["copy"]),
                ("2bw_no_copy", stale, 0.0),
                ("2bw_plain_stream", plain_stream(2, m, n), cost["copy"]),
            ):
                after = (
                    {r: step + c for r, c in extra.items()}
                    if isinstance(extra, dict)
                    else step + extra
                )
                per[label] = replay(plan, cost, after, comm) / n
            rows[f"comm={comm:g}"] = {
                "ms_per_minibatch": per,
                **{f"ratio_{k}_to_sync": v / per["sync"] for k, v in per.items() if k != "sync"},
            }
            print(
                f"m={m} comm={comm:g}: sync {per['sync']:.2f} ms per mini-batch; 2bw / sync "
                + ", ".join(f"{k} {v / per['sync']:.3f}" for k, v in per.items() if k != "sync")
            )
        results[f"m={m}"] = rows
    config = {k: v for k, v in vars(a).items() if k != "out"}
    write_result(
        "continuous_speed_model",
        {"config": config, "costs_ms": cost, "results": results},
        path=a.out,
    )


if __name__ == "__main__":
    main()
