"""Replicate Table 5 of Qi et al. (ICLR 2024) in zbpipe's simulator; prints a table, writes JSON.

Costs per stage come from the paper's per-layer FLOP formulas (Table 1):
F = sbh(24h + 4s), B = sbh(24h + 8s), W = 24 sbh^2; memory M_B = sb(34h + 5as), M_W = 32 sbh.
A stage holds (L + 2) / p layers' worth of work: the paper gives the first and last stages one
layer fewer to pay for embedding and loss, so every stage costs the same. Times are in units of
one stage's T_F; comm = 0.03 T_F (the paper's profiled T_comm / T_F is 0.02-0.04, Table 9).
Memory: F allocates M_B, B changes it by M_W - M_B, W by -M_W (Appendix G).

Run: ``python benchmarks/paper_table5.py [--out out/table5.json] [--profiled]``; ``--profiled``
uses the paper's measured T_F, T_B, T_W, T_comm (Table 9) instead of the FLOP formulas.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from zbpipe.planning.auto import plan_zb1p, plan_zb2p  # noqa: E402
from zbpipe.planning.costs import Costs  # noqa: E402
from zbpipe.planning.onef1b import plan_1f1b  # noqa: E402
from zbpipe.planning.simulator import simulate  # noqa: E402
from zbpipe.planning.zbh1 import plan_zbh1  # noqa: E402
from zbpipe.planning.zbh2 import plan_zbh2  # noqa: E402

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
COMM = 0.03  # in units of one stage's T_F


def flop_costs(model: str) -> Costs:
    """Per-stage costs from the paper's FLOP and activation formulas, T_F = 1."""
    L, a, h, s, b, p = MODELS[model]
    f, bb, w = s * b * h * (24 * h + 4 * s), s * b * h * (24 * h + 8 * s), 24 * s * b * h * h
    m_b, m_w = s * b * (34 * h + 5 * a * s), 32 * s * b * h
    return Costs(
        f=1.0, b=bb / f, w=w / f, comm=COMM, mem_f=1.0, mem_b=(m_w - m_b) / m_b, mem_w=-m_w / m_b
    )


def profiled_costs(model: str, prof: tuple[float, ...]) -> Costs:
    base = flop_costs(model)
    tf, tb, tw, tc = prof
    return Costs(
        f=1.0, b=tb / tf, w=tw / tf, comm=tc / tf, mem_f=1.0, mem_b=base.mem_b, mem_w=base.mem_w
    )


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
        from zbpipe.planning.registry import plan as plan_by_name

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
        pap = dict(zip(PAPER_COLS, paper))
        cells = " ".join(
            f"{pap[n.replace('-', '-')]:.4f}/{ours[n]:.4f}".rjust(15) for n in GENERATORS
        )
        print(
            f"{model:>6} {p:>3} {m:>4} | {cells} | {'-' if izb is None else f'{izb:.4f}':>9}"
            f"   (ZB-2p planned in {times['ZB-2p']:.2f}s)"
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
            }
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"comm": COMM, "profiled": args.profiled, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
