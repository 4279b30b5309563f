"""Pictures of pipeline timelines: PNG (matplotlib) and Chrome/Perfetto JSON.

Both work on one neutral shape, :class:`Box` (one compute action on one rank, with its start and
end), so a simulated plan (:class:`~zbpipe.planning.SimResult`), a measured
:class:`~zbpipe.observe.trace.Trace`, and a Chrome JSON file the tracer wrote all draw the same way.

This module never imports torch (``zbpipe draw --schedule ...`` is a planning command) and imports
matplotlib only inside the functions that paint, through its object-oriented API on the Agg
canvas: no ``pyplot`` global state, no backend switch in the caller's session.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..planning import Costs, Plan, SimResult, simulate
from ..planning.metrics import bubble_rate as _bubble_rate
from .timeline import Event, to_chrome

logger = logging.getLogger(__name__)

#: Fill colour per action kind (colour-blind-safe hues from the Okabe-Ito palette).
KIND_COLORS: dict[str, str] = {"F": "#0072B2", "B": "#009E73", "W": "#E69F00", "BW": "#CC79A7"}
KIND_NAMES: dict[str, str] = {
    "F": "F (forward)",
    "B": "B (input grad)",
    "W": "W (weight grad)",
    "BW": "BW (full backward)",
}
#: A simulated cost unit is written to Chrome JSON as 1 ms (1000 us) so viewers show readable
#: numbers.
SIM_UNIT_US = 1000.0


#: The drawing shape is the shared timeline record (kept under its drawing name).
Box = Event


# ---------------------------------------------------------------------------- sources of boxes
def boxes_from_sim(result: SimResult) -> dict[int, list[Box]]:
    """The simulator's timeline as boxes (time in cost units)."""
    return {
        rank: [
            Box(rank, iv.action.kind, iv.action.stage, iv.action.microbatch, iv.start, iv.end)
            for iv in ivs
        ]
        for rank, ivs in sorted(result.timeline.items())
    }


def boxes_from_trace(trace: Any) -> dict[int, list[Box]]:
    """A measured :class:`~zbpipe.observe.trace.Trace` as boxes.

    ``trace`` may also be its Chrome JSON, as a dict or a file path.

    Times are seconds from the trace's first event.
    """
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    if isinstance(trace, Mapping):
        return boxes_from_chrome(trace, time_scale=1e6)
    events = getattr(trace, "events", None)
    if not isinstance(events, Mapping):
        raise ValueError(
            "trace_png/boxes_from_trace: expected a zbpipe Trace, its Chrome JSON dict "
            f"or a path to it, got {type(trace).__name__}"
        )
    starts = [e.start for evs in events.values() for e in evs]
    t0 = min(starts) if starts else 0.0
    return {
        rank: [Box(rank, e.kind, e.stage, e.microbatch, e.start - t0, e.end - t0) for e in evs]
        for rank, evs in sorted(events.items())
    }


def boxes_from_chrome(data: Mapping[str, Any], time_scale: float = 1e6) -> dict[int, list[Box]]:
    """Read back Chrome trace-event JSON as written by :func:`to_chrome` or ``Trace.to_chrome``.

    Every complete event (``ph: "X"``) becomes a box; ``tid`` is the rank, ``cat`` the kind,
    ``args`` carry stage and microbatch. ``ts``/``dur`` (microseconds) are divided by ``time_scale``
    (1e6 gives seconds; :data:`SIM_UNIT_US` gives simulated cost units back).
    """
    events = data.get("traceEvents") if isinstance(data, Mapping) else None
    if not isinstance(events, list):
        raise ValueError(
            "Chrome trace JSON must be an object with a 'traceEvents' list "
            "(as Trace.write_chrome writes)"
        )
    out: dict[int, list[Box]] = {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("args", {}).get("pair_half"):
            continue  # metadata rows, anything not a compute span, pairs' halves (in their pair)
        try:
            rank, kind = int(ev["tid"]), str(ev["cat"])
            args = ev.get("args", {})
            start = float(ev["ts"]) / time_scale
            end = start + float(ev["dur"]) / time_scale
            box = Box(rank, kind, int(args["stage"]), int(args["microbatch"]), start, end)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"Chrome trace event {ev!r} lacks tid/cat/ts/dur/args.stage/args.microbatch ({e}); "
                "draw only reads traces written by zbpipe's tracer or zbpipe draw --json"
            ) from None
        out.setdefault(rank, []).append(box)
    for boxes in out.values():
        boxes.sort(key=lambda b: b.start)
    return dict(sorted(out.items()))


