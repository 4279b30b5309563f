"""Profile-guided re-planning: measure real per-stage costs, agree on them, re-plan identically.

This module measures; :mod:`zbpipe.schedules.replan` is the runtime side that re-plans.

A schedule built with ``costs="profile"`` starts with the plan for equal costs. It skips
``warmup_steps`` steps (the first step infers shapes and warms allocators), records the traced
F, B, W (and BW) spans of the next ``profile_steps`` steps, then, at the end of the last of
those steps and on every pipeline rank together:

1. each rank takes the median duration of every kind of pass of *its own* stages (the tracer
   starts a span after its receive completed, so waiting on a neighbour is not counted);
2. each rank times a few ping-pong exchanges of its stages' real message size with the
   neighbouring rank (the pipeline's own receive waits mix transfer time with bubbles, so the
   trace cannot tell them apart); half the fastest round trip is ``comm`` of that stage;
3. the values are rounded to ``digits`` significant digits (in milliseconds) and exchanged
   with one ``all_gather_object`` over the pipeline group, so every rank holds the same list;
4. every rank builds the plan for those costs (generators are deterministic) and the ranks
   exchange its fingerprint once; any difference, or a rank that failed to plan, raises on
   every rank (never a silent divergence, never a hang);
5. the schedule switches to the new plan (unless it simulates slower than the old one under
   the measured costs) and logs one info line (see ``docs/use/profiling.md``).

:func:`measure_stage_costs` is the same measurement for offline use on recorded events.

Memory (``ProfileConfig.memory``, on by default): over the same steps, each rank also records
what one microbatch of each of its stages holds right after F and right after B, in bytes
(:mod:`zbpipe.memory.probe`: saved tensors, the output, the engine's queue or recorded
gradients), under the engine in use. Per stage, ``mem_f`` is the median after F, ``mem_b`` the
change from there to after B, ``mem_w`` frees the rest; all three are divided by the mean
``mem_f`` over stages, so one memory unit is one microbatch of an average stage (what it was
before the measurement, for equal stages) and a numeric ``memory_limit`` keeps its meaning.
Every plan's memory budget (1F1B's peak for ZB-H1, ZB-1p and ZB-V, the V-Half and V-Min
formulas) is then a budget in measured bytes: a heavy head stage is no longer planned to hold
as many microbatches as a light one. The log line gives the chosen plan's predicted peak.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..planning import KINDS, Costs


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """How ``costs="profile"`` measures. The defaults suit a training run of any length."""

    warmup_steps: int = 1
    """Steps run on the equal-cost plan before measuring (the first step infers shapes)."""
    profile_steps: int = 2
    """Steps whose traced passes are measured; the re-plan happens at the end of the last one."""
    digits: int = 3
    """Significant digits the measured costs are rounded to, so re-runs give the same plan."""
    unit: float = 1e-3
    """Seconds per cost unit: 1e-3 gives costs (and logged makespans) in milliseconds."""
    comm: Literal["measure"] | float = "measure"
    """``"measure"``: time ping-pong messages of the real activation size; or a fixed time in
    ``unit``.
    """
    comm_repeats: int = 5
    """Timed round trips per link (after one untimed one); half the fastest is ``comm``."""
    memory: bool = True
    """Measure what each stage's microbatch holds after F and B and plan with it (the module
    docstring); False keeps one memory unit per microbatch of any stage."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "profile_steps", "digits", "comm_repeats"):
            value = getattr(self, name)
            low = 0 if name == "warmup_steps" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ProfileConfig.{name} must be an int >= {low}, got {value!r}")
        if not (isinstance(self.unit, (int, float)) and self.unit > 0):
            raise ValueError(
                f"ProfileConfig.unit must be seconds per cost unit (> 0), got {self.unit!r}"
            )
        if not isinstance(self.memory, bool):
            raise ValueError(f"ProfileConfig.memory must be True or False, got {self.memory!r}")
        if self.comm != "measure" and not (isinstance(self.comm, (int, float)) and self.comm >= 0):
            raise ValueError(
                f"ProfileConfig.comm must be 'measure' or a time >= 0, got {self.comm!r}"
            )


# ---------------------------------------------------------------------------- pure measurement
def round_sig(x: float, digits: int) -> float:
    """``x`` rounded to ``digits`` significant digits (0 stays 0)."""
    return 0.0 if x == 0 else float(f"{x:.{digits}g}")


def _flatten(trace_events: Any) -> list[Any]:
    events = getattr(trace_events, "events", trace_events)  # a zbpipe.observe.trace.Trace
    if isinstance(events, Mapping):  # {rank: [Event, ...]}
        return [e for evs in events.values() for e in evs]
    return list(events)


