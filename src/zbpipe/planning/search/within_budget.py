"""The fastest schedule for a per-rank memory budget (pure Python).

Every candidate is planned for the same model and costs, simulated, and kept if its simulated
peak on every rank is within the budget; the shortest makespan wins (ties: the earlier in the
list, the simpler schedule). Loop placement (one stage per rank) offers 1F1B, ZB-H1, ZB-1p and
ZB-2p; V placement (rank ``r`` holds chunks ``r`` and ``2p - 1 - r``) offers ZB-V, V-Half and
V-Min. Which placement a run can use depends on how its stages were built, so a caller names
the layouts it has (``layouts=("loop",)`` for one stage per rank); with both, the answer says
which stages to build.

``costs`` describe the model cut into ``p`` stages (loop placement), ``v_costs`` the same model
cut into ``2p`` chunks (default: ``costs.split(2)``, each chunk half a stage). Memory is in any
one unit shared by both (bytes work). The result's :meth:`Choice.table` prints each candidate's
simulated makespan, bubble rate and peak.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..core import Layout, Plan
from ..costs import Costs
from ..registry import plan as build
from ..rules import EPS
from ..simulator import simulate

LOOP_CANDIDATES: tuple[str, ...] = ("1F1B", "ZBH1", "ZB1P", "ZB2P")
V_CANDIDATES: tuple[str, ...] = ("ZBV", "ZBVHalf", "ZBVMin")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One schedule as planned and simulated for the budget."""

    name: str
    layout: Layout
    makespan: float
    """Simulated step time, in the time unit of the costs (inf if it could not be planned)."""
    bubble_rate: float
    peak: float
    """The simulated peak of the busiest rank, in the memory unit of the costs."""
    fits: bool
    """Within the budget on every rank."""
    plan: Plan | None
    error: str | None = None
    """Why it could not be planned (its generator's message), if it could not."""


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The fastest candidate within the budget, and every candidate considered."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    memory_limit: float

    def table(self, unit_bytes: float | None = None) -> str:
        """One line per candidate: makespan, bubble rate, peak (in bytes if ``unit_bytes``)."""
        return format_table(self.candidates, self.memory_limit, unit_bytes, self.best.name)


def choose_plan(
    num_ranks: int,
    n_microbatches: int,
    memory_limit: float,
    costs: Costs | None = None,
    *,
    v_costs: Costs | None = None,
    layouts: Sequence[Layout] = ("loop", "v"),
    unit_bytes: float | None = None,
) -> Choice:
    """The fastest plan whose simulated per-rank peak is within ``memory_limit``.

    Raises ``ValueError`` when no candidate fits, naming the least peak any candidate needs
    (in bytes when ``unit_bytes``, the bytes of one memory unit, is given).
    """
    from ..budget import format_bytes

    def mem(x: float) -> str:
        return format_bytes(x * unit_bytes) if unit_bytes is not None else f"{x:.4g}"

    candidates = evaluate_candidates(
        num_ranks, n_microbatches, memory_limit, costs, v_costs=v_costs, layouts=layouts
    )
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        planned = [c for c in candidates if c.plan is not None]
        least = min(planned, key=lambda c: c.peak) if planned else None
        hint = (
            f"; the least any candidate needs is {mem(least.peak)} ({least.name})"
            if least is not None
            else ""
        )
        raise ValueError(
            f"no schedule fits memory_limit {mem(memory_limit)} per rank{hint}; raise the "
            "budget, use more pipeline ranks or smaller microbatches, or checkpoint "
            "activations\n" + format_table(candidates, memory_limit, unit_bytes, None)
        )
    best = min(fitting, key=lambda c: round(c.makespan, 9))  # min keeps the first of ties
    return Choice(best=best, candidates=tuple(candidates), memory_limit=memory_limit)


def evaluate_candidates(
    num_ranks: int,
    n_microbatches: int,
    memory_limit: float,
    costs: Costs | None = None,
    *,
    v_costs: Costs | None = None,
    layouts: Sequence[Layout] = ("loop", "v"),
    leave_out: Collection[str] = (),
) -> list[Candidate]:
    """Every candidate of ``layouts`` (but those named in ``leave_out``), planned at its own
    budget and simulated."""
    unknown = sorted(set(layouts) - {"loop", "v"})
    if unknown or not layouts:
        raise ValueError(f"layouts must be a non-empty subset of ('loop', 'v'), got {layouts!r}")
    if not memory_limit > 0:
        raise ValueError(f"memory_limit must be > 0, got {memory_limit!r}")
    loop_costs = costs if costs is not None else (v_costs.joined(2) if v_costs else Costs())
    chunk_costs = v_costs if v_costs is not None else loop_costs.split(2)
    out: list[Candidate] = []
    families: tuple[tuple[Layout, tuple[str, ...], Costs], ...] = (
        ("loop", LOOP_CANDIDATES, loop_costs),
        ("v", V_CANDIDATES, chunk_costs),
    )
    for layout, names, c in families:
        if layout not in layouts:
            continue
        for name in names:
            if name not in leave_out:
                out.append(_evaluate(name, layout, num_ranks, n_microbatches, c, memory_limit))
    return out


def _evaluate(name: str, layout: Layout, p: int, m: int, costs: Costs, limit: float) -> Candidate:
    try:
        planned = build(name, p, m, costs=costs)
    except ValueError as e:
        return Candidate(
            name=name,
            layout=layout,
            makespan=float("inf"),
            bubble_rate=1.0,
            peak=float("inf"),
            fits=False,
            plan=None,
            error=str(e),
        )
    r = simulate(planned, costs)
    peak = max(r.peak_memory.values())
    return Candidate(
        name=name,
        layout=layout,
        makespan=r.makespan,
        bubble_rate=r.bubble_rate,
        peak=peak,
        fits=peak <= limit * (1 + EPS) + EPS,
        plan=planned,
    )


def format_table(
    candidates: Sequence[Candidate],
    memory_limit: float,
    unit_bytes: float | None,
    chosen: str | None,
) -> str:
    """The candidates as aligned text lines (peaks in bytes when ``unit_bytes`` is given)."""
    from ..budget import format_bytes

    def mem(x: float) -> str:
        if x == float("inf"):
            return "-"
        return format_bytes(x * unit_bytes) if unit_bytes is not None else f"{x:.4g}"

    lines = [
        f"{'schedule':<9} {'layout':<6} {'makespan':>10} {'bubble':>7} {'peak':>12}  "
        f"budget {mem(memory_limit)}"
    ]
    for c in candidates:
        mark = "<- chosen" if c.name == chosen else ("fits" if c.fits else "over budget")
        if c.plan is None:
            mark = f"not plannable: {c.error}"
        lines.append(
            f"{c.name:<9} {c.layout:<6} {c.makespan:>10.4g} {c.bubble_rate:>7.1%} "
            f"{mem(c.peak):>12}  {mark}"
        )
    return "\n".join(lines)
