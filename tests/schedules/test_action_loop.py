"""zbpipe's action loop (zbpipe.schedules.action_loop): bound once, run per step, observable.

One gloo rank holding the whole pipeline (a stage of Linear + GELU + LayerNorm layers, m = 4),
three steps per case so the deferred Linears' output hook runs too (it starts at a schedule's
second step). The reference for gradients is the same model's plain loop, ``loss / m`` backward
per microbatch (the scaling torch's schedules apply); the tolerance is fp32 rounding, because a
fused BW through the store adds each weight GEMM into ``.grad`` inside the GEMM. The expected
profiler ranges are written from the plan (``zbpipe.plan``, the W after its own B fused), not
read from the runtime.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import pytest
import torch
from torch import nn

from tests.schedules._losses import mse
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

M = 4
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(M * 2, 16), torch.randn(M * 2, 8)


def _reference_grads() -> dict[str, torch.Tensor]:
    ref = _model()
    x, y = _data()
    for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True):
        (mse(ref(xs), ys) / M).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _worst(model: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    return max(
        ((p.grad - ref[n]).abs().max() / ref[n].abs().max()).item()
        for n, p in model.named_parameters()
    )


def _train(sched_cls: type, model: nn.Module, steps: int = STEPS, **options) -> tuple:
    from torch.distributed.pipelining import PipelineStage

    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    sched = sched_cls([stage], M, loss_fn=mse, **options)
    x, y = _data()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        sched.step(x, target=y)
    return sched, x, y


def _profiled(rank: int, world: int) -> dict:
    """Ranges under a profiler, none without one, and the gradients of that profiled step."""
    import zbpipe
    from zbpipe import _compat as C

    torch.set_num_threads(1)
    model = _model()
    sched, x, y = _train(zbpipe.ScheduleZBH1, model)
    opened = []
    real_range = C.profiler_range
    C.profiler_range = lambda name: opened.append(name) or real_range(name)  # type: ignore
    try:
        model.zero_grad(set_to_none=True)
        sched.step(x, target=y)  # no profiler: no range
        without = list(opened)
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sched.step(x, target=y)
    finally:
        C.profiler_range = real_range  # type: ignore
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    names = [e["name"] for e in events if str(e.get("name", "")).startswith("PP:")]
    return {"without": without, "names": names, "worst": _worst(model, _reference_grads())}


def _custom_function(rank: int, world: int) -> dict:
    """A function registered with torch's register_custom_function runs in place of zbpipe's
    call (and may call the table's own handler, as code wrapping torch's table does)."""
    import zbpipe
    from zbpipe import _compat as C

    torch.set_num_threads(1)
    model = _model()
    from torch.distributed.pipelining import PipelineStage

    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    sched = zbpipe.Schedule1F1BMulti([stage], M, loss_fn=mse)
    own = C.custom_functions(sched)[C.FORWARD]
    seen = []

    def logged(action, ctx):
        seen.append((action.microbatch_index, ctx.arg_mbs is not None))
        own(action, ctx)

    sched.register_custom_function(C.FORWARD, logged)
    x, y = _data()
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        sched.step(x, target=y)
    return {"seen": seen, "worst": _worst(model, _reference_grads())}


def _bound_once(rank: int, world: int) -> dict:
    """A subclass extends the table with its own binder: called once per action, at the first
    step (and again after a re-plan), never per step."""
    import zbpipe
    from zbpipe import _compat as C
    from zbpipe.schedules import planned_actions

    torch.set_num_threads(1)
    binds, runs = [], []

    def counting_backward(sched, action):
        binds.append(action.microbatch_index)
        call = planned_actions.bind_full_backward(sched, action)

        def run(ctx):
            runs.append(action.microbatch_index)
            call(ctx)

        return run

    class Counted(zbpipe.Schedule1F1BMulti):
        action_binders = {**zbpipe.Schedule1F1BMulti.action_binders}
        action_binders[C.FULL_BACKWARD] = counting_backward

    model = _model()
    sched, x, y = _train(Counted, model)
    after_steps = list(binds)
    sched.replan(sched.plan)
    model.zero_grad(set_to_none=True)
    sched.step(x, target=y)
    return {
        "binds": after_steps,
        "binds_after_replan": binds[len(after_steps) :],
        "runs": runs,
        "worst": _worst(model, _reference_grads()),
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _failure(rank: int, world: int) -> dict:
    """A failing action raises its own error, logged with the schedule, its step marked."""
    import zbpipe
    from zbpipe import _compat as C

    torch.set_num_threads(1)
    from torch.distributed.pipelining import PipelineStage

    model = _model()
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    sched = zbpipe.Schedule1F1BMulti([stage], M, loss_fn=mse)
    own = C.custom_functions(sched)[C.FORWARD]

    def failing(action, ctx):
        if action.microbatch_index == 2:
            raise ValueError("boom at microbatch 2")
        own(action, ctx)

    sched.register_custom_function(C.FORWARD, failing)
    records = _Records()
    logging.getLogger("zbpipe.schedules.action_loop").addHandler(records)
    x, y = _data()
    try:
        sched.step(x, target=y)
        error = None
    except ValueError as e:
        error = str(e)
    sched.register_custom_function(C.FORWARD, own)
    model.zero_grad(set_to_none=True)
    sched.step(x, target=y)  # the failed step left nothing behind
    return {"error": error, "log": records.messages, "worst": _worst(model, _reference_grads())}


def _all(rank: int, world: int) -> dict:
    return {
        "profiled": _profiled(rank, world),
        "custom": _custom_function(rank, world),
        "bound": _bound_once(rank, world),
        "failure": _failure(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> dict:
    (res,) = run_ranks(_all, 1, timeout=240)
    return res


def test_profiler_ranges_appear_when_a_profiler_records_and_only_then(results):
    from zbpipe import plan
    from zbpipe.planning import TORCH_LETTERS
    from zbpipe.planning.fuse import fuse_adjacent_backward

    executed = fuse_adjacent_backward(plan("ZBH1", 1, M)).order[0]
    expected = sorted(
        [f"PP:{a.stage}{TORCH_LETTERS[a.kind]}{a.microbatch}" for a in executed]
        + ["PP:0REDUCE_GRAD"]
    )
    res = results["profiled"]
    assert res["without"] == []
    assert sorted(res["names"]) == expected
    assert res["worst"] < 1e-5


def test_a_registered_custom_function_runs_in_place_of_the_loops_call(results):
    res = results["custom"]
    assert res["seen"] == [(mb, True) for _ in range(STEPS) for mb in range(M)]
    assert res["worst"] < 1e-5


def test_actions_are_bound_once_and_again_after_a_replan(results):
    res = results["bound"]
    assert sorted(res["binds"]) == list(range(M))  # once, at the first of three steps
    assert sorted(res["binds_after_replan"]) == list(range(M))
    assert sorted(res["runs"]) == sorted(list(range(M)) * (STEPS + 1))
    assert res["worst"] < 1e-5


def test_a_failing_action_raises_and_logs_the_schedule_with_its_step(results):
    res = results["failure"]
    assert res["error"] == "boom at microbatch 2"
    assert any("failed at step" in m and "0F2" in m for m in res["log"]), res["log"]
    assert any("0F2" in m and "\n" in m for m in res["log"]), res["log"]  # the whole schedule
    assert res["worst"] < 1e-5
