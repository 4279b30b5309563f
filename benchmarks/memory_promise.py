"""Issue 37: every step's peak held for backward, measured by a meter that shares nothing with
zbpipe (tests/memory/_independent_meter.py: every storage any op creates, sampled between
actions), against torch's Schedule1F1B on the same model; default arguments and
costs="profile", both engines, 4 gloo ranks. The same bodies as
tests/schedules/test_memory_promise_4ranks.py, every schedule and engine.

``--checkpointed``: instead, every block under full or selective activation checkpointing (dense
and with experts), vocabulary 64, deferred engine: per schedule the re-made plan's predicted peak
against what the step after the re-plan holds (max over ranks), into
memory_promise_ac_<ranks>ranks_m<m>.json (the bodies of the test's checkpointed case).

Run:  PYTHONPATH=src:. python benchmarks/memory_promise.py [--ranks 4] [--microbatches 8]
      [--engines deferred,graph] [--modes default,profile]  (a subset: e.g. ``--engines graph``)
      [--schedules ZBVHalf,ZBVMin]  (a subset of ZBH1,ZB1P,ZBV,ZBVHalf,ZBVMin; all by default)
      [--ac full|selective]  (every block checkpointed, vocabulary 64, torch 1F1B's too)
``--engines`` also selects the engines of ``--checkpointed`` (both by default).
Writes benchmarks/results/memory_promise_<ranks>ranks_m<m>.json: per run, per step, the peak
per rank in bytes and the max over ranks divided by torch 1F1B's max (V-Half and V-Min also by
their formula, (p + 2) / 2 and (p + 4) / 3 microbatches of the p-stage model's stage 0, from
torch 1F1B's rank 0, which holds min(p, m) of them). Memory does not depend on speed: 4 ranks on
2 cores measure it honestly (slowly).

V-Half and V-Min are also divided by the budget zbpipe promises and plans for
(:func:`zbpipe.planning.yardsticks.v_budget` of the bytes its probe measured in the first step,
the schedule's ``memory_costs`` and ``memory_unit_bytes``, ``measured_costs`` with
``costs="profile"``): the formula's factor times what chunks 0 and 1 hold after F, plus what one
backward there holds beyond F (``mem_b``: the graph engine's recorded boundary gradients, kept
from B to W). Both ratios are stored per step (``vs_formula``, ``vs_budget``) with the bytes.
"""

from __future__ import annotations

import argparse

SCHEDULES = ("ZBH1", "ZB1P", "ZBV", "ZBVHalf", "ZBVMin")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--checkpointed", action="store_true")
    ap.add_argument("--engines", default="deferred,graph", help="comma-separated splits to run")
    ap.add_argument(
        "--ac",
        choices=("", "full", "selective"),
        default="",
        help="every block checkpointed (vocabulary 64), torch 1F1B's too",
    )
    ap.add_argument("--modes", default="default,profile", help="comma-separated: default,profile")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset")
    args = ap.parse_args()
    if args.checkpointed:
        checkpointed(args.ranks, args.microbatches, args.out, args.engines.split(","))
        return
    from results_io import write_result
    from tests.schedules import _memory_promise_cases as cases

    from zbpipe.testing import run_ranks

    p, m = args.ranks, args.microbatches
    runs = [(n, e, mode) for mode in args.modes.split(",") for e in args.engines.split(",")
            for n in args.schedules.split(",")]  # fmt: skip
    build_kw = {"ac": args.ac, "vocab": 64} if args.ac else {}
    per_rank = run_ranks(rank_rows, p, m, runs, build_kw, timeout=6000, pg_timeout=900)
    torch_steps = [[per_rank[r]["torch"][i] for r in range(p)] for i in range(2)]
    base = max(max(s) for s in torch_steps)
    stage0 = torch_steps[-1][0] / min(p, m)
    formula = {"ZBVHalf": (p + 2) / 2 * stage0, "ZBVMin": (p + 4) / 3 * stage0}
    rows = []
    print(f"torch 1F1B: {'/'.join(f'{b / 2**20:.3f}' for b in torch_steps[-1])} MiB")
    for run in runs:
        steps = [[per_rank[r][run][i] for r in range(p)] for i in range(len(per_rank[0][run]))]
        row = {
            "schedule": run[0], "engine": run[1], "mode": run[2], "peak_bytes": steps,
            "vs_torch_1f1b": [max(s) / base for s in steps],
        }  # fmt: skip
        if run[0] in formula:
            row["vs_formula"] = [max(s) / formula[run[0]] for s in steps]
            budget = per_rank[0]["budgets"][run]
            if budget is not None:
                # the probe's forward part against the same part from the independent meter
                budget["forward_vs_formula"] = budget["forward_bytes"] / formula[run[0]]
                row["budget"] = budget
                row["vs_budget"] = [max(s) / budget["budget_bytes"] for s in steps]
        rows.append(row)
        vf = " ".join(f"{x:.3f}" for x in row.get("vs_formula", []))
        vb = " ".join(f"{x:.3f}" for x in row.get("vs_budget", []))
        print(
            f"{run[0]:<8} {run[1]:<9} {run[2]:<8} vs 1F1B per step "
            + " ".join(f"{x:.3f}" for x in row["vs_torch_1f1b"])
            + (f"  vs formula {vf}" if vf else "")
            + (f"  vs budget {vb}" if vb else "")
        )
    write_result(
        f"memory_promise_{p}ranks_m{m}",
        {"config": {"ranks": p, "microbatches": m, "shape": cases.SHAPE, "rows": cases.ROWS},
         "torch_1f1b_peak_bytes": torch_steps, "formula_stage0_bytes": stage0, "rows": rows},
        path=args.out,
    )  # fmt: skip


