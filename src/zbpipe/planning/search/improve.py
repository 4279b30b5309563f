"""Local search over a valid plan: reorder a rank's actions while the simulated plan gets shorter.

Any family's plan can be polished (pure Python, no torch). The objective is the bubble rate's
denominator, the longest rank span, then the makespan: the bubble rate only gets lower and the
throughput never gets worse. A move keeps validity by construction (same-rank dependencies stay
in order), deadlock and the memory limit are checked per move, and a move is kept only if it
*strictly* improves the objective, so ``improve`` never returns a worse plan.

Moves, generated where the timeline shows waste (largest first):

* fill an idle gap with a later weight-gradient pass W of the same rank (its B already ran);
* move a W later, past the action it delays (a W in front of an F or B that was ready);
* swap the action after a gap with the next one (run what is ready first).

Re-simulation is the inner loop, so it runs on flat arrays with the dependencies resolved once
(action ids, fixed comm delays): reordering a rank never changes what an action depends on.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from itertools import accumulate

from ..core import Action, Plan
from ..costs import Costs
from ..rules import EPS, makes, needs, within

log = logging.getLogger(__name__)


class _Eval:
    """One simulation: per-action start/end, and the objective.

    The objective is (span, makespan, feed), compared in that order; ``feed`` (a sum over most
    actions) is computed only when a comparison gets that far, which most trials never do.
    """

    def __init__(
        self, start: list[float], end: list[float], head: tuple[float, float], feeders: list[int]
    ) -> None:
        self.start, self.end = start, end
        self.head = head
        """``(span, makespan)``, rounded: the objective without its tie-break."""
        self._feeders = feeders
        self._feed: float | None = None

    @property
    def feed(self) -> float:
        """The tie-break: F and B feed other actions, so finishing them earlier is progress even
        before it shortens the span (W feed nothing and are left free to move)."""
        if self._feed is None:
            self._feed = round(sum(map(self.end.__getitem__, self._feeders)), 6)
        return self._feed

    @property
    def key(self) -> tuple[float, float, float]:
        return (*self.head, self.feed)

    def better_than(self, other: _Eval) -> bool:
        """``self.key < other.key``, computing ``feed`` only on a tie of the rest."""
        if self.head != other.head:
            return self.head < other.head
        return self.feed < other.feed


class _Model:
    """A plan's actions as ids with fixed durations, dependencies and memory changes."""

    def __init__(self, plan: Plan, costs: Costs) -> None:
        costs.check(plan.num_stages)
        sc = [costs.stage(s) for s in range(plan.num_stages)]
        last = plan.num_stages - 1
        self.actions: list[Action] = []
        self.rank: list[int] = []
        self.order: list[list[int]] = []
        for r in range(plan.num_ranks):
            self.order.append(
                list(range(len(self.actions), len(self.actions) + len(plan.order[r])))
            )
            self.actions.extend(plan.order[r])
            self.rank.extend([r] * len(plan.order[r]))
        self.sc = sc
        # which action makes each value, by id (keyed by plain tuples: hashing an Action, a
        # dataclass, is a Python call)
        made_by = {v: i for i, a in enumerate(self.actions) for v in makes(a)}
        self.dur = [sc[a.stage].time(a.kind) for a in self.actions]
        self.deps: list[tuple[tuple[int, float], ...]] = []
        self.same_rank_deps: list[set[int]] = [set() for _ in self.actions]
        for i, a in enumerate(self.actions):
            deps = []
            for d in (made_by[v] for v in needs(a, last)):
                delay = 0.0 if self.rank[d] == self.rank[i] else sc[self.actions[d].stage].comm
                deps.append((d, delay))
                if self.rank[d] == self.rank[i]:
                    self.same_rank_deps[i].add(d)
            self.deps.append(tuple(deps))
        step = {a: i for seq in self.order for i, a in enumerate(seq)}
        # a same-rank input after its consumer is a rank waiting on itself (moves keep the order)
        self.waits_on_itself = any(step[d] > step[a] for a in step for d in self.same_rank_deps[a])
        self.is_w = [a.kind == "W" for a in self.actions]
        self.feeders = [i for i, a in enumerate(self.actions) if a.kind != "W"]
        self.mem_delta = [sc[a.stage].mem(a.kind) for a in self.actions]
        # For the simulation's inner loop, each action's input from another rank, if any (-1:
        # none) with its comm delay. There is at most one (rules.needs: a B's other input is its
        # own F), and a same-rank input needs no check: it runs earlier on the rank, so it is
        # simulated and ends no later than the previous action, where the action starts anyway.
        self.cross_dep = [-1] * len(self.actions)
        self.cross_lag = [0.0] * len(self.actions)
        for i, inputs in enumerate(self.deps):
            cross = [(d, delay) for d, delay in inputs if d not in self.same_rank_deps[i]]
            if len(cross) > 1:
                raise AssertionError(f"{self.actions[i]} waits on two other ranks")  # rules.needs
            if cross:
                self.cross_dep[i], self.cross_lag[i] = cross[0]

    def evaluate(
        self, order: list[list[int]], base: _Eval | None = None, since: float = 0.0
    ) -> _Eval | None:
        """Simulate ``order`` (a worklist over ranks, each action seen O(1) times); None: deadlock.

        Incremental: with ``base`` (the simulation of an order that differs only in actions that
        started at or after ``since`` there), every action that started before ``since`` keeps its
        time, because all its causes started earlier still; only the rest is re-simulated.
        """
        n = len(self.actions)
        p = len(order)
        pos = [0] * p
        free = [0.0] * p
        if base is None:
            start = [0.0] * n
            end = [-1.0] * n
        else:
            start, end = base.start[:], base.end[:]
            for r, seq in enumerate(order):
                i = bisect.bisect_left(seq, since, key=base.start.__getitem__)
                pos[r] = i
                free[r] = end[seq[i - 1]] if i > 0 else 0.0
                for a in seq[i:]:
                    end[a] = -1.0
        waiting: dict[int, list[int]] = {}
        todo = list(range(p))
        cross_dep, cross_lag, dur = self.cross_dep, self.cross_lag, self.dur
        while todo:
            r = todo.pop()
            seq = order[r]
            i, t = pos[r], free[r]
            n_r = len(seq)
            while i < n_r:
                a = seq[i]
                # start: the previous action's end, or later if the input from another rank
                # arrives later; an input not simulated yet (end -1) parks the rank until it is
                s = t
                d = cross_dep[a]
                if d >= 0:
                    e = end[d]
                    if e < 0.0:
                        waiting.setdefault(d, []).append(r)
                        break
                    e += cross_lag[a]
                    if e > s:
                        s = e
                t = s + dur[a]
                start[a] = s
                end[a] = t
                i += 1
                if a in waiting:
                    todo.extend(waiting.pop(a))
            pos[r], free[r] = i, t
        if any(pos[r] < len(order[r]) for r in range(len(order))):
            return None
        firsts = [start[seq[0]] for seq in order if seq]
        lasts = [end[seq[-1]] for seq in order if seq]
        span = max((end[seq[-1]] - start[seq[0]] for seq in order if seq), default=0.0)
        makespan = max(lasts, default=0.0) - min(firsts, default=0.0)
        return _Eval(start, end, (round(span, 9), round(makespan, 9)), self.feeders)

    def peak(self, seq: list[int]) -> float:
        """:func:`.rules.peak_memory` of ``seq``: the same prefix sums, from a per-action table."""
        return max(accumulate(map(self.mem_delta.__getitem__, seq), initial=0.0))


