"""What the V schedulers share (pure Python): an action as they record it, orders of such actions,
a timed result, and the per-stage constants they look up.

The greedy list scheduler (:mod:`.greedy`) and the executor of the paper's order
(:mod:`.paper_order`) both record actions as plain ``(stage, kind, microbatch)`` triples
(:data:`RawAction`) and package a timed per-rank order as a :class:`GreedyResult`; the
building-block candidates (:mod:`.blocks`) return the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ..core import Action
from ..costs import StageCosts

#: One action as the schedulers record it: ``(stage, kind, microbatch)``.
RawAction = tuple[int, str, int]


class RawOrder(Mapping[int, tuple[Action, ...]]):
    """Per-rank orders recorded as :data:`RawAction` triples, made into ``Action`` s when read.

    A V plan search times about twenty candidate orders and keeps one or two; an ``Action`` is
    a validated frozen dataclass that costs more to make than a scheduler decision, so the losers
    never make theirs.
    """

    def __init__(self, steps: list[list[RawAction]]) -> None:
        self._steps = steps
        self._actions: dict[int, tuple[Action, ...]] = {}

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        if rank not in self._actions:
            if not 0 <= rank < len(self._steps):
                raise KeyError(rank)
            self._actions[rank] = tuple(Action(s, k, mb) for s, k, mb in self._steps[rank])
        return self._actions[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._steps)))

    def __len__(self) -> int:
        return len(self._steps)


@dataclass(frozen=True)
class GreedyResult:
    """The per-rank orders the greedy produced, with its own timing estimate."""

    order: Mapping[int, tuple[Action, ...]]
    makespan: float
    longest_span: float
    peak_memory: dict[int, float]


class StageTable:
    """Per-stage constants of a V run, looked up once instead of on every decision.

    The schedulers ask for the same few numbers tens of thousands of times per plan; lists
    indexed by stage cost a fraction of ``StageCosts`` method calls, and each float is exactly
    what those methods return, so the timings (and every tie they decide) are unchanged.
    """

    def __init__(self, p: int, stage_costs: list[StageCosts]) -> None:
        n = 2 * p
        sc = stage_costs
        self.rank_of = [s if s < p else n - 1 - s for s in range(n)]
        self.dur = {k: [c.time(k) for c in sc] for k in ("F", "B", "W", "BW")}
        self.mem = {k: [c.mem(k) for c in sc] for k in ("F", "B", "W", "BW")}
        # A value reaches the neighbour stage ``comm`` after it is made, or at once on the same
        # rank: F goes down the V (s -> s + 1), the input gradient comes back (s -> s - 1); the
        # one same-rank hop is the turn of the V. Adding 0.0 to a time leaves it as it is.
        rank_of = self.rank_of
        self.down_delay = [
            0.0 if s + 1 < n and rank_of[s] == rank_of[s + 1] else sc[s].comm for s in range(n)
        ]
        self.up_delay = [
            0.0 if s > 0 and rank_of[s] == rank_of[s - 1] else sc[s].comm for s in range(n)
        ]


def greedy_result(
    order: list[list[RawAction]],
    first_start: list[float | None],
    ends: list[float],
    peak: list[float],
) -> GreedyResult:
    """Package a timed per-rank order (start of each rank's first action, end of its last)."""
    p = len(ends)
    starts = [fs or 0.0 for fs in first_start]
    return GreedyResult(
        order=RawOrder(order),
        makespan=max(ends) - min(starts),
        longest_span=max(e - s for s, e in zip(starts, ends)),
        peak_memory={r: peak[r] for r in range(p)},
    )
