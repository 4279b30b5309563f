"""Which actions of a continuous plan each rank can run, given the mini-batches handed in so far.

A continuous plan (:func:`zbpipe.planning.continuous.periods.continuous_parts`) is, per rank, a
warm-up, a period repeated once per mini-batch boundary and a drain. :class:`StreamFrontier` holds
every rank's order as a stream that grows by one period per mini-batch given, and answers "how far
can each rank get now?" with a fixed point over the plan's dependencies:

* ``F(0, g)`` needs the data of microbatch ``g`` (given iff ``g < available``);
* ``F(s, g)`` needs ``F(s - 1, g)``; ``B(s, g)`` needs ``F(s, g)`` and ``B(s + 1, g)``;
  ``W(s, g)`` needs ``B(s, g)``, earlier in the same rank's order.

Each rank runs its order strictly in sequence, so it stops at its first action that cannot run
(directly for lack of data, or through a peer that lacks it). Every rank computes the same
fixed point for all ranks from the same plan, with no communication. The result is a prefix
of each rank's order that is closed under dependencies, so every receive a rank waits on in it
has its send in the senders' prefix of this call or an earlier one.

Pure Python, no torch: the plan layer's data only.
"""

from __future__ import annotations

from ..core import Action
from .periods import ContinuousParts


def _shift(actions: tuple[Action, ...], offset: int) -> list[Action]:
    return [Action(a.stage, a.kind, a.microbatch + offset) for a in actions]


def check_stream_parts(parts: ContinuousParts) -> None:
    """The runtime's assumptions about the parts (``ValueError`` if a generator breaks them).

    One stage per rank (stage = rank); kinds F, B, W only; on every stage the F passes and the B
    passes each run in microbatch order with no gap (so "done" is a counter); the drain is the
    period without the next mini-batch's forwards (so a stream cut after any mini-batch can be
    drained without undoing anything already run).
    """
    m = parts.minibatch_size
    joined = parts.join(3)
    for r, acts in joined.items():
        if any(a.stage != r or a.kind not in ("F", "B", "W") for a in acts):
            raise ValueError(
                f"continuous runtime: rank {r}'s order must hold only F/B/W of stage {r}"
            )
        for kind in ("F", "B", "W"):
            seq = [a.microbatch for a in acts if a.kind == kind]
            if seq != list(range(3 * m)):
                raise ValueError(
                    f"continuous runtime: rank {r} runs its {kind} passes out of microbatch order"
                )
        cut = [a for a in parts.period[r] if not (a.kind == "F" and a.microbatch >= m)]
        if cut != list(parts.drain[r]):
            raise ValueError(
                f"continuous runtime: rank {r}'s drain is not its period without the next forwards"
            )


class StreamFrontier:
    """Every rank's order as a growing stream, and each rank's position in it."""

    def __init__(self, parts: ContinuousParts) -> None:
        check_stream_parts(parts)
        self.parts = parts
        self.m = parts.minibatch_size
        self.p = len(parts.warmup)
        self._orders = {r: list(parts.warmup[r]) for r in range(self.p)}
        self._pos = {r: 0 for r in range(self.p)}
        self._periods = (
            0  # periods appended: covers mini-batches 0..periods (forwards of periods + 1 excluded)
        )
        self._drained = False
        self.f_done = [0] * self.p  # F passes done per stage (they run in microbatch order)
        self.b_done = [0] * self.p

    def give(self, n_minibatches: int) -> None:
        """Make room for ``n_minibatches`` mini-batches.

        The order grows up to the forwards of the next mini-batch.
        """
        if self._drained:
            raise RuntimeError("continuous stream already drained")
        while self._periods < n_minibatches:
            k = self._periods
            for r in range(self.p):
                self._orders[r] += _shift(self.parts.period[r], k * self.m)
            self._periods += 1

    def drain(self, n_minibatches: int) -> None:
        """The stream ends after ``n_minibatches``: drop the forwards of mini-batch ``n`` onward."""
        self.give(n_minibatches)
        limit = n_minibatches * self.m
        for r in range(self.p):
            done, rest = self._orders[r][: self._pos[r]], self._orders[r][self._pos[r] :]
            if any(a.kind == "F" and a.microbatch >= limit for a in done):
                raise RuntimeError(
                    "continuous stream ran a forward past its end"
                )  # never: no data for it
            self._orders[r] = done + [
                a for a in rest if not (a.kind == "F" and a.microbatch >= limit)
            ]
        self._drained = True

    def _ready(self, a: Action, available: int) -> bool:
        s, g = a.stage, a.microbatch
        if a.kind == "F":
            return g < available if s == 0 else self.f_done[s - 1] > g
        if a.kind == "B":
            return s == self.p - 1 or self.b_done[s + 1] > g
        return True  # W: its B is earlier in the same order

    def advance(self, available: int) -> dict[int, list[Action]]:
        """Run the fixed point with ``available`` microbatches of data.

        Returns each rank's new slice of its order.
        """
        new: dict[int, list[Action]] = {r: [] for r in range(self.p)}
        progress = True
        while progress:
            progress = False
            for r in range(self.p):
                order = self._orders[r]
                while self._pos[r] < len(order) and self._ready(order[self._pos[r]], available):
                    a = order[self._pos[r]]
                    if a.kind == "F":
                        self.f_done[a.stage] += 1
                    elif a.kind == "B":
                        self.b_done[a.stage] += 1
                    new[r].append(a)
                    self._pos[r] += 1
                    progress = True
        for r in range(self.p):  # forget what every rank has run
            del self._orders[r][: self._pos[r]]
            self._pos[r] = 0
        return new

    def pending(self) -> int:
        """Actions in the stream not yet run (over all ranks)."""
        return sum(len(o) - self._pos[r] for r, o in self._orders.items())


__all__ = ["StreamFrontier", "check_stream_parts"]