def plan_chrome(
    plan: Plan, costs: Costs | None = None, result: SimResult | None = None
) -> dict[str, Any]:
    """A plan's simulated timeline as Chrome JSON (one cost unit shown as 1 ms)."""
    res = result if result is not None else simulate(plan, costs)
    return to_chrome(
        boxes_from_sim(res),
        time_scale=SIM_UNIT_US,
        meta={
            "schedule": plan.name,
            "num_ranks": plan.num_ranks,
            "n_microbatches": plan.n_microbatches,
            "bubble_rate": res.bubble_rate,
            "makespan": res.makespan,
            "time_unit": "1 cost unit = 1 ms",
        },
    )


# ---------------------------------------------------------------------------- PNG
def _matplotlib() -> tuple[Any, Any, Any]:
    """(Figure, FigureCanvasAgg, Patch), or a clear error when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            f"drawing PNG timelines needs matplotlib ({e}); "
            "install it with: pip install 'zbpipe[draw]'"
        ) from e
    return Figure, FigureCanvasAgg, Patch


def _tint(hex_color: str, amount: float) -> tuple[float, float, float]:
    """``hex_color`` mixed with white (``amount`` 0 = unchanged, 1 = white)."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)  # type: ignore[return-value]


def _text_color(rgb: Sequence[float]) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.6 else "white"


def draw_timeline(
    intervals_by_rank: Mapping[int, Iterable[Any]],
    title: str,
    path: str,
    *,
    time_label: str = "time",
    dpi: int = 120,
) -> None:
    """Paint a timeline PNG: one row per rank (rank 0 on top), time on x, one box per action.

    ``intervals_by_rank`` holds :class:`Box` es, the simulator's ``Interval`` s or the tracer's
    ``Event`` s. Boxes are coloured by kind (F, B, W, BW); on ranks holding several stages (V
    placement) the later chunk is a lighter tint of the same colour. The microbatch number is
    written in each box wide enough to hold it; idle time (bubbles) stays blank.

    Long because it builds one matplotlib figure top to bottom (axes, bars, labels, legend).
    """
    Figure, FigureCanvasAgg, Patch = _matplotlib()
    boxes = {r: [_as_box(r, x) for x in xs] for r, xs in intervals_by_rank.items()}
    ranks = sorted(boxes)
    all_boxes = [b for r in ranks for b in boxes[r]]
    t0 = min((b.start for b in all_boxes), default=0.0)
    t1 = max((b.end for b in all_boxes), default=1.0)
    span = (t1 - t0) or 1.0
    # Width grows with the number of actions per rank so labels stay legible, within reason.
    per_rank = max((len(v) for v in boxes.values()), default=1)
    # Margins in inches, so rank labels, title and legend never clip whatever the figure size.
    left, right, top, bottom = 0.8, 2.0, 0.45, 0.6
    width = min(28.0, max(8.0, 0.2 * per_rank + left + right))
    height = top + bottom + 0.45 * max(1, len(ranks))
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes(
        (left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height)
    )
    ax.set_xlim(t0 - 0.005 * span, t1 + 0.005 * span)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    px_per_unit = ax.get_window_extent().width / (1.01 * span)

    # Which chunk of its rank each stage is (0 for the first stage a rank holds, 1 for the next).
    chunk_of = {}
    for r in ranks:
        for i, s in enumerate(sorted({b.stage for b in boxes[r]})):
            chunk_of[(r, s)] = i
    for row, r in enumerate(ranks):
        for b in boxes[r]:
            rgb = _tint(KIND_COLORS.get(b.kind, "#777777"), 0.45 * min(chunk_of[(r, b.stage)], 1))
            ax.broken_barh(
                [(b.start, b.end - b.start)],
                (row - 0.4, 0.8),
                facecolors=[rgb],
                edgecolors="white",
                linewidth=0.6,
            )
            label = str(b.microbatch)
            # ~6.5 px per digit at fontsize 8, plus a margin: skip labels that would overflow.
            if (b.end - b.start) * px_per_unit >= 6.5 * len(label) + 3:
                ax.text(
                    (b.start + b.end) / 2,
                    row,
                    label,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color=_text_color(rgb),
                )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel(time_label)
    ax.set_title(title, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)

    kinds = [k for k in ("F", "B", "W", "BW") if any(b.kind == k for b in all_boxes)]
    kinds += sorted({b.kind for b in all_boxes} - set(kinds))
    handles = [
        Patch(facecolor=KIND_COLORS.get(k, "#777777"), label=KIND_NAMES.get(k, k)) for k in kinds
    ]
    if any(c >= 1 for c in chunk_of.values()):
        handles += [
            Patch(facecolor=_tint(KIND_COLORS.get(k, "#777777"), 0.45), label=f"{k}, 2nd chunk")
            for k in kinds
        ]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle (bubble)"))
    fig.legend(
        handles=handles,
        loc="center left",
        bbox_to_anchor=(1 - (right - 0.1) / width, 0.5),
        frameon=False,
        fontsize=8,
    )
    fig.savefig(path, dpi=dpi, facecolor="white")
    logger.info(
        "zbpipe: wrote timeline %s (%d actions on %d ranks)", path, len(all_boxes), len(ranks)
    )


