"""One record for a compute action on a timeline, and the Chrome/Perfetto JSON writer.

Shared by the tracer (measured runs, :mod:`zbpipe.observe.trace`) and the pictures
(:mod:`zbpipe.observe.draw`), so a measured trace and a simulated plan are written, read back and
drawn the same way. Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class Event(NamedTuple):
    """One compute action on one rank: ``kind`` (F, B, W, BW) of ``microbatch`` on ``stage``,
    from ``start`` to ``end`` (seconds for measured runs, cost units for simulated plans), of
    which ``waited`` was spent waiting for the action's own collectives (a communication
    point's all-to-all; :mod:`zbpipe.schedules.pairs`), not computing."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    waited: float = 0.0


def to_chrome(
    boxes_by_rank: Mapping[int, Sequence[Event]],
    time_scale: float = 1e6,
    meta: Mapping[str, Any] | None = None,
    pieces: Mapping[int, Sequence[Event]] | None = None,
) -> dict[str, Any]:
    """Chrome/Perfetto trace-event JSON: one complete event per compute action, one row per rank.

    ``pieces``: the halves of overlapped pairs (:attr:`zbpipe.observe.trace.Tracer.pieces`),
    written on their rank's row inside their pair's event (a viewer nests them under it), with
    ``args.pair_half`` set; :func:`zbpipe.observe.draw.boxes_from_chrome` skips them.

    Each event is named like ``F3`` with category ``F``; ``tid`` is the rank. ``time_scale``
    converts event times to microseconds (1e6 for seconds; ``zbpipe.observe.draw.SIM_UNIT_US`` for
    cost units).
    """
    starts = [b.start for boxes in boxes_by_rank.values() for b in boxes]
    t0 = min(starts) if starts else 0.0
    rows = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in sorted(boxes_by_rank)
    ]
    halves = pieces or {}
    for rank in sorted(boxes_by_rank):
        boxes = [(b, False) for b in boxes_by_rank[rank]]
        boxes += [(b, True) for b in halves.get(rank, ())]
        for b, half in boxes:
            args: dict[str, Any] = {"stage": b.stage, "microbatch": b.microbatch}
            if half:
                args["pair_half"] = True
            rows.append(
                {
                    "name": f"{b.kind}{b.microbatch}",
                    "cat": b.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": (b.start - t0) * time_scale,
                    "dur": (b.end - b.start) * time_scale,
                    "args": args,
                }
            )
    out: dict[str, Any] = {"traceEvents": rows, "displayTimeUnit": "ms"}
    if meta:
        out["otherData"] = dict(meta)
    return out
