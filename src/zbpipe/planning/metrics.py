"""The bubble-rate formula, shared by the simulator and the tracer of real runs (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def bubble_rate(spans: Mapping[int, Iterable[tuple[float, float]]]) -> float:
    """The paper's bubble rate from per-rank compute intervals ``(start, end)``.

    ``1 - (sum over ranks of busy time) / (num_ranks * the longest rank span)``, where a rank's
    span runs from the start of its first action to the end of its last. The staggered start
    of later ranks is therefore not a bubble. Ranks with no action count with zero busy time.
    """
    busy = 0.0
    longest = 0.0
    num_ranks = len(spans)
    for intervals in spans.values():
        intervals = list(intervals)
        if not intervals:
            continue
        busy += sum(end - start for start, end in intervals)
        longest = max(longest, max(e for _, e in intervals) - min(s for s, _ in intervals))
    if num_ranks == 0 or longest <= 0.0:
        return 0.0
    return max(0.0, 1.0 - busy / (num_ranks * longest))