def rank_rows(rank: int, world: int, m: int, runs: list, build_kw: dict) -> dict:
    """This rank's ``promise_rows`` (tests/schedules/_memory_promise_cases.py: torch 1F1B's and
    each run's held peak per step), plus, under ``"budgets"``, the V-Half and V-Min runs'
    promised budget in bytes (:func:`promised_bytes`; None for the other schedules)."""
    import torch
    from tests.schedules import _memory_promise_cases as cases

    import zbpipe

    torch.set_num_threads(1)
    out: dict = {"torch": cases.run(rank, world, "torch", m, 2, build_kw)[0], "budgets": {}}
    for name, split, mode in runs:
        options: dict = {"split": split}
        steps = 2  # as promise_rows: measured start, then the re-made plan (profile: warm-up too)
        if mode == "profile":
            options.update(costs="profile", profile=zbpipe.ProfileConfig(comm=0.0, profile_steps=1))
            steps = 3
        peaks, sched, _ = cases.run(rank, world, name, m, steps, build_kw, **options)
        out[(name, split, mode)] = peaks
        out["budgets"][(name, split, mode)] = promised_bytes(sched, name, world, m)
    return out


def promised_bytes(sched: object, name: str, p: int, m: int) -> dict | None:
    """V-Half's or V-Min's budget in bytes as zbpipe plans it: ``v_budget`` of the bytes the
    probe measured (per chunk: held after F, ``mem_f``; added by B until W, ``mem_b``), with its
    parts; None for another schedule or where no bytes were measured."""
    from zbpipe.planning.yardsticks import v_budget, v_factor

    mode = {"ZBVHalf": "half", "ZBVMin": "min"}.get(name)
    costs = getattr(sched, "measured_costs", None) or getattr(sched, "memory_costs", None)
    unit = getattr(sched, "memory_unit_bytes", None)
    if mode is None or costs is None or unit is None:
        return None
    sc = costs.per_stage(2 * p)
    budget = sched.plan.meta.get("memory_budget")  # type: ignore[attr-defined]
    forward = v_factor(p, mode) * (sc[0].mem_f + sc[1].mem_f) * unit  # type: ignore[arg-type]
    return {
        "budget_bytes": v_budget(p, m, sc, mode) * unit,  # type: ignore[arg-type]
        "forward_bytes": forward,
        "backward_extra_bytes": max(0.0, sc[0].mem_b + sc[1].mem_b) * unit,
        "chunk_mem_f_bytes": [c.mem_f * unit for c in sc],
        "chunk_mem_b_bytes": [c.mem_b * unit for c in sc],
        "unit_bytes": unit,
        # the budget the re-made plan recorded (None where the plan kept no such note)
        "plan_memory_budget_bytes": (
            None if budget is None else float(budget) * unit  # type: ignore[arg-type]
        ),
    }


def checkpointed(p: int, m: int, out: str | None, engines: list[str]) -> None:
    """Predicted against held peak under activation checkpointing (``--checkpointed``)."""
    from results_io import write_result
    from tests.schedules import _memory_promise_cases as cases

    from zbpipe.testing import run_ranks

    names = list(SCHEDULES)
    rows = []
    for engine in engines:
        for ac in ("full", "selective"):
            for moe in (False, True):
                kw = {"ac": ac, "moe": moe, "vocab": 64}
                per_rank = run_ranks(cases.checkpointed_rows, p, m, kw, names, engine, timeout=3000)
                for name in names:
                    measured = max(r[name]["measured"] for r in per_rank)
                    predicted = per_rank[0][name]["predicted"]
                    rows.append(
                        {"engine": engine, "ac": ac, "experts": moe, "schedule": name,
                         "measured_bytes": measured, "predicted_bytes": predicted,
                         "measured_vs_predicted": measured / predicted}
                    )  # fmt: skip
                    print(f"{engine:<9} {ac:<9} experts={moe!s:<5} {name:<8} measured / "
                          f"predicted {measured / predicted:.3f}")  # fmt: skip
    write_result(
        f"memory_promise_ac_{p}ranks_m{m}",
        {"config": {"ranks": p, "microbatches": m, "shape": cases.SHAPE, "vocab": 64},
         "rows": rows},
        path=out,
    )  # fmt: skip


if __name__ == "__main__":
    main()
