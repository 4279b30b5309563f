"""Real steps against their own plan's simulation: what a step pays that its plan does not.

Each schedule runs on N gloo ranks (``real_run.py``'s models and schedule names, repetitions
interleaved). From the traced compute spans of all its steps the script takes each stage's median
F, B, W (and BW) time (``zbpipe.observe.profile.measure_stage_costs``), simulates the plan the
schedule ran (after its first step: the re-made plan where the memory probe changed it) with those
costs, and compares:

* the real step (max over ranks, from a barrier; median over repetitions) with the simulated one,
  with no message cost and with the median measured wait of a cross-rank dependency as ``comm``;
* per rank, the time in compute spans against the step: what is left is waiting for a neighbour,
  posting messages and the action loop's own time;
* the real ratio to the first schedule (paired per repetition) with the simulated one.

torch's ``Schedule1F1B`` is simulated as zbpipe's 1F1B plan (its fused backward as B + W).
A real/simulated ratio above 1 that two schedules share is the machine (contention, the tails of
single actions); one that only a schedule with more actions or messages pays is what those cost.

Run:  PYTHONPATH=src python benchmarks/sim_vs_trace.py [--reps 60] [--schedules torch:1F1B,ZBH1,ZBV]
(defaults: issue 37's 2-rank MLP, ``--model mlp --hidden 1024 --microbatch-size 32
--microbatches 4 --blocks 8 --meter 0``; ``--model gpt`` and the other sizes as in real_run.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

from real_run import INT_FIELDS, Config, _batch, _build, _timed_step


def _dependency(kind: str, stage: int, num_stages: int) -> tuple[str, int] | None:
    """The pass a traced F/B/BW of ``stage`` waits for on another stage (its kind, its stage)."""
    if kind == "F":
        return ("F", stage - 1) if stage > 0 else None
    if kind in ("B", "BW"):
        return ("B", stage + 1) if stage < num_stages - 1 else None
    return None


def cross_rank_waits(steps: list[dict[int, list]], placement: dict[int, int]) -> list[float]:
    """Seconds from a cross-rank producer's end (or the consumer's previous action's end, if
    later) to the consumer's start, for every such dependency in ``steps`` (``{rank: events}``)."""
    waits = []
    for per_rank in steps:
        ends: dict[tuple[str, int, int], float] = {}
        for events in per_rank.values():
            for e in events:
                ends[("B" if e.kind == "BW" else e.kind, e.stage, e.microbatch)] = e.end
        for events in per_rank.values():
            for prev, e in zip([None, *events], events):
                dep = _dependency(e.kind, e.stage, len(placement))
                if dep is None or placement[dep[1]] == placement[e.stage] or prev is None:
                    continue
                ready = max(ends[(dep[0], dep[1], e.microbatch)], prev.end)
                waits.append(max(0.0, e.start - ready))
    return waits


def _rank_main(rank: int, world: int, cfg: Config) -> dict | None:
    import torch.distributed as dist

    runs = {name: _build(name, rank, world, cfg) for name in cfg.schedules}
    x, target = _batch(cfg)

    def one_step(name: str) -> tuple[float, float, list]:
        return _timed_step(runs[name], x, target)[:3]

    for name in cfg.schedules:  # shape inference, the memory probe and its re-plan
        one_step(name)
    records: dict[str, list] = {name: [] for name in cfg.schedules}
    for rep in range(cfg.reps):
        k = rep % len(cfg.schedules)
        for name in cfg.schedules[k:] + cfg.schedules[:k]:
            records[name].append(one_step(name))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank != 0:
        return None
    # every rank runs the same plan; torch's schedules have none (planned in summarize)
    return gathered, {name: getattr(runs[name][0], "plan", None) for name in cfg.schedules}


