"""Run F and B orders (with overlapped pairs) in simulated time and put each W where it costs
least: in a rank's idle time, or where the memory limit needs it (pure Python).

The input is, per rank, a sequence of *units*: one action (F or B) or an overlapped pair
``(F, B)``. A unit starts once its inputs are there; a rank that would wait first runs the
weight passes W of its earlier B's, oldest first, as long as each fits in the wait; before a unit
that would take the rank above the memory limit (an F's allocation, or a B's where B keeps more
than it frees) it runs as many W's as that needs. What is left
runs after the rank's last unit. This is the DualPipeV rule that "W fills the remaining bubbles".

A pair whose two halves do not fit together even after every waiting W (its F allocates before
its B's W can free anything) may be *split* (``split_pairs=True``): its B runs first, then the
W's the memory limit calls for, then its F. The order keeps the pair's place and loses one pair
instead of the whole plan (a B first needs no input the pair would not have waited for).

The times follow the simulator's model (:mod:`zbpipe.planning.simulator`), so the order returned
simulates to the times it was built with; every rank's decisions depend only on times already
fixed, so the result is the same whatever order the ranks are looked at (deterministic).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core import Action
from ..costs import StageCosts, pair_time
from ..rules import EPS, Value, makes, needs, within

#: one step of a rank's order: an action, or an overlapped pair (F, B or BW)
Unit = Action | tuple[Action, Action]


@dataclass
class _Rank:
    units: Sequence[Unit]
    done: int = 0
    free: float = 0.0
    memory: float = 0.0
    pending_w: deque[Action] | None = None
    order: list[Action] | None = None


def fill_weight_passes(
    units: Mapping[int, Sequence[Unit]],
    stage_costs: Sequence[StageCosts],
    placement: Mapping[int, int],
    memory_limit: float,
    *,
    split_pairs: bool = False,
) -> tuple[dict[int, list[Action]], list[tuple[Action, Action]]] | None:
    """Each rank's order with its W's placed, and the pairs; None if a rank cannot keep within
    ``memory_limit`` (no W left to free what an F needs) or the units deadlock.
    ``split_pairs``: a pair that does not fit runs as B, then F (module docstring)."""
    last = len(stage_costs) - 1
    ranks = {
        r: _Rank(units=list(us), pending_w=deque(), order=[]) for r, us in sorted(units.items())
    }
    made: dict[Value, tuple[int, float]] = {}  # value -> (rank, time it is there)
    pairs: list[tuple[Action, Action]] = []
    while True:
        progress = False
        for rank, st in ranks.items():
            while st.done < len(st.units):
                unit = st.units[st.done]
                acts = unit if isinstance(unit, tuple) else (unit,)
                ready = _ready(acts, rank, made, stage_costs, last, placement)
                if ready is None:
                    break
                if _run_unit(st, acts, ready, stage_costs, memory_limit, made, rank):
                    if isinstance(unit, tuple):
                        pairs.append(unit)
                elif not split_pairs or len(acts) == 1:
                    return None
                else:  # the pair does not fit: its B, then its F, each when its inputs are there
                    for a in (acts[1], acts[0]):
                        when = _ready((a,), rank, made, stage_costs, last, placement)
                        assert when is not None  # the pair's inputs were all there
                        if not _run_unit(st, (a,), when, stage_costs, memory_limit, made, rank):
                            return None
                st.done += 1
                progress = True
            if st.done == len(st.units) and st.pending_w:
                while st.pending_w:
                    _run_w(st, stage_costs)
                progress = True
        if all(st.done == len(st.units) for st in ranks.values()):
            return {r: st.order or [] for r, st in ranks.items()}, pairs
        if not progress:
            return None


def _ready(
    acts: Sequence[Action],
    rank: int,
    made: Mapping[Value, tuple[int, float]],
    stage_costs: Sequence[StageCosts],
    last: int,
    placement: Mapping[int, int],
) -> float | None:
    """When every input of ``acts`` is on ``rank``; None while one is not made yet."""
    ready = 0.0
    for a in acts:
        for value in needs(a, last):
            if value not in made:
                return None
            src_rank, t = made[value]
            delay = stage_costs[value[0]].comm if src_rank != rank else 0.0
            ready = max(ready, t + delay)
    return ready


def _run_unit(
    st: _Rank,
    acts: Sequence[Action],
    ready: float,
    stage_costs: Sequence[StageCosts],
    memory_limit: float,
    made: dict[Value, tuple[int, float]],
    rank: int,
) -> bool:
    """Run one unit on ``st`` after the W's it calls for; False if memory cannot allow it."""
    assert st.pending_w is not None and st.order is not None
    grows, running = 0.0, 0.0  # the unit's own peak over the memory before it
    for a in acts:
        running += stage_costs[a.stage].mem(a.kind)
        grows = max(grows, running)
    while not within(st.memory + grows, memory_limit) and st.pending_w:
        _run_w(st, stage_costs)  # memory first: free what the F needs
    if not within(st.memory + grows, memory_limit):
        return False
    while st.pending_w and st.free + stage_costs[st.pending_w[0].stage].w <= ready + EPS:
        _run_w(st, stage_costs)  # the rank would wait: a W fits in the gap
    if len(acts) == 2:
        f, b = acts
        duration = pair_time(stage_costs[f.stage], stage_costs[b.stage], b.kind)
    else:
        duration = stage_costs[acts[0].stage].time(acts[0].kind)
    st.free = max(st.free, ready) + duration
    for a in acts:
        st.order.append(a)
        st.memory += stage_costs[a.stage].mem(a.kind)
        for value in makes(a):
            made[value] = (rank, st.free)
        if a.kind == "B":
            st.pending_w.append(Action(a.stage, "W", a.microbatch))
    return True


def _run_w(st: _Rank, stage_costs: Sequence[StageCosts]) -> None:
    assert st.pending_w is not None and st.order is not None
    w = st.pending_w.popleft()
    st.order.append(w)
    st.free += stage_costs[w.stage].w
    st.memory += stage_costs[w.stage].mem("W")