def stage_medians(
    trace_events: Any, stages: Iterable[int] | None = None
) -> dict[int, dict[str, float]]:
    """Median duration (seconds) of each kind of pass, per stage: ``{stage: {kind: median}}``;
    an event's ``waited`` (its own collectives) is not counted (:func:`stage_waits` is).

    ``trace_events``: events with ``kind``, ``stage``, ``start``, ``end`` (a list, a
    ``{rank: events}`` mapping or a :class:`zbpipe.observe.trace.Trace`). Only ``stages`` are kept
    if given.
    """
    keep = None if stages is None else set(stages)
    durations: dict[int, dict[str, list[float]]] = {}
    for e in _flatten(trace_events):
        if e.kind not in KINDS or (keep is not None and e.stage not in keep):
            continue
        computed = e.end - e.start - getattr(e, "waited", 0.0)  # (not waiting on collectives)
        durations.setdefault(e.stage, {}).setdefault(e.kind, []).append(computed)
    return {
        s: {k: statistics.median(v) for k, v in sorted(kinds.items())}
        for s, kinds in sorted(durations.items())
    }


def stage_waits(trace_events: Any, stages: Iterable[int] | None = None) -> dict[int, float]:
    """Median time (seconds) an F or B of each stage waited for its own collectives (``Event
    .waited``, the communication points' all-to-alls; 0 for a stage without any): ``Costs.a2a``.
    Pass only events whose waits were not hidden by other work (not an interleaved pair's)."""
    keep = None if stages is None else set(stages)
    waits: dict[int, list[float]] = {}
    for e in _flatten(trace_events):
        if e.kind in ("F", "B") and (keep is None or e.stage in keep):
            waits.setdefault(e.stage, []).append(getattr(e, "waited", 0.0))
    return {s: statistics.median(w) for s, w in sorted(waits.items())}


def costs_from_medians(
    medians: Mapping[int, Mapping[str, float]],
    num_stages: int,
    comm: float | Sequence[float] = 0.0,
    *,
    unit: float = 1e-3,
    digits: int | None = None,
) -> Costs:
    """Per-stage ``Costs`` from per-stage medians in seconds (times divided by ``unit``).

    A stage with B and W measured uses them; a stage measured only with a fused backward BW
    (e.g. under 1F1B) gets ``b = w = BW / 2`` (the split cannot be seen from a fused pass).
    ``comm`` is in seconds, one value for all stages or one per stage. A stage's ``"a2a"``
    entry (:func:`stage_waits`) is its ``Costs.a2a``.
    """
    comms = list(comm) if isinstance(comm, (list, tuple)) else [float(comm)] * num_stages
    if len(comms) != num_stages:
        raise ValueError(
            f"comm has {len(comms)} values but there are {num_stages} stages; give one per stage"
        )
    fix = (lambda x: x / unit) if digits is None else (lambda x: round_sig(x / unit, digits))
    f, b, w, a2a = [], [], [], []
    for s in range(num_stages):
        m = medians.get(s, {})
        if "F" not in m or not (("B" in m and "W" in m) or "BW" in m):
            raise ValueError(
                f"no F and B/W (or BW) measurements for stage {s} (have {sorted(m)}); "
                "pass the events of every stage, from at least one full step"
            )
        bs, ws = (m["B"], m["W"]) if "B" in m and "W" in m else (m["BW"] / 2, m["BW"] / 2)
        f.append(fix(m["F"]))
        b.append(fix(bs))
        w.append(fix(ws))
        a2a.append(fix(m.get("a2a", 0.0)))
    return Costs(f=f, b=b, w=w, comm=[fix(c) for c in comms], a2a=a2a)


def memory_costs(
    held: Mapping[int, Mapping[str, float]], num_stages: int, digits: int | None = None
) -> tuple[dict[str, list[float]], float] | None:
    """``Costs`` memory fields from the bytes a microbatch holds after F and after B, per stage.

    ``held``: ``{stage: {"F": bytes, "B": bytes}}`` (:meth:`zbpipe.memory.probe.MemoryProbe
    .medians`); a stage without a B measurement (its backward always ran fused) is taken to
    hold everything until W. Returns ``({"mem_f": [...], "mem_b": [...], "mem_w": [...]},
    bytes per unit)``, the unit being the mean ``mem_f`` over stages, or None if a stage has no
    F measurement or nothing was held at all.
    """
    if any("F" not in held.get(s, {}) for s in range(num_stages)):
        return None
    unit = sum(held[s]["F"] for s in range(num_stages)) / num_stages
    if unit <= 0:
        return None
    fix = (lambda x: x / unit) if digits is None else (lambda x: round_sig(x / unit, digits))
    fields: dict[str, list[float]] = {"mem_f": [], "mem_b": [], "mem_w": []}
    for s in range(num_stages):
        after_f = fix(held[s]["F"])
        after_b = fix(held[s].get("B", held[s]["F"]))
        fields["mem_f"].append(after_f)
        fields["mem_b"].append(after_b - after_f)
        fields["mem_w"].append(-after_b)
    return fields, unit