def _moved(seq: list[int], src: int, dst: int) -> list[int]:
    """``seq`` with the action at ``src`` moved to index ``dst`` (of the result)."""
    out = seq[:src] + seq[src + 1 :]
    out.insert(dst, seq[src])
    return out


def _can_move(model: _Model, seq: list[int], src: int, dst: int) -> bool:
    """A move keeps same-rank dependency order: nothing jumped over depends on or feeds it."""
    a = seq[src]
    if dst < src:
        return not any(x in model.same_rank_deps[a] for x in seq[dst:src])
    return not any(a in model.same_rank_deps[x] for x in seq[src + 1 : dst + 1])


def _critical_arcs(
    model: _Model, order: list[list[int]], ev: _Eval, index: list[int]
) -> list[tuple[int, int]]:
    """``(rank, index)`` of each same-rank arc on the critical path of the longest rank.

    Walk back from the last action of the longest rank through whatever made each action wait:
    where that is the previous action of the same rank (not a dependency), reordering can help.
    """
    spans = [(ev.end[seq[-1]] - ev.start[seq[0]], r) for r, seq in enumerate(order) if seq]
    _, r = max(spans)
    a = order[r][-1]
    arcs = []
    while True:
        q, i = model.rank[a], index[a]
        s = ev.start[a]
        nxt = -1
        for d, delay in model.deps[a]:
            if abs(ev.end[d] + delay - s) <= EPS:
                nxt = d
                break
        if nxt < 0 and i > 0 and abs(ev.end[order[q][i - 1]] - s) <= EPS:
            arcs.append((q, i))
            nxt = order[q][i - 1]
        if nxt < 0:
            return arcs
        a = nxt