def _as_box(rank: int, x: Any) -> Box:
    if isinstance(x, Box):
        return x
    if hasattr(x, "action"):  # the simulator's Interval
        return Box(rank, x.action.kind, x.action.stage, x.action.microbatch, x.start, x.end)
    if hasattr(x, "kind"):  # the tracer's Event
        return Box(rank, x.kind, x.stage, x.microbatch, x.start, x.end)
    raise ValueError(
        f"draw_timeline: cannot draw {x!r}; pass Box, simulator Interval or tracer Event objects"
    )


def plan_title(plan: Plan, result: SimResult) -> str:
    return (
        f"{plan.name}   p={plan.num_ranks}   m={plan.n_microbatches}   "
        f"bubble rate {result.bubble_rate:.1%}   makespan {result.makespan:.4g}"
    )


def plan_timeline_png(
    plan: Plan,
    costs: Costs | None,
    path: str,
    *,
    result: SimResult | None = None,
    title: str | None = None,
) -> SimResult:
    """Simulate ``plan`` with ``costs`` (per stage, as ``simulate`` takes them) and draw it.

    Returns the simulation result drawn. Pass ``result`` to draw one you already have.
    """
    res = result if result is not None else simulate(plan, costs)
    draw_timeline(
        boxes_from_sim(res), title or plan_title(plan, res), path, time_label="time (cost units)"
    )
    return res


def trace_png(trace: Any, path: str, *, title: str | None = None) -> float:
    """Draw a measured trace (a ``Trace``, its Chrome JSON dict, or a path to that JSON file).

    Returns the measured bubble rate shown in the title (same formula as the simulator).
    """
    boxes = boxes_from_trace(trace)
    rate = _bubble_rate({r: [(b.start, b.end) for b in bs] for r, bs in boxes.items()})
    mbs = {b.microbatch for bs in boxes.values() for b in bs}
    # Seconds would give tiny tick labels on CPU runs of a few ms: draw milliseconds.
    ms = {
        r: [b._replace(start=b.start * 1e3, end=b.end * 1e3) for b in bs] for r, bs in boxes.items()
    }
    auto = f"measured trace   p={len(boxes)}   m={len(mbs)}   bubble rate {rate:.1%}"
    draw_timeline(ms, title or auto, path, time_label="time (ms)")
    return rate
