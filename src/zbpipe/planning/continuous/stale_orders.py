"""Candidate orders of the stale continuous modes (``2bw``, ``stash``): streams across mini-batches.

A stale mode does not need the step of mini-batch ``k`` before the forwards of ``k + 1``, so its
order can be a stream: 1F1B over an endless sequence of microbatches, cut every ``m`` into the
warm-up / period / drain of :class:`~zbpipe.planning.continuous.periods.ContinuousParts`. Two knobs
per rank, each candidate scored by the simulator in
:func:`~zbpipe.planning.continuous.periods.continuous_parts`:

* the **warm-up** ``w_r = min(m, floor(d * (p - 1 - r)))`` forwards with ``d`` in {1, 1.5, 2}
  (2bw): more forwards ahead hide ``comm`` and jitter (the slack a real run needs), at more
  memory. stash keeps ``d = 1``: its staleness depends on the order (a forward uses the version
  current when it runs), and ``d = 1`` is PipeDream's (``p - 1 - s`` updates on stage ``s``);
* **W at the end of the mini-batch** on the ranks ``>= first_deferred``: a period of
  ``F B F B ... W W`` instead of ``F B W F B W``. The B passes then reach the previous rank sooner,
  which shortens the stream's drain: with ``p = 2``, ``m = 2`` and unit costs the stream ends one
  unit after the last rank's work instead of two (``6N + 1`` instead of ``6N + 2`` for N
  mini-batches, the ``6N + 1`` of sync's best plan; the first unit, the last rank waiting for its
  first forward, no order avoids). The W passes stay inside their mini-batch's period, so the
  version rules (2bw: forwards of ``k + 2`` after the step of ``k``) hold as before; the memory
  limit is checked by the caller like any plan's.

Which ranks can run 2bw on their master weights (:func:`minibatches_apart`): where a rank's
mini-batches do not overlap in its order (the last rank of every stream order here: no forward
runs ahead of it), mini-batch ``k`` runs all its passes before any pass of ``k + 1``. There the
version ``k`` needs (``k - 1``) can be the master itself, if that rank applies the update of
``k - 1`` where the update of ``k`` would have run (after ``k``'s last W): each update one
mini-batch later, each gradient held that long, no copy of the weights.

Pure Python: plan data only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ..core import Action
from ..costs import Costs, StageCosts

Orders = dict[int, tuple[Action, ...]]
#: warm-up factors d (w_r = min(m, floor(d * (p - 1 - r))))
WARMUP_FACTORS = (1.0, 1.5, 2.0)


def stream_parts(
    p: int, m: int, warmups: Sequence[int], deferred: Sequence[bool] | None = None
) -> tuple[Orders, Orders, Orders]:
    """1F1B over an endless stream of microbatches, cut every ``m``: (warm-up, period, drain).

    Rank ``r`` runs ``warmups[r]`` forwards ahead; with ``deferred[r]`` its W passes of a
    mini-batch run together at the end of its period (else each right after its B). The drain is
    the period without the next mini-batch's forwards.
    """
    warmup, period, drain = {}, {}, {}
    for r in range(p):
        w = warmups[r]
        units = [(Action(r, "F", i + w), Action(r, "B", i)) for i in range(m)]
        ws = [Action(r, "W", i) for i in range(m)]
        if deferred is not None and deferred[r]:
            acts = [a for unit in units for a in unit] + ws
        else:
            acts = [a for unit, wa in zip(units, ws) for a in (*unit, wa)]
        warmup[r] = tuple(Action(r, "F", j) for j in range(w))
        period[r] = tuple(acts)
        drain[r] = tuple(a for a in acts if not (a.kind == "F" and a.microbatch >= m))
    return warmup, period, drain


def stream_candidates(
    p: int, m: int, factors: Sequence[float] = WARMUP_FACTORS
) -> list[tuple[str, tuple[Orders, Orders, Orders]]]:
    """The stream orders to score: each warm-up factor in ``factors``, with W after B everywhere,
    deferred on the last rank only, or deferred on every rank. Deterministic, no duplicates."""
    out = []
    seen = set()
    for d in factors:
        warmups = tuple(min(m, math.floor(d * (p - 1 - r))) for r in range(p))
        for name, first in (("", p), ("-lastW", p - 1), ("-allW", 0)):
            deferred = tuple(r >= first for r in range(p))
            if (warmups, deferred) in seen:
                continue
            seen.add((warmups, deferred))
            out.append((f"stream-warmup-x{d:g}{name}", stream_parts(p, m, warmups, deferred)))
    return out


def minibatches_apart(order: Sequence[Action], m: int) -> bool:
    """Whether every pass of mini-batch ``k`` comes before every pass of ``k + 1`` in ``order``
    (one rank's joined order; mini-batch = microbatch // ``m``): the mini-batch index never
    goes down along the order. Such a rank can hold 2bw's one version on its master weights by
    applying each update one mini-batch late (see the module docstring)."""
    if m < 1:
        raise ValueError(f"minibatches_apart: m must be >= 1, got {m}")
    latest = 0
    for a in order:
        k = a.microbatch // m
        if k < latest:
            return False
        latest = k
    return True


def with_late_messages(costs: Costs, stage_costs: Sequence[StageCosts]) -> Costs:
    """``costs`` with every message a quarter of the largest forward late: the tie-break between
    orders equal at the given ``comm`` (the one with more slack wins a real run's jitter)."""
    extra = 0.25 * max(st.f for st in stage_costs)
    comm = costs.comm
    late: float | tuple[float, ...] = (
        comm + extra if isinstance(comm, (int, float)) else tuple(c + extra for c in comm)
    )
    return dataclasses.replace(costs, comm=late)


__all__ = [
    "WARMUP_FACTORS",
    "minibatches_apart",
    "stream_candidates",
    "stream_parts",
    "with_late_messages",
]
