"""What a stale continuous mode would buy over ``sync`` for (p, m, costs): the simulator's answer.

``sync`` is exact, but its stage 0 cannot start mini-batch k + 1 before its own last W of k, so
with few microbatches (m < 2p - 1 at unit costs) each boundary leaves bubble the deferred W
passes cannot fill. ``2bw`` streams through the boundary at the price of one step of staleness.
:func:`continuous_tradeoff` simulates both joined over ``n_minibatches`` and reports the time per
mini-batch of each, so "is 2bw worth its staleness here?" is a number before anything runs
(``zbpipe compare`` prints it; ``ScheduleContinuous`` logs it at construction).

Pure Python: plans and the simulator only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import Costs
from ..simulator import simulate
from .periods import plan_continuous

#: mini-batches joined for the estimate (enough for the warm-up and drain to weigh little)
N_MINIBATCHES = 8


@dataclass(frozen=True, kw_only=True)
class ContinuousTradeoff:
    """Simulated time per mini-batch of ``sync`` and ``2bw``, and what the stream would save."""

    num_ranks: int
    """pipeline ranks p"""
    n_microbatches: int
    """microbatches per mini-batch m"""
    sync_per_minibatch: float
    """makespan of ``n_minibatches`` joined sync mini-batches, divided by their number"""
    stale_per_minibatch: float
    """the same for 2bw (stash has the same order, so the same time)"""
    sync_bubble_rate: float
    """the bubble rate sync leaves (the paper's definition, over the joined mini-batches)"""
    saving: float
    """``1 - stale / sync``: the share of sync's time 2bw would save (negative: it would cost)"""

    def summary(self) -> str:
        """One line for a log or a terminal."""
        verdict = (
            f"2bw would save {self.saving:.1%} of the time per mini-batch, at one step of staleness"
            if self.saving > 0.005
            else "2bw would not be faster: use sync"
        )
        return (
            f"continuous, p={self.num_ranks}, m={self.n_microbatches}: sync leaves a bubble rate "
            f"of {self.sync_bubble_rate:.1%} ({self.sync_per_minibatch:.4g} per mini-batch, 2bw "
            f"{self.stale_per_minibatch:.4g}); {verdict}"
        )


def continuous_tradeoff(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    n_minibatches: int = N_MINIBATCHES,
) -> ContinuousTradeoff:
    """Simulate ``sync`` and ``2bw`` continuous plans joined over ``n_minibatches``."""
    costs = costs if costs is not None else Costs()
    per = {}
    bubble = 0.0
    for mode in ("sync", "2bw"):
        p = plan_continuous(
            num_ranks, n_microbatches, costs, memory_limit, n_minibatches=n_minibatches, mode=mode
        )
        r = simulate(p, costs)
        per[mode] = r.makespan / n_minibatches
        if mode == "sync":
            bubble = r.bubble_rate
    return ContinuousTradeoff(
        num_ranks=num_ranks,
        n_microbatches=n_microbatches,
        sync_per_minibatch=per["sync"],
        stale_per_minibatch=per["2bw"],
        sync_bubble_rate=bubble,
        saving=1.0 - per["2bw"] / per["sync"],
    )


__all__ = ["ContinuousTradeoff", "continuous_tradeoff"]
