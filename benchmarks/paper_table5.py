"""Replicate Table 5 of Qi et al. (ICLR 2024) in zbpipe's simulator; prints a table, writes JSON.

Costs per stage come from the paper's per-layer FLOP formulas (Table 1):
F = sbh(24h + 4s), B = sbh(24h + 8s), W = 24 sbh^2 FLOPs, run at 150 TFLOP/s; one activation
message (sbh bf16 values, 2 bytes each) crosses a link at 25 GB/s. A stage holds (L + 2) / p
layers' worth of work: the paper gives the first and last stages one layer fewer to pay for
embedding and loss, so every stage costs the same. Times are in seconds.
Memory (Appendix G): M_B = sb(34h + 5as), M_W = 32 sbh, passed in units of M_B:
``mem_f = 1, mem_b = M_W / M_B - 1, mem_w = -M_W / M_B``. ZB-1p's limit is 1F1B's peak
(p M_B), ZB-2p's twice that.

With ``--bounds`` every ZB-2p row also gets a proven lower bound on its bubble rate
(``refine(..., objective="span")``: the warm-up bound, and HiGHS's dual bound where the MILP is
small enough to try, ``--refine-seconds`` each).

Run: ``python benchmarks/paper_table5.py --bounds --out benchmarks/results/paper_table5.json``;
``--profiled`` uses the paper's measured T_F, T_B, T_W, T_comm (Table 9) instead of the formulas.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from zbpipe.planning.costs import Costs  # noqa: E402
from zbpipe.planning.loop.heuristic import plan_zb1p, plan_zb2p  # noqa: E402
from zbpipe.planning.loop.onef1b import plan_1f1b  # noqa: E402
from zbpipe.planning.loop.zbh1 import plan_zbh1  # noqa: E402
from zbpipe.planning.loop.zbh2 import plan_zbh2  # noqa: E402
from zbpipe.planning.search.milp import refine, warmup_bound  # noqa: E402
from zbpipe.planning.simulator import simulate  # noqa: E402

# Table 3 (model, layers L, heads a, hidden h, seq s, microbatch b, p) and Table 5 (m, bubble rates
# 1F1B, 1F1B-I, ZB-H1, ZB-H2, ZB-1p, ZB-2p) and Table 9 (profiled T_F, T_B, T_W, T_comm).
MODELS = {
    "1.5B": (22, 24, 2304, 1024, 6, 8),
    "6.2B": (30, 32, 4096, 1024, 3, 8),
    "14.6B": (46, 40, 5120, 1024, 1, 16),
    "28.3B": (62, 48, 6144, 1024, 1, 32),
}
TABLE5 = [
    ("1.5B", 24, (0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433), (18.522, 18.086, 9.337, 0.601)),
    ("1.5B", 32, (0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039), (18.513, 18.086, 9.331, 0.626)),
    ("1.5B", 64, (0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026), (18.546, 18.097, 9.321, 0.762)),
    ("6.2B", 24, (0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029), (29.718, 29.444, 19.927, 0.527)),
    ("6.2B", 32, (0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022), (29.802, 29.428, 19.530, 0.577)),
    ("6.2B", 64, (0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010), (29.935, 29.621, 19.388, 0.535)),
    ("14.6B", 48, (0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066), (11.347, 11.248, 8.132, 0.377)),
    ("14.6B", 64, (0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054), (11.307, 11.254, 8.101, 0.379)),
    (
        "14.6B",
        128,
        (0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028),
        (11.325, 11.308, 8.109, 0.378),
    ),
    ("28.3B", 96, (0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038), (10.419, 10.207, 7.715, 0.408)),
    (
        "28.3B",
        128,
        (0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029),
        (10.408, 10.204, 7.703, 0.408),
    ),
    (
        "28.3B",
        256,
        (0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018),
        (10.402, 10.248, 7.698, 0.460),
    ),
]
FLOPS = 150e12  # FLOP/s of one device
LINK = 25e9  # bytes/s of one point-to-point link
ACT_BYTES = 2  # bf16 activations


def flop_costs(model: str) -> Costs:
    """Per-stage costs in seconds from the paper's FLOP and activation formulas."""
    L, a, h, s, b, p = MODELS[model]
    layers = (L + 2) / p
    f, bb, w = s * b * h * (24 * h + 4 * s), s * b * h * (24 * h + 8 * s), 24 * s * b * h * h
    m_b, m_w = s * b * (34 * h + 5 * a * s), 32 * s * b * h
    return Costs(
        f=f * layers / FLOPS,
        b=bb * layers / FLOPS,
        w=w * layers / FLOPS,
        comm=s * b * h * ACT_BYTES / LINK,
        mem_f=1.0,
        mem_b=m_w / m_b - 1,
        mem_w=-m_w / m_b,
    )


