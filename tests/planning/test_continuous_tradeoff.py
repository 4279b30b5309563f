"""``continuous_tradeoff``: what the simulator says 2bw's stream buys over sync (issue 29)."""

import pytest

from zbpipe.planning import Costs
from zbpipe.planning.continuous.tradeoff import continuous_tradeoff


def test_few_microbatches_sync_pays_the_round_trip_and_2bw_saves_it():
    """p = 4, m = 4 < 2p - 1, unit costs: sync continuous is N flushed ZB-H1 steps (15 per
    mini-batch, docs/use/continuous.md); the 2bw stream (1F1B, W after B) needs 3m = 12 per
    mini-batch plus its warm-up and drain spread over the 8 joined mini-batches."""
    t = continuous_tradeoff(4, 4)
    assert t.sync_per_minibatch == pytest.approx(15.0)
    assert 12.0 < t.stale_per_minibatch < t.sync_per_minibatch
    assert t.saving == pytest.approx(1 - t.stale_per_minibatch / 15.0)
    assert t.sync_bubble_rate > 0.1
    assert "2bw would save" in t.summary()


def test_enough_microbatches_sync_streams_and_2bw_buys_nothing():
    """m >= 2p - 1: sync's boundary is hidden by the deferred W passes (bubble 0)."""
    t = continuous_tradeoff(4, 8)
    assert t.sync_bubble_rate == pytest.approx(0.0)
    assert t.saving <= 0.005
    assert "use sync" in t.summary()


def test_costs_change_the_answer():
    """T_W < T_B leaves fewer W passes to fill sync's boundary with (docs' 8-rank example)."""
    t = continuous_tradeoff(8, 16, Costs(f=1, b=1.5, w=0.5, comm=0.1))
    assert t.saving > 0.1
