"""The orders of the equal-cost schedules, pinned as torch schedule CSVs (docs/reference/orders/).

Each file is ``plan(name, p, m, costs=Costs())`` (F = B = W = 1, comm 0) written by
``plan_to_csv``: one row per rank, torch's letters; ``ZBVPaper`` is the ZB-V paper's hand-made
order itself (``zbv_fb_order`` with its Ws), one of the candidates ``plan_zbv`` times. The
default run compares: a planner change that moves one action of these orders fails here, and
the diff of the CSV shows where. When the change is meant, rewrite the files and review their
diff in the commit:

    PYTHONPATH=src python tests/planning/test_golden_orders.py --write

The files are also checked against the closed forms the schedules promise at these costs
(1F1B's and ZB-H1's makespans, ZB-H2's and ZB-V's zero bubble, each mode's memory bound), read
back through ``plan_from_csv`` and the simulator, so a rewritten file cannot pin a wrong order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zbpipe import Costs, plan, simulate
from zbpipe.planning import plan_from_csv, plan_to_csv
from zbpipe.planning.core import Plan, make_plan, v_placement
from zbpipe.planning.v.paper_order import zbv_fb_order

GOLDEN = Path(__file__).resolve().parents[2] / "docs" / "reference" / "orders"
NAMES = ("1F1B", "ZBH1", "ZBH2", "ZB1P", "ZBV", "ZBVHalf", "ZBVPaper")
SIZES = ((2, 4), (4, 4), (4, 8), (8, 16))  # (p, m): m = p, 2p, and m = 2p at three depths
CASES = [(name, p, m) for name in NAMES for p, m in SIZES]


def golden_path(name: str, p: int, m: int) -> Path:
    return GOLDEN / f"{name.lower()}_p{p}_m{m}.csv"


def current_plan(name: str, p: int, m: int) -> Plan:
    if name == "ZBVPaper":
        order = zbv_fb_order(p, m, with_w=True)
        return make_plan(name, p, m, v_placement(p), order, layout="v")
    return plan(name, num_ranks=p, n_microbatches=m, costs=Costs())


def current_csv(name: str, p: int, m: int) -> str:
    return plan_to_csv(current_plan(name, p, m))


def _id(case: tuple[str, int, int]) -> str:
    return golden_path(*case).stem


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_plan_equals_its_golden_csv(case):
    path = golden_path(*case)
    assert path.is_file(), f"{path.name} missing: run this file with --write (see its docstring)"
    assert current_csv(*case) == path.read_text(), (
        f"{path.name}: the planner's order changed; if meant, rewrite with --write and review "
        "the CSV diff"
    )


def test_no_stray_golden_files():
    expected = {golden_path(*case).name for case in CASES}
    present = {p.name for p in GOLDEN.glob("*.csv")}
    assert present == expected, f"unexpected {present - expected}, missing {expected - present}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_golden_csv_keeps_the_schedules_promises(case):
    """The pinned order, read back from its file, against the closed forms at unit costs."""
    name, p, m = case
    loaded = plan_from_csv(golden_path(*case).read_text(), n_microbatches=m)
    r = simulate(loaded, Costs())  # also validates dependencies and completeness
    peak = max(r.peak_memory.values())
    if name == "1F1B":  # F = 1 and BW = 2 per microbatch, p - 1 warm-up steps each way
        assert r.makespan == pytest.approx(3 * (m + p - 1))
        assert r.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
        assert peak == min(p, m)
    elif name in ("ZBH1", "ZB1P"):  # the paper's m (F + B + W) + (p - 1)(F + B - W)
        assert r.makespan == pytest.approx(3 * m + p - 1)
        assert peak <= min(p, m)  # 1F1B's busiest rank
    elif name == "ZBH2":
        assert peak <= 2 * p - 1
        if m >= 2 * p - 1:  # the parallelogram
            assert r.makespan == pytest.approx(3 * m + p - 1)
            assert r.bubble_rate == pytest.approx(0.0)
    elif name in ("ZBV", "ZBVPaper"):  # 2p chunks of unit cost: 6 per microbatch on each rank
        assert loaded.layout == "v"
        assert peak <= 2 * p  # 1F1B's peak on the same model (a stage is two chunks)
        if m >= 2 * p:
            assert r.makespan == pytest.approx(6 * m + p - 1)
            assert r.bubble_rate == pytest.approx(0.0)
    else:  # ZBVHalf: (p + 2) / 2 microbatches of a two-chunk stage
        assert loaded.layout == "v"
        assert peak <= p + 2


def write() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        golden_path(*case).write_text(current_csv(*case))
    print(f"wrote {len(CASES)} files to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {sys.argv[0]} --write   (rewrites the golden CSVs; pytest compares)")
    write()
