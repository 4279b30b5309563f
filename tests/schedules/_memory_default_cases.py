"""Per-rank bodies of the memory-by-default tests (module level: spawned processes import them)."""

from __future__ import annotations

import copy
import gc
import logging

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import zbpipe
from zbpipe.memory import SavedActivationMeter
from zbpipe.patching import undo_all
from zbpipe.planning import loop_placement, v_placement
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

#: a heavy head: the logits of one microbatch (4 x 16 x 1024 floats, 256 KiB) and the loss's
#: log-softmax weigh several blocks' activations (hidden 32)
HEAVY = dict(vocab=1024, hidden=32, seq=16, heads=2)
ROWS = 4


def _modules(world: int, v: bool) -> list[nn.Module]:
    """The same model (2 x world blocks) in world stages, or in 2 x world chunks for V."""
    n = 2 * world if v else world
    cfg = TinyGPTConfig(**HEAVY, blocks_per_stage=2 * world // n)
    return build_stages(cfg, n, seed=3)


def _batch(m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(TinyGPTConfig(**HEAVY), m * ROWS, step)


def torch_1f1b_peak(rank: int, world: int, m: int, steps: int = 2) -> int:
    """This rank's peak held for backward under torch's Schedule1F1B (the last of ``steps``)."""
    mods = _modules(world, v=False)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    meter = SavedActivationMeter()
    sched = Schedule1F1B(stage, m, loss_fn=meter.watch_loss(lm_loss))
    patches = meter.attach(stage)
    try:
        peak = 0
        for step in range(steps):
            ids, tgt = _batch(m, step)
            stage.submod.zero_grad(set_to_none=True)
            gc.collect()
            meter.begin_step()
            sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
            gc.collect()
            peak = meter.end_step().peak_bytes
        return peak
    finally:
        undo_all(patches)


def default_peak_and_grads(
    rank: int,
    world: int,
    name: str,
    split: str,
    m: int,
    steps: int = 2,
    keep_sched: bool = False,
    **options,
) -> dict:
    """One zbpipe schedule built with default arguments (plus ``options``): this rank's peak
    held for backward in the last of ``steps`` steps (the first re-planned for the measured
    bytes; the second and any later run the re-made plan), the largest gradient difference
    from the unpipelined reference in that step, the rank-0 log lines, and the plan's name."""
    cls = zbpipe.get_schedule_class(name)
    v = cls.layout == "v"
    mods = _modules(world, v)
    ref_mods = copy.deepcopy(mods)
    n = len(mods)
    placement = v_placement(world) if v else loop_placement(world, n)
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    sched = cls(stages, m, loss_fn=lm_loss, split=split, trace=False, **options)
    meter = SavedActivationMeter()
    sched.attach_meter(meter)
    peak, diff = 0, float("inf")
    for step in range(steps):
        ids, tgt = _batch(m, step)
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        gc.collect()
        meter.begin_step()
        sched.step(
            arg_mbs=[(x,) for x in ids.chunk(m)] if 0 in mine else None,
            target_mbs=list(tgt.chunk(m)) if n - 1 in mine else None,
        )
        gc.collect()
        peak = meter.end_step().peak_bytes
    ref = copy.deepcopy(nn.Sequential(*ref_mods))
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    diff = 0.0
    for s in mine:
        for p, q in zip(mods[s].parameters(), ref[s].parameters()):
            diff = max(diff, (p.grad - q.grad).abs().max().item())
    return {
        "peak": peak,
        "grad_diff": diff,
        "plan": sched.plan.name,
        "replanned": sched.memory_costs is not None,
        "unit_bytes": sched.memory_unit_bytes,
        "mem_f": None
        if sched.memory_costs is None
        else [f * sched.memory_unit_bytes for f in sched.memory_costs.mem_f],
        **({"sched": sched} if keep_sched else {}),
    }


def heavy_head_rows(rank: int, world: int, m: int, runs: list[tuple[str, str]]) -> dict:
    """torch 1F1B's peak, then every ``(schedule name, engine)`` of ``runs`` with defaults,
    then :func:`opted_out`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out: dict = {"torch": torch_1f1b_peak(rank, world, m)}
    for name, split in runs:
        out[(name, split)] = default_peak_and_grads(rank, world, name, split, m)
    out["opted_out"] = opted_out(rank, world, m)
    out["unpromised"] = unpromised(rank, world, m)
    return out


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def unpromised(rank: int, world: int, m: int) -> dict:
    """ZB-H1 with and without ``memory_promise``: this rank's peak in step 2, the gradient
    difference from the unpipelined reference, whether the plan is the one for equal bytes,
    and rank 0's ``zbpipe memory:`` lines."""
    out: dict = {}
    for promise in (True, False):
        lines = _Lines()
        logging.getLogger("zbpipe").addHandler(lines)
        try:
            row = default_peak_and_grads(
                rank, world, "ZBH1", "deferred", m, memory_promise=promise, keep_sched=True
            )
        finally:
            logging.getLogger("zbpipe").removeHandler(lines)
        sched = row.pop("sched")
        row["equal_bytes_plan"] = sched.plan.order == sched.equal_bytes_plan.order
        row["lines"] = [x for x in lines.lines if x.startswith("zbpipe memory:")]
        out[promise] = row
    return out


def opted_out(rank: int, world: int, m: int) -> dict:
    """``measure_memory=False``: no probe, no re-plan; the plan stays the equal-bytes one."""
    mods = _modules(world, v=False)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = zbpipe.ScheduleZBH1([stage], m, loss_fn=lm_loss, measure_memory=False)
    before = sched.plan
    for step in range(2):
        ids, tgt = _batch(m, step)
        sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
    return {"replanned": sched.memory_costs is not None, "same_plan": sched.plan is before}


def chooser_rows(rank: int, world: int, m: int, budgets: list[str]) -> dict:
    """Per byte budget: the plan ScheduleAuto chose after its measuring step, this rank's peak
    held in a later step, the costs it chose from (to compute the expected plan in the test),
    or the error it raised."""
    out: dict = {}
    for key in budgets:
        cls_name, _, budget = key.rpartition(":")  # "ZBAuto:620KiB": that class, else the chooser
        mods = _modules(world, v=False)
        stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
        build = zbpipe.get_schedule_class(cls_name) if cls_name else zbpipe.choose_schedule
        try:
            sched = build([stage], m, lm_loss, memory_limit=budget, trace=False)
        except ValueError as e:  # pragma: no cover - the budget is checked after the first step
            out[key] = {"error": f"construction: {e}"}
            continue
        meter = SavedActivationMeter()
        sched.attach_meter(meter)
        first_plan = sched.plan.name
        row: dict = {"first_plan": first_plan}
        try:
            for step in range(2):  # the measuring step, then one with the chosen plan
                ids, tgt = _batch(m, step)
                stage.submod.zero_grad(set_to_none=True)
                gc.collect()
                meter.begin_step()
                sched.step(
                    *((ids,) if rank == 0 else ()), target=tgt if rank == world - 1 else None
                )
                gc.collect()
                row.setdefault("peaks", []).append(meter.end_step().peak_bytes)
        except ValueError as e:
            row["error"] = str(e)
            row["steps_done"] = len(row.get("peaks", []))
        row["plan"] = sched.plan.name
        row["unit_bytes"] = sched.memory_unit_bytes
        costs = sched.memory_costs
        row["costs"] = (
            None
            if costs is None
            else {f: getattr(costs, f) for f in ("f", "b", "w", "comm", "mem_f", "mem_b", "mem_w")}
        )
        out[key] = row
    return out


def chooser_from_given_bytes(rank: int, world: int, m: int, budget: str, costs: dict) -> str:
    """``choose_schedule`` with bytes measured before (``costs=`` in bytes, ``unit_bytes=1``):
    the error, raised at construction, before any step; or the chosen plan's name."""
    mods = _modules(world, v=False)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    try:
        sched = zbpipe.choose_schedule(
            [stage], m, lm_loss, memory_limit=budget, costs=zbpipe.Costs(**costs), unit_bytes=1.0
        )
    except ValueError as e:
        return f"ValueError: {e}"
    return str(sched.plan.name)


def chooser_v_row(rank: int, world: int, m: int, budget: str) -> dict:
    """``choose_schedule`` on V-placed stages (two per rank): ScheduleAutoV's choice after its
    measuring step, the costs it chose from, this rank's peak in the next step and the largest
    gradient difference from the unpipelined reference there."""
    mods = _modules(world, v=True)
    ref_mods = copy.deepcopy(mods)
    n = len(mods)
    mine = sorted(s for s, r in v_placement(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    sched = zbpipe.choose_schedule(stages, m, lm_loss, memory_limit=budget, trace=False)
    meter = SavedActivationMeter()
    sched.attach_meter(meter)
    row: dict = {"cls": type(sched).__name__, "first_plan": sched.plan.name}
    for step in range(2):
        ids, tgt = _batch(m, step)
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        gc.collect()
        meter.begin_step()
        sched.step(*((ids,) if 0 in mine else ()), target=tgt if n - 1 in mine else None)
        gc.collect()
        row["peak"] = meter.end_step().peak_bytes
    ref = copy.deepcopy(nn.Sequential(*ref_mods))
    losses = [lm_loss(ref(x), y) for x, y in zip(ids.chunk(m), tgt.chunk(m))]
    (torch.stack(losses).sum() / m).backward()
    row["grad_diff"] = max(
        (p.grad - q.grad).abs().max().item()
        for s in mine
        for p, q in zip(mods[s].parameters(), ref[s].parameters())
    )
    row["plan"] = sched.plan.name
    row["unit_bytes"] = sched.memory_unit_bytes
    costs = sched.memory_costs
    row["costs"] = {
        f: getattr(costs, f) for f in ("f", "b", "w", "comm", "mem_f", "mem_b", "mem_w")
    }
    return row