def summarize(gathered: list[Any], plans: dict[str, Any], cfg: Config) -> dict[str, Any]:
    from results_io import paired_ratios

    from zbpipe.observe.profile import measure_stage_costs
    from zbpipe.planning import plan, simulate

    world = len(gathered)
    out: dict[str, Any] = {}
    for name in cfg.schedules:
        the_plan = plans[name]
        if the_plan is None:
            if name != "torch:1F1B":
                raise ValueError(f"{name}: only torch:1F1B among torch's schedules is simulated")
            the_plan = plan("1F1B", world, cfg.microbatches)
        num_stages = len(the_plan.placement)
        steps = [{r: gathered[r][name][k][2] for r in range(world)} for k in range(cfg.reps)]
        real = [
            max(gathered[r][name][k][1] for r in range(world))
            - min(gathered[r][name][k][0] for r in range(world))
            for k in range(cfg.reps)
        ]
        costs = measure_stage_costs([e for s in steps for ev in s.values() for e in ev], num_stages)
        waits = cross_rank_waits(steps, dict(the_plan.placement))
        comm = statistics.median(waits) * 1e3 if waits else 0.0
        sim = simulate(the_plan, costs).makespan
        sim_comm = simulate(the_plan, dataclasses.replace(costs, comm=comm)).makespan
        busy = [
            statistics.median(sum(e.end - e.start for e in s[r]) for s in steps) * 1e3
            for r in range(world)
        ]
        out[name] = {
            "plan": the_plan.name,
            "step_time_s": real,
            "real_ms": statistics.median(real) * 1e3,
            "sim_ms": sim,
            "sim_comm_ms": sim_comm,
            "comm_ms": comm,
            "busy_ms_per_rank": busy,
            "costs_ms": {"f": costs.f, "b": costs.b, "w": costs.w},
        }
    first = cfg.schedules[0]
    for name in cfg.schedules:
        r = out[name]
        r["real_over_sim"] = r["real_ms"] / r["sim_ms"]
        r["ratio_to_first"] = paired_ratios(r["step_time_s"], out[first]["step_time_s"])
        r["sim_ratio_to_first"] = r["sim_ms"] / out[first]["sim_ms"]
    return out


def main() -> None:
    from results_io import write_result

    from zbpipe.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # issue 37's 2-rank MLP shape, no memory meter (its pack hook would be timed too)
    defaults = Config(reps=60, microbatches=4, microbatch_size=32, hidden=1024, blocks=8, meter=0)
    for f in INT_FIELDS:
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(defaults, f))
    ap.add_argument("--schedules", default="torch:1F1B,ZBH1,ZBV", help="torch:1F1B first")
    ap.add_argument("--model", choices=("gpt", "mlp"), default="mlp")
    ap.add_argument("--out", default="sim_vs_trace", help="results file name (benchmarks/results/)")
    args = ap.parse_args()
    fields = {f: getattr(args, f) for f in INT_FIELDS}
    fields["blocks"] = fields["blocks"] or 2 * args.ranks
    cfg = Config(**fields, model=args.model, schedules=tuple(args.schedules.split(",")))
    gathered, plans = run_ranks(_rank_main, cfg.ranks, cfg, timeout=3600)[0]
    res = summarize(gathered, plans, cfg)
    first = cfg.schedules[0]
    print(f"{cfg.ranks} ranks, m={cfg.microbatches}, {cfg.reps} interleaved reps (ms, medians)")
    print(
        f"{'schedule':<14} {'real':>7} {'sim':>7} {'sim+comm':>8} {'real/sim':>8} "
        f"{'vs ' + first + ' real':>20} {'sim':>6}  compute per rank"
    )
    for name, r in res.items():
        q = r["ratio_to_first"]
        print(
            f"{name:<14} {r['real_ms']:7.1f} {r['sim_ms']:7.1f} {r['sim_comm_ms']:8.1f} "
            f"{r['real_over_sim']:8.3f} {q['median']:8.3f} ({q['min']:.2f}-{q['max']:.2f}) "
            f"{r['sim_ratio_to_first']:6.3f}  "
            + " / ".join(f"{b:.1f}" for b in r["busy_ms_per_rank"])
        )
    path = write_result(args.out, {"config": dataclasses.asdict(cfg), "results": res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