def _candidate_moves(
    model: _Model, order: list[list[int]], ev: _Eval, index: list[int], per_round: int
) -> Iterator[tuple[int, int, int]]:
    """``(rank, src, dst)`` moves aimed at the critical path, the largest idle gaps, and ready work
    waiting behind other work."""
    # critical-path moves first: cheap to find, and most often the ones that shorten the plan
    for r, i in _critical_arcs(model, order, ev, index)[: 2 * per_round]:
        seq = order[r]
        yield (r, i, i - 1)  # the critical action overtakes its predecessor
        if model.is_w[seq[i - 1]]:  # or the W in its way goes further back
            for k in (2, 4, 8):
                if i - 1 + k < len(seq):
                    yield (r, i - 1, i - 1 + k)
            yield (r, i - 1, len(seq) - 1)
    spots: list[tuple[float, int, int, str]] = []  # (-waste, rank, index, what)
    start, end, is_w = ev.start, ev.end, model.is_w
    cross_dep, cross_lag, same_rank_deps = model.cross_dep, model.cross_lag, model.same_rank_deps
    for r, seq in enumerate(order):
        for i in range(1, len(seq)):
            a, prev = seq[i], seq[i - 1]
            gap = start[a] - end[prev]
            if gap > EPS:
                spots.append((-gap, r, i, "gap"))
            elif not is_w[a] and prev not in same_rank_deps[a]:
                # a ready F or B waiting behind another action: try running it first. Its input
                # from this rank ended before ``prev`` started, so only the other rank's counts.
                d = cross_dep[a]
                ready = end[d] + cross_lag[a] if d >= 0 else 0.0
                delay = start[a] - max(ready, start[prev])
                if delay > EPS:
                    spots.append((-delay, r, i - 1, "late"))
    spots.sort()
    for _, r, i, what in spots[:per_round]:
        seq = order[r]
        if what == "gap":
            # the first few later W whose B already ran on this rank (FIFO keeps memory low)
            found = 0
            for j in range(i + 1, len(seq)):
                if model.is_w[seq[j]]:
                    yield (r, j, i)
                    found += 1
                    if found == 2:
                        break
            if i + 1 < len(seq):
                yield (r, i + 1, i)  # run the next action first if it is ready
            yield (r, i - 1, i)  # or push the action before the gap past it
        else:
            yield (r, i + 1, i)  # the waiting action jumps ahead
            if model.is_w[seq[i]] and i + 2 < len(seq):
                yield (r, i, i + 2)  # or a W steps back past two