def profiled_costs(model: str, prof: tuple[float, ...]) -> Costs:
    base = flop_costs(model)
    tf, tb, tw, tc = prof
    return Costs(
        f=1.0, b=tb / tf, w=tw / tf, comm=tc / tf, mem_f=1.0, mem_b=base.mem_b, mem_w=base.mem_w
    )


def zb2p_bound(p: int, m: int, costs: Costs, seconds: float, max_actions: int) -> dict:
    """A proven lower bound on ZB-2p's bubble rate for these settings (refine, span objective)."""
    plan = plan_zb2p(p, m, costs)
    limit = plan.meta["memory_limit"]
    if 3 * p * m > max_actions:  # the MILP is too large to build: the warm-up bound alone
        sim = simulate(plan, costs, limit)
        busy = sum(sim.busy.values())
        span = warmup_bound(p, m, costs.per_stage(p), limit, "span")
        return {
            "bubble_rate_bound": 1 - busy / (p * span),
            "bound_source": "warm-up",
            "milp": False,
        }
    res = refine(plan, costs, limit, time_limit=seconds, objective="span")
    info = dict(res.plan.meta["refine"])
    info.update(bubble_rate=res.bubble_rate, milp=True, solver_log=res.solver_log)
    return info


def machine() -> dict:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    import scipy

    return {
        "machine": f"{platform.platform()} {platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch": torch_version,
        "scipy": scipy.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


GENERATORS = {
    "1F1B": plan_1f1b,
    "ZB-H1": plan_zbh1,
    "ZB-H2": plan_zbh2,
    "ZB-1p": plan_zb1p,
    "ZB-2p": plan_zb2p,
}
PAPER_COLS = ("1F1B", "1F1B-I", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")


def torch_izb(p: int, m: int, costs: Costs) -> float | None:
    """torch's InterleavedZeroBubble (2 half-size chunks per rank), if the registry knows it."""
    try:
        from zbpipe import plan as plan_by_name

        pl = plan_by_name("torch:InterleavedZeroBubble", p, m)
        return simulate(pl, costs.split(2)).bubble_rate
    except Exception as exc:  # torch missing or schedule refusing these sizes
        print(
            f"  (torch:InterleavedZeroBubble p={p} m={m}: {type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/table5.json")
    ap.add_argument("--profiled", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--bounds", action="store_true", help="prove a lower bound for each ZB-2p row")
    ap.add_argument("--refine-seconds", type=float, default=60.0)
    ap.add_argument("--refine-max-actions", type=int, default=800)
    args = ap.parse_args()
    rows = []
    head = (
        f"{'model':>6} {'p':>3} {'m':>4} | "
        + " ".join(f"{c:>15}" for c in GENERATORS)
        + f" | {'torch IZB':>9}"
    )
    print(
        "bubble rate: paper / zbpipe" + (" (profiled costs)" if args.profiled else " (FLOP costs)")
    )
    print(head)
    for model, m, paper, prof in TABLE5:
        p = MODELS[model][5]
        costs = profiled_costs(model, prof) if args.profiled else flop_costs(model)
        ours, times = {}, {}
        for name, gen in GENERATORS.items():
            t0 = time.perf_counter()
            pl = gen(p, m, costs)
            times[name] = time.perf_counter() - t0
            limit = pl.meta.get("memory_limit")
            ours[name] = simulate(pl, costs, limit).bubble_rate
        izb = None if args.no_torch else torch_izb(p, m, costs)
        bound = (
            zb2p_bound(p, m, costs, args.refine_seconds, args.refine_max_actions)
            if args.bounds
            else None
        )
        pap = dict(zip(PAPER_COLS, paper))
        cells = " ".join(
            f"{pap[n.replace('-', '-')]:.4f}/{ours[n]:.4f}".rjust(15) for n in GENERATORS
        )
        print(
            f"{model:>6} {p:>3} {m:>4} | {cells} | {'-' if izb is None else f'{izb:.4f}':>9}"
            f"   (ZB-2p planned in {times['ZB-2p']:.2f}s)"
            + ("" if bound is None else f"  ZB-2p bound {bound['bubble_rate_bound']:.4f}")
        )
        rows.append(
            {
                "model": model,
                "p": p,
                "m": m,
                "paper": pap,
                "zbpipe": ours,
                "torch_InterleavedZeroBubble": izb,
                "plan_seconds": times,
                "zb2p_bound": bound,
            }
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"flops": FLOPS, "link_bytes_per_s": LINK, "activation_bytes": ACT_BYTES}
    out.write_text(
        json.dumps(
            {
                "meta": {**machine(), "command": " ".join(["python", *sys.argv])},
                "costs": "profiled (Table 9)" if args.profiled else settings,
                "profiled": args.profiled,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
