"""Per-rank body of ``test_no_growth_across_steps``: many steps of a schedule, then a count.

After a counted step (and ``gc.collect()``) two independent counts, both of distinct storages:

* ``saved``: storages autograd saved during any step so far and still alive
  (``_saved_census.SavedCensus``, one census across all steps: a tensor saved in step 3 and
  alive after step 9 counts);
* ``tensors``: storages of every tensor the garbage collector can reach.

Left out of both: module state (parameters, buffers, their ``.grad``), which lives on by design.
``saved`` also reports the storages not in torch's reused receive buffers
(``_saved_census.stage_input_buffers``): what a step should have freed and did not.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

import zbpipe
from tests.memory import _saved_census as census
from tests.schedules._losses import mse
from zbpipe._compat import with_local_stage_init
from zbpipe.memory import SavedActivationMeter
from zbpipe.planning import v_placement
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

M = 4
HIDDEN, ROWS = 32, 8  # the Linear chain: small, so 20 steps cost little
GPT = TinyGPTConfig(tricky=True)
TORCH_ZBV = "torch:ScheduleZBVZeroBubble"  # torch's own, with the meter attached to its stages


def _linear_chain(n_stages: int) -> tuple[list[nn.Module], Callable, Callable]:
    torch.manual_seed(0)
    mods = [
        nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
        for _ in range(n_stages)
    ]

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(k)
        x = torch.randn(M * ROWS, HIDDEN, generator=g)
        return x, torch.randn(M * ROWS, HIDDEN, generator=g)

    return mods, mse, batch


def _gpt(n_stages: int, tied: bool) -> tuple[list[nn.Module], Callable, Callable]:
    mods = build_stages(GPT, n_stages, seed=0)
    if tied:  # the output head reads the embedding's weight: one Parameter on two stages
        mods[-1][-1].lm.weight = mods[0][0].tok.weight
    return mods, lm_loss, lambda k: synthetic_batch(GPT, batch=2 * M, step=k)


MODELS: dict[str, Callable[[int], tuple[list[nn.Module], Callable, Callable]]] = {
    "linear": _linear_chain,
    "gpt": lambda n: _gpt(n, tied=False),
    "gpt-tied": lambda n: _gpt(n, tied=True),
}


def _build(rank: int, world: int, name: str, options: dict, model: str, metered: bool):
    """This rank's stages and the schedule; the meter (or None)."""
    if name == TORCH_ZBV:
        # torch 2.11's own stage set-up sends to the neighbour stage on its own rank, which
        # gloo cannot: zbpipe's fix of that one-time set-up (torch's class on >= 2.13)
        cls = with_local_stage_init(ScheduleZBVZeroBubble)
        n_stages, placement = 2 * world, v_placement(world)
    else:
        cls = getattr(zbpipe, name)
        n_stages = world * cls.stages_per_rank
        placement = cls.stage_index_to_rank(world)
    mods, loss_fn, batch = MODELS[model](n_stages)
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = [PipelineStage(mods[s], s, n_stages, torch.device("cpu")) for s in mine]
    sched = cls(stages, M, loss_fn=loss_fn, **options)
    meter = SavedActivationMeter() if metered else None
    if meter is not None and name == TORCH_ZBV:
        for st in stages:
            meter.attach(st)
    elif meter is not None:
        sched.attach_meter(meter)
    first, last = 0 in mine, n_stages - 1 in mine
    return sched, stages, batch, meter, first, last


def _state_storages(stages: list[Any]) -> set[int]:
    state = census.module_state_storages(st.submod for st in stages)
    grads = (p.grad for st in stages for p in st.submod.parameters() if p.grad is not None)
    return state | {g.untyped_storage().data_ptr() for g in grads}


def _tensor_storages(exclude: set[int]) -> int:
    ptrs = {
        s.data_ptr()
        for obj in gc.get_objects()
        # issubclass(type(...)): isinstance would ask a deprecated torch alias for its __class__
        if issubclass(type(obj), torch.Tensor) and (s := census._storage(obj)) is not None
    }
    return len(ptrs - exclude - {0})


def counts_per_step(
    rank: int, world: int, cases: list[tuple[str, dict, str, bool]], steps: int, counted: list[int]
) -> list[dict]:
    """Per case ``(schedule, options, model, metered)``: the counts after each step in ``counted``.

    Each step is a training step as a user writes it (``zero_grad``, ``step`` with a fresh
    batch, an optimizer step). ``metered``: a :class:`SavedActivationMeter` watches (it must
    change no lifetime); its live bytes are returned too.
    """
    with frozen_gc():
        return [_count_case(rank, world, case, steps, counted) for case in cases]


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """What exists now (torch, zbpipe, imported modules) is left out of collections and counts:
    they take milliseconds instead of a second."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # collected at exit as usual (a frozen extension object is reported leaked)


def _count_case(
    rank: int, world: int, case: tuple[str, dict, str, bool], steps: int, counted: list[int]
) -> dict:
    name, options, model, metered = case
    start = time.perf_counter()
    sched, stages, batch, meter, first, last = _build(rank, world, name, options, model, metered)
    params = {id(p): p for st in stages for p in st.submod.parameters()}  # a tied one once
    opt = torch.optim.SGD(list(params.values()), lr=1e-3)
    rows = []
    with census.SavedCensus() as saved:
        for k in range(steps):
            x, y = batch(k)
            opt.zero_grad()
            sched.step(*((x,) if first else ()), target=y if last else None, losses=[])
            opt.step()
            del x, y
            if k in counted:
                gc.collect()
                state = _state_storages(stages)
                rows.append(
                    {
                        "step": k,
                        "saved": len(saved.alive(state)),
                        "left": saved.alive(state | census.stage_input_buffers(stages)),
                        "tensors": _tensor_storages(state),
                        "meter_live": meter.live_bytes if meter is not None else 0,
                    }
                )
    label = f"{name} {options} {model}" + (" metered" if metered else "")
    return {"case": label, "rows": rows, "seconds": time.perf_counter() - start}
