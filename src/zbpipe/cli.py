"""``zbpipe`` command line: ``simulate`` one schedule, ``compare`` them all, ``choose`` the
fastest within a memory budget, ``draw`` a timeline, run the ``demo``, ``build-native`` (the
deferred engine's native weight capture, ahead of a job).

Each subcommand is a ``build_parser`` entry plus a ``_cmd_<name>(args) -> int`` handler, so new
subcommands (``demo``, ``draw``) add one ``add_parser`` block and one handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .integrations.plans import plan  # zbpipe's names and torch's ("torch:<Name>"), one lookup
from .planning import Costs, Plan, PlanError, SimResult, known_names, plan_to_csv, simulate
from .planning.continuous.tradeoff import continuous_tradeoff


def _costs_arg(text: str) -> Costs:
    try:
        return Costs.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: one subcommand per job (simulate, compare, draw, demo...).

    Long because it is the command line's argument table, one declaration per option; split, the
    table would be in pieces.
    """
    parser = argparse.ArgumentParser(
        prog="zbpipe", description="Zero Bubble pipeline schedules: plan and simulate."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-p", "--num-ranks", type=int, required=True, help="pipeline ranks")
        p.add_argument(
            "-m", "--n-microbatches", type=int, required=True, help="microbatches per step"
        )
        p.add_argument(
            "--costs",
            type=_costs_arg,
            default=Costs(),
            help="per-stage costs of the model split into p stages, e.g. f=1,b=1,w=1,comm=0",
        )
        p.add_argument(
            "--memory-limit", type=float, default=None, help="per-rank activation memory limit"
        )

    sim = sub.add_parser("simulate", help="simulate one schedule and print its bubble rate")
    sim.add_argument("--schedule", default="ZBH1", help=f"one of: {', '.join(known_names())}")
    common(sim)
    sim.add_argument("--grid", action="store_true", help="also print the rank-by-step grid")
    sim.add_argument("--json", metavar="FILE", help="write the result (and timeline) as JSON")
    sim.add_argument("--csv", metavar="FILE", help="write the plan in torch's schedule CSV format")
    sim.set_defaults(handler=_cmd_simulate)

    choose = sub.add_parser(
        "choose",
        help="the fastest schedule whose simulated per-rank peak fits a memory budget",
    )
    common(choose)
    choose.set_defaults(memory_limit=None)
    choose.add_argument(
        "--budget",
        required=True,
        help="per-rank budget: bytes ('40GiB', '512MiB') or a number in the units of --mem-f",
    )
    choose.add_argument(
        "--mem-f",
        default=None,
        help="what one microbatch of each of the p stages holds after F, comma-separated, in "
        "bytes ('9.5MiB,9.5MiB,20MiB') or units (default: 1 unit each)",
    )
    choose.add_argument(
        "--mem-b",
        default=None,
        help="the change at B per stage, same form (default 0: B frees nothing before W)",
    )
    choose.add_argument(
        "--layouts",
        default="loop,v",
        help="placements the stages can take: loop (one stage per rank), v, or both",
    )
    choose.set_defaults(handler=_cmd_choose)

    cmp_ = sub.add_parser("compare", help="simulate every known schedule side by side")
    common(cmp_)
    cmp_.set_defaults(handler=_cmd_compare)

    draw = sub.add_parser(
        "draw",
        help="draw a plan's simulated timeline, or a measured trace, as PNG and/or Chrome JSON",
    )
    draw.add_argument(
        "--schedule", default="ZBH1", help="schedule to simulate and draw (ignored with --trace)"
    )
    draw.add_argument(
        "--trace",
        metavar="FILE",
        help="draw a measured trace instead (the Chrome JSON Trace.write_chrome writes)",
    )
    draw.add_argument("-p", "--num-ranks", type=int, help="pipeline ranks (needed without --trace)")
    draw.add_argument(
        "-m", "--n-microbatches", type=int, help="microbatches per step (needed without --trace)"
    )
    draw.add_argument(
        "--costs",
        type=_costs_arg,
        default=Costs(),
        help="per-stage costs of the model split into p stages, e.g. f=1,b=1,w=1,comm=0",
    )
    draw.add_argument(
        "--memory-limit", type=float, default=None, help="per-rank activation memory limit"
    )
    draw.add_argument(
        "--png", metavar="FILE", help="write the timeline picture here (needs matplotlib)"
    )
    draw.add_argument(
        "--json",
        metavar="FILE",
        help="write Chrome/Perfetto trace JSON here (chrome://tracing, ui.perfetto.dev)",
    )
    draw.add_argument("--title", help="picture title (default: schedule, p, m, bubble rate)")
    draw.set_defaults(handler=_cmd_draw)

    native = sub.add_parser(
        "build-native",
        help="build the deferred engine's native weight capture now (once per machine and "
        "torch; a job would otherwise build it in the background at its first schedule)",
    )
    native.add_argument("--verbose", action="store_true", help="show the compiler's output")
    native.set_defaults(handler=_cmd_build_native)

    demo = sub.add_parser(
        "demo",
        add_help=False,
        help="the main job: a real 2-rank CPU training run, ZB-H1 against torch's 1F1B "
        "(zbpipe demo --help for its options)",
    )
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(handler=_cmd_demo)
    return parser


def chunk_costs(costs: Costs, p: Plan) -> Costs:
    """Costs of one chunk when ``p`` cuts the same model into more stages than ranks.

    ``--costs`` describe the model split into ``num_ranks`` stages; a plan with ``k`` stages per
    rank gets each stage's cost divided by ``k`` (docs/design/architecture.md: comparisons keep the
    model fixed).
    """
    k = p.num_stages // p.num_ranks
    return costs if k == 1 else costs.split(k)


def _run(name: str, args: argparse.Namespace) -> tuple[Plan, SimResult]:
    pl = plan(
        name,
        args.num_ranks,
        args.n_microbatches,
        costs=args.costs,  # torch: orders ignore costs
        memory_limit=args.memory_limit,
    )
    return pl, simulate(pl, chunk_costs(args.costs, pl), memory_limit=args.memory_limit)


def _cmd_simulate(args: argparse.Namespace) -> int:
    pl, res = _run(args.schedule, args)
    print(
        f"{pl.name}: {pl.num_ranks} ranks, {pl.num_stages} stages, {pl.n_microbatches} microbatches"
    )
    print(f"bubble rate: {res.bubble_rate:.4f}")
    print(f"makespan: {res.makespan:.4f}")
    print(
        "peak memory per rank: "
        + ", ".join(f"{r}: {v:g}" for r, v in sorted(res.peak_memory.items()))
    )
    if args.grid:
        print(pl)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_result_json(pl, res), f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            f.write(plan_to_csv(pl))
    return 0


def _result_json(pl: Plan, res: SimResult) -> dict:
    return {
        "schedule": pl.name,
        "num_ranks": pl.num_ranks,
        "n_microbatches": pl.n_microbatches,
        "num_stages": pl.num_stages,
        "bubble_rate": res.bubble_rate,
        "makespan": res.makespan,
        "peak_memory": {str(r): v for r, v in res.peak_memory.items()},
        "timeline": {
            str(r): [[str(iv.action), iv.start, iv.end] for iv in ivs]
            for r, ivs in res.timeline.items()
        },
    }


def _amounts(text: str | None, n: int, what: str) -> list[float] | None:
    """``"9.5MiB,20MiB"`` as bytes (or plain numbers), one per stage; None when not given."""
    from .planning.budget import parse_budget

    if text is None:
        return None
    values = []
    for part in text.split(","):
        part = part.strip()
        negative = part.startswith("-")
        value, fraction = parse_budget(part.lstrip("-"))
        if fraction:
            raise ValueError(f"{what}: a percentage is not an amount, got {part!r}")
        values.append(-value if negative else value)
    if len(values) not in (1, n):
        raise ValueError(f"{what}: give 1 or {n} values (one per stage), got {len(values)}")
    return values * n if len(values) == 1 else values


def _cmd_choose(args: argparse.Namespace) -> int:
    import dataclasses

    from .planning.budget import format_bytes, is_budget_string, parse_budget
    from .planning.search.within_budget import choose_plan

    p = args.num_ranks
    in_bytes = is_budget_string(args.budget) and not args.budget.strip().replace(".", "").isdigit()
    if in_bytes:
        limit, fraction = parse_budget(args.budget)
        if fraction:
            raise ValueError("--budget: a share of a device needs a device; give bytes")
    else:
        limit = float(args.budget)
    costs = args.costs
    mem_f = _amounts(args.mem_f, p, "--mem-f")
    if mem_f is not None:
        mem_b = _amounts(args.mem_b, p, "--mem-b") or [0.0] * p
        costs = dataclasses.replace(
            costs, mem_f=mem_f, mem_b=mem_b, mem_w=[-(f + b) for f, b in zip(mem_f, mem_b)]
        )
    elif in_bytes:
        raise ValueError("--budget in bytes needs --mem-f in bytes (what each stage holds)")
    layouts = tuple(x.strip() for x in args.layouts.split(",") if x.strip())
    choice = choose_plan(
        p,
        args.n_microbatches,
        limit,
        costs,
        layouts=layouts,  # type: ignore[arg-type]
        unit_bytes=1.0 if in_bytes else None,
    )
    print(choice.table(1.0 if in_bytes else None))
    best = choice.best
    how = (
        f"{p} stages, one per rank"
        if best.layout == "loop"
        else f"{2 * p} chunks in V placement: rank r holds chunks r and {2 * p - 1} - r"
    )
    peak = format_bytes(best.peak) if in_bytes else f"{best.peak:.4g}"
    print(f"chosen: {best.name} (peak {peak} per rank; build {how})")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    print(f"{'schedule':<28} {'bubble rate':>11} {'makespan':>10} {'max peak mem':>12}")
    notes = []
    for name in known_names():
        try:
            pl, res = _run(name, args)
        except (ValueError, PlanError) as e:  # a schedule that does not apply to these sizes
            notes.append(f"{name}: skipped: {e}")
            continue
        except ImportError as e:
            notes.append(f"{name}: skipped (torch not importable: {e})")
            continue
        peak = max(res.peak_memory.values())
        if pl.meta.get("n_minibatches"):  # a continuous plan runs several optimizer steps
            name = f"{name} ({pl.meta['n_minibatches']} steps)"
        print(f"{name:<28} {res.bubble_rate:>11.4f} {res.makespan:>10.4g} {peak:>12.4g}")
    for note in notes:
        print(note)
    try:  # sync continuous is exact; does 2bw's stream buy enough to pay for its staleness?
        tradeoff = continuous_tradeoff(
            args.num_ranks, args.n_microbatches, args.costs, args.memory_limit
        )
    except (ValueError, PlanError) as e:
        print(f"continuous: skipped: {e}")
    else:
        print(tradeoff.summary())
    return 0


def _cmd_draw(args: argparse.Namespace) -> int:
    from .observe import draw  # matplotlib itself is imported only when a PNG is painted

    if not (args.png or args.json):
        raise ValueError("nothing to write: give --png FILE and/or --json FILE")
    try:
        if args.trace:
            with open(args.trace) as f:
                data = json.load(f)
            boxes = draw.boxes_from_chrome(data)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(draw.to_chrome(boxes), f)
            if args.png:
                rate = draw.trace_png(data, args.png, title=args.title)
                print(f"measured trace: {len(boxes)} ranks, bubble rate {rate:.4f}")
        else:
            if args.num_ranks is None or args.n_microbatches is None:
                raise ValueError(
                    "drawing a schedule needs -p/--num-ranks and -m/--n-microbatches "
                    "(or give --trace FILE)"
                )
            pl, res = _run(args.schedule, args)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(draw.plan_chrome(pl, result=res), f)
            if args.png:
                draw.plan_timeline_png(pl, None, args.png, result=res, title=args.title)
            print(
                f"{pl.name}: {pl.num_ranks} ranks, {pl.n_microbatches} microbatches, "
                f"bubble rate {res.bubble_rate:.4f}, makespan {res.makespan:.4f}"
            )
    except ImportError as e:
        print(f"zbpipe draw: error: {e}", file=sys.stderr)
        return 2
    for path in (args.png, args.json):
        if path:
            print(f"wrote {path}")
    return 0


def _cmd_build_native(args: argparse.Namespace) -> int:
    from .engines.native import prebuild  # imports torch; the planning commands do not

    ok, message = prebuild(verbose=args.verbose)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main  # imports torch; the planning commands do not

    return demo_main(args.demo_args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo owns its own options (and --help)
        return _cmd_demo(argparse.Namespace(demo_args=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, PlanError) as e:
        print(f"zbpipe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
