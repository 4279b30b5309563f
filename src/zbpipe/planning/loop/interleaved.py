"""Interleaved 1F1B (Narayanan et al., 2021): the plain order of the loop placement with several
stages per rank, and the yardstick its zero-bubble schedule is held to (pure Python).

``v`` stages (model chunks) per rank in loop placement: stage ``s`` on rank ``s % p``, so rank
``r`` holds stages ``r, r + p, ..., r + (v - 1) p``. Microbatches go through in *rounds* of
``g`` microbatches: a rank runs the forwards of one round on its first chunk, then the same
round on its second chunk, and so on, then the next round; backwards go the same way with the
chunks in reverse. Rank ``r`` runs ``(v - 1) g + 2 (p - 1 - r)`` warm-up forwards, then one
forward and one backward in turn, then the cool-down backwards.

**Microbatch counts.** As torch's ``ScheduleInterleaved1F1B`` (its "flexible" form): there are
``max(1, m // p)`` rounds, which must divide ``m``; a round holds ``g = m / rounds``
microbatches (``m = 8, p = 4``: two rounds of 4; ``m = 10, p = 4``: two rounds of 5;
``m = 3, p = 4``: one round of 3; ``m = 9, p = 4``: refused, 9 is not a multiple of 2). With
``m % p == 0`` it is the paper's schedule. The orders are torch's, action for action (a test
compares them), so the memory each rank holds is what torch's Interleaved1F1B holds.
"""

from __future__ import annotations

from ..core import Action, Plan, loop_placement, make_plan
from ..costs import Costs
from ..rules import check_sizes, peak_memory

#: the plain plan's name (schedules fall back to it; nobody plans it by name)
NAME = "Interleaved1F1B"


def round_size(num_ranks: int, n_microbatches: int) -> int:
    """``g``, the microbatches per round (the module docstring); a ``ValueError`` for a count
    the interleaved order cannot take, naming the counts it can."""
    p, m = num_ranks, n_microbatches
    rounds = max(1, m // p)
    if m % rounds:
        lower, upper = rounds * (m // rounds), rounds * (m // rounds + 1)
        raise ValueError(
            f"interleaved schedules need n_microbatches to be a multiple of the number of "
            f"rounds max(1, n_microbatches // num_ranks) = {rounds}, got {m} on {p} ranks; "
            f"use {lower} or {upper} (any multiple of {p} works)"
        )
    return m // rounds


def check_stages_per_rank(stages_per_rank: object) -> int:
    """``stages_per_rank`` as an int >= 2, else a ``ValueError`` saying what to use."""
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int):
        raise ValueError(f"stages_per_rank must be an int >= 2, got {stages_per_rank!r}")
    if stages_per_rank < 2:
        raise ValueError(
            f"stages_per_rank must be >= 2 for an interleaved plan, got {stages_per_rank}; "
            "with one stage per rank use 1F1B, ZBH1 or ZB1P"
        )
    return stages_per_rank


def interleaved_rank_order(
    rank: int,
    num_ranks: int,
    n_microbatches: int,
    stages_per_rank: int,
    backward: str = "BW",
    warmup_per_hop: int = 2,
) -> list[Action]:
    """Interleaved 1F1B's order of one rank (``backward``: ``"BW"``, or ``"B"`` for the F/B
    skeleton of a split backward). ``warmup_per_hop``: the warm-up forwards added per rank
    below this one (2 in interleaved 1F1B; 1 holds fewer microbatches, as torch's
    InterleavedZeroBubble does, and waits longer for the first gradient)."""
    p, m, v = num_ranks, n_microbatches, stages_per_rank
    g = round_size(p, m)
    total = m * v

    def action(k: int, kind: str) -> Action:
        # the k-th forward (backward) of this rank: round k // (g v), chunk (k // g) % v
        # (reversed for backwards), the (k % g)-th microbatch of that round
        chunk = (k // g) % v
        if kind != "F":
            chunk = v - 1 - chunk
        return Action(chunk * p + rank, kind, (k // (g * v)) * g + k % g)

    warmup = min((v - 1) * g + warmup_per_hop * (p - 1 - rank), total)
    # Phase 1, warm-up: every chunk but the last has a round in flight before the first
    # gradient comes back; two more forwards per rank below this one.
    order = [action(k, "F") for k in range(warmup)]
    # Phase 2, steady state: one forward, then one backward.
    for i in range(total - warmup):
        order += [action(warmup + i, "F"), action(i, backward)]
    # Phase 3, cool-down: the backwards left.
    order += [action(i, backward) for i in range(total - warmup, total)]
    return order


def interleaved_orders(
    num_ranks: int,
    n_microbatches: int,
    stages_per_rank: int,
    backward: str = "BW",
    warmup_per_hop: int = 2,
) -> dict[int, list[Action]]:
    """Every rank's interleaved 1F1B order (see :func:`interleaved_rank_order`)."""
    return {
        r: interleaved_rank_order(
            r, num_ranks, n_microbatches, stages_per_rank, backward, warmup_per_hop
        )
        for r in range(num_ranks)
    }


def with_w_after_b(order: list[Action]) -> list[Action]:
    """``order`` (with split backwards) with every W right after its B: the yardstick's way of
    counting a fused backward's memory, and a zero-bubble plan that is never slower."""
    out: list[Action] = []
    for a in order:
        out.append(a)
        if a.kind == "B":
            out.append(Action(a.stage, "W", a.microbatch))
    return out


def interleaved_rank_peaks(
    num_ranks: int, n_microbatches: int, stages_per_rank: int, costs: Costs
) -> dict[int, float]:
    """Interleaved 1F1B's peak activation memory on each rank, each backward held as B then its
    W at once (as :func:`zbpipe.planning.yardsticks.onef1b_rank_peaks` counts 1F1B's)."""
    p, v = num_ranks, stages_per_rank
    sc = costs.per_stage(p * v)
    skeleton = interleaved_orders(p, n_microbatches, v, backward="B")
    return {r: peak_memory(with_w_after_b(acts), sc) for r, acts in skeleton.items()}


def interleaved_peak(
    num_ranks: int, n_microbatches: int, stages_per_rank: int, costs: Costs
) -> float:
    """Interleaved 1F1B's peak, the max over ranks: the zero-bubble plan's memory promise."""
    return max(interleaved_rank_peaks(num_ranks, n_microbatches, stages_per_rank, costs).values())


def plan_interleaved_1f1b(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    stages_per_rank: int = 2,
) -> Plan:
    """Interleaved 1F1B with fused backwards (cost-oblivious; ``costs`` are only checked)."""
    check_sizes(num_ranks, n_microbatches)
    v = check_stages_per_rank(stages_per_rank)
    p = num_ranks
    if costs is not None:
        costs.check(p * v)
    order = interleaved_orders(p, n_microbatches, v)
    return make_plan(NAME, p, n_microbatches, loop_placement(p, p * v), order, stages_per_rank=v)