def measure_stage_costs(
    trace_events: Any,
    num_stages: int,
    *,
    comm: float | Sequence[float] = 0.0,
    unit: float = 1e-3,
    digits: int | None = None,
) -> Costs:
    """Per-stage costs from recorded compute events (offline: ``Tracer.events``, ``Trace``, ...).

    F, B, W of each stage are the medians of its traced spans, in units of ``unit`` seconds
    (default milliseconds); ``comm`` (seconds) is not in a compute trace and is passed in.
    ``digits`` rounds to that many significant digits. Raises ``ValueError`` naming a stage
    without measurements.
    """
    return costs_from_medians(
        stage_medians(trace_events), num_stages, comm, unit=unit, digits=digits
    )


# ---------------------------------------------------------------------------- collectives
def _comm_partner(stage_index: int, placement: Mapping[int, int]) -> int | None:
    """The stage this stage sends to on another rank (activation forward, else gradient back)."""
    for other in (stage_index + 1, stage_index - 1):
        if other in placement and placement[other] != placement[stage_index]:
            return other
    return None


def measure_comm(
    stages: Sequence[Any], placement: Mapping[int, int], group: Any, repeats: int
) -> dict[int, float]:
    """Seconds per message for each local stage: half the fastest of ``repeats`` timed round trips
    of its real message size.

    A collective: every rank of ``group`` calls it. A stage's message is its output activation
    when it sends forward to another rank, else the gradient of its input (same size as the
    input). Links are measured one at a time in stage order, so every rank meets its partners
    in the same order (no deadlock). Stages with no neighbour on another rank get 0.
    """
    import torch
    import torch.distributed as dist

    from .. import _compat as C

    rank = dist.get_rank(group)
    local: list[tuple[int, int, int]] = []
    for st in stages:
        other = _comm_partner(st.stage_index, placement)
        if other is not None:
            which = "outputs" if other == st.stage_index + 1 else "inputs"
            local.append(
                (st.stage_index, placement[other], max(1, C.stage_message_bytes(st, which)))
            )
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    links = sorted(link for part in gathered for link in part)
    out = {st.stage_index: 0.0 for st in stages}
    for s, partner, nbytes in links:
        sender = placement[s]
        if rank not in (sender, partner):
            continue
        buf = torch.empty(nbytes, dtype=torch.uint8)
        rtts = []
        for i in range(repeats + 1):  # the first round trip sets up the connection: untimed
            if rank == sender:
                t0 = time.perf_counter()
                dist.send(buf, group=group, group_dst=partner)
                dist.recv(buf, group=group, group_src=partner)
                if i:
                    rtts.append(time.perf_counter() - t0)
            else:
                dist.recv(buf, group=group, group_src=sender)
                dist.send(buf, group=group, group_dst=sender)
        if rank == sender:
            # The fastest round trip, not the median: on an oversubscribed CPU host some round
            # trips take a scheduler tick (~4 ms here, against ~0.04 ms) because a process was
            # asleep; that is CPU contention, which compute spans see too, not link time.
            out[s] = min(rtts) / 2
    return out


def gather_stage_values(local: Mapping[int, Any], group: Any) -> dict[int, Any]:
    """Every rank's ``{stage: value}`` merged; identical on every rank of every replica.

    One ``all_gather_object``. A pipeline's replicas (its data-, expert- or context-parallel
    copies: ranks outside ``group`` holding the same stage indices) must plan alike, or the
    collectives between them (an expert all-to-all, FSDP's gathers) pair one replica's forward
    with another's backward. So where ``group`` is smaller than the default group, the values
    are gathered over the default group (every rank runs a replica of this pipeline, as under
    torchtitan) and a stage several replicas measured takes the largest value, key by key
    (:func:`_largest`): the plan budgets the heaviest replica.
    """
    import torch.distributed as dist

    everyone = dist.get_world_size(group) < dist.get_world_size()
    over = dist.group.WORLD if everyone else group
    gathered: list[Any] = [None] * dist.get_world_size(over)
    dist.all_gather_object(gathered, dict(local), group=over)
    merged: dict[int, Any] = {}
    for part in gathered:
        for stage, value in part.items():
            merged[stage] = value if stage not in merged else _largest(merged[stage], value)
    return dict(sorted(merged.items()))


def _largest(a: Any, b: Any) -> Any:
    """The larger of two measurements: a number, or ``{kind: number}`` compared key by key."""
    if isinstance(a, Mapping):
        return {
            k: _largest(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}
        }
    return max(a, b)