class _Budget:
    """Simulations spent, against a count and/or a wall-clock deadline."""

    def __init__(self, deadline: float | None, max_evals: int | None) -> None:
        self.deadline, self.max_evals, self.evals = deadline, max_evals, 1

    def left(self) -> bool:
        if self.max_evals is not None and self.evals >= self.max_evals:
            return False
        return self.deadline is None or time.perf_counter() < self.deadline


def _search(
    model: _Model, order: list[list[int]], ev: _Eval, limits: list[float], budget: _Budget
) -> tuple[list[list[int]], _Eval, int]:
    """First-improvement local search; returns the final order, its evaluation, moves accepted."""
    accepted, per_round = 0, 8
    tried: set[tuple[int, ...]] = set()
    index = [0] * len(model.actions)  # each action's position in its rank's order
    for seq in order:
        for i, a in enumerate(seq):
            index[a] = i
    while budget.left():
        improved = False
        for r, src, dst in _candidate_moves(model, order, ev, index, per_round):
            if not budget.left():
                break
            seq = order[r]
            if src == dst or not 0 <= dst < len(seq) or not _can_move(model, seq, src, dst):
                continue
            new_seq = _moved(seq, src, dst)
            sig = (r, *new_seq)
            if not within(model.peak(new_seq), limits[r]) or sig in tried:
                continue
            tried.add(sig)
            trial = order[:r] + [new_seq] + order[r + 1 :]
            new_ev = model.evaluate(trial, ev, ev.start[seq[min(src, dst)]])
            budget.evals += 1
            if new_ev is not None and new_ev.better_than(ev):
                order, ev, improved = trial, new_ev, True
                for i in range(min(src, dst), max(src, dst) + 1):
                    index[new_seq[i]] = i
                accepted += 1
                tried.clear()
                per_round = 8
                break
        if not improved:
            if per_round >= 64:
                break  # local optimum for every move we know
            per_round *= 4  # look further down the list of wasted spots before giving up
    return order, ev, accepted


def improve(
    plan: Plan,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    max_seconds: float | None = 1.0,
    max_evals: int | None = None,
) -> Plan:
    """Polish ``plan`` by local search; the result is never worse (span, then makespan) nor invalid.

    ``memory_limit`` (per rank) is kept; ``None`` keeps each rank at or below its peak in ``plan``.
    The search stops at a local optimum, after ``max_evals`` simulations, or after ``max_seconds``.
    A wall-clock budget makes the result depend on machine speed: plan generators that every rank
    runs must pass ``max_seconds=None`` and a ``max_evals`` budget so all ranks get the same plan.
    ``meta["improved_from"]`` records the input's name, span and makespan.
    """
    costs = costs or Costs()
    if max_seconds is None and max_evals is None:
        raise ValueError("improve needs a budget: give max_seconds or max_evals (or both)")
    deadline = None if max_seconds is None else time.perf_counter() + max_seconds
    model = _Model(plan, costs)
    order = [list(seq) for seq in model.order]
    ev = None if model.waits_on_itself else model.evaluate(order)
    if ev is None:
        raise ValueError(
            f"improve: plan {plan.name} deadlocks; give a valid plan (simulate() names the ranks)"
        )
    limits = [memory_limit if memory_limit is not None else model.peak(seq) for seq in order]
    first_key = ev.head
    budget = _Budget(deadline, max_evals)
    order, ev, accepted = _search(model, order, ev, limits, budget)
    evals = budget.evals
    if ev.head >= first_key:
        return plan  # tie-break progress alone is no reason to change the plan
    log.debug(
        "improve %s: span/makespan %s -> %s in %d moves, %d simulations",
        plan.name,
        first_key,
        ev.key,
        accepted,
        evals,
    )
    new_order = {r: tuple(model.actions[a] for a in seq) for r, seq in enumerate(order)}
    meta = dict(plan.meta)
    meta["improved_from"] = {
        "name": plan.name,
        "span": first_key[0],
        "makespan": first_key[1],
        "moves": accepted,
        "simulations": evals,
    }
    out = replace(plan, order=new_order, meta=meta)
    out.validate()
    return out
