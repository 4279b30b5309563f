"""Overlapped pairs on one GPU: ScheduleDualPipeV with and without overlap, and ScheduleZBV, on
a one-rank pipeline of the MoE test model whose all-to-alls run on a side CUDA stream.

``benchmarks/gpu.py --overlap`` runs this (table (c)). One process, one GPU: the V's two chunks
on one rank (p = 1: the pairs are the forward of chunk 0 with the backward of chunk 1 and back).
Each all-to-all (zbpipe.testing.moe's dispatch and combine) is replaced by :class:`SideStream`:
on CUDA it waits for its input on a side stream, keeps that stream busy ``latency`` seconds
(``torch.cuda._sleep``: a spinning kernel on the side stream, a stand-in for a slow link), copies,
and the result is waited for by the compute stream; the host does not wait. So an overlapped
pair's other half can run on the compute stream meanwhile, as NCCL's all-to-all on its own
stream would let it. On the CPU (the smoke test) the latency is a host sleep at ``wait()``.
``latency`` is ``--overlap-latency-share`` (default 0.5) of one chunk's forward, measured first.

Reported per schedule: step time (median, and paired per repetition against ScheduleDualPipeV
with overlap); the gradients are the 2- and 4-rank tests' business (tests/schedules/
test_dualpipev.py). Never run on a GPU yet: the first device session should run
``python benchmarks/gpu.py --overlap``.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

SCHEDULES = ("DualPipeV overlap", "DualPipeV no overlap", "ZBV")


class SideStream:
    """A stand-in all-to-all (one rank: a copy) that takes ``latency`` seconds off the compute
    stream (zbpipe's collective protocol: ``start``, ``start_backward``, ``wait``)."""

    def __init__(self, latency: float, device: torch.device, cycles_per_s: float) -> None:
        self.latency, self.device, self.cycles_per_s = latency, device, cycles_per_s
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __deepcopy__(self, memo: dict[int, Any]) -> SideStream:
        return self

    def start(self, x: torch.Tensor) -> _OnSide:
        if self.stream is None:
            return _OnSide(x.clone(), None, time.perf_counter() + self.latency)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(int(self.latency * self.cycles_per_s))
            out = x.clone()
            done = torch.cuda.Event()
            done.record(self.stream)
        x.record_stream(self.stream)
        return _OnSide(out, done, 0.0)

    start_backward = start


class _OnSide:
    def __init__(self, out: torch.Tensor, done: Any, ready: float) -> None:
        self.out, self.done, self.ready = out, done, ready

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            torch.cuda.current_stream(self.out.device).wait_event(self.done)
        elif (left := self.ready - time.perf_counter()) > 0:
            time.sleep(left)
        return self.out


def _cycles_per_second(device: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles one second is, on this GPU."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def run(cfg: Any, device: torch.device, dtype: torch.dtype, share: float) -> dict[str, Any]:
    """Table (c): returns the step times, the ratios and the gradient errors."""
    import torch.distributed as dist
    from results_io import paired_ratios
    from torch.distributed.pipelining import PipelineStage

    import zbpipe
    from zbpipe.testing.models import lm_loss, synthetic_batch
    from zbpipe.testing.moe import TinyMoEConfig, build_moe_stages, moe_layers

    mcfg = TinyMoEConfig(vocab=256, hidden=cfg.hidden, seq=cfg.seq, heads=8, experts=2)
    group = dist.group.WORLD
    base = build_moe_stages(mcfg, 2, group, 0, seed=0)
    base = [m.to(device=device, dtype=dtype) for m in base]
    ids, tgt = synthetic_batch(mcfg, 2 * cfg.microbatches, 0)
    ids, tgt = ids.to(device), tgt.to(device)
    x = torch.randn(2, cfg.seq, cfg.hidden, device=device, dtype=dtype)
    forward = _median_forward(base[1], x, device)
    cycles = _cycles_per_second(device)
    latency = share * forward

    def build(name: str) -> tuple[Any, list]:
        mods = copy.deepcopy(base)
        for mod in mods:
            for layer in moe_layers(mod):
                layer.dispatch_a2a = layer.combine_a2a = SideStream(latency, device, cycles)
        stages = [PipelineStage(mods[s], s, 2, device) for s in (0, 1)]
        m = cfg.microbatches
        if name == "ZBV":
            return zbpipe.ScheduleZBV(stages, m, loss_fn=lm_loss, measure_memory=False), mods
        points = [
            zbpipe.CommPoint(owner=layer, method="exchange", collective=lambda t, a2a: (t, a2a))
            for mod in mods
            for layer in moe_layers(mod)
        ]
        sched = zbpipe.ScheduleDualPipeV(
            stages, m, loss_fn=lm_loss, comm_points=points,
            overlap=name == "DualPipeV overlap", measure_memory=False,
        )  # fmt: skip
        return sched, mods

    runs = {name: build(name) for name in SCHEDULES}
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    for rep in range(cfg.reps + 1):
        for name in SCHEDULES[rep % 3 :] + SCHEDULES[: rep % 3]:
            sched, mods = runs[name]
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            sched.step(ids, target=tgt)
            _sync(device)
            if rep:  # the first is a warm-up
                times[name].append(time.perf_counter() - t0)
    ratio = {n: paired_ratios(t, times["DualPipeV overlap"]) for n, t in times.items()}
    return {
        "chunk_forward_s": forward,
        "latency_s": latency,
        "times": times,
        "median_s": {n: statistics.median(t) for n, t in times.items()},
        "ratio_to_overlap": ratio,
    }


def _median_forward(chunk: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    times = []
    for _ in range(8):
        _sync(device)
        t0 = time.perf_counter()
        chunk(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_table(res: dict[str, Any]) -> None:
    print(
        f"\n(c) overlapped pairs: one chunk's forward {res['chunk_forward_s'] * 1e3:.2f} ms, "
        f"each all-to-all {res['latency_s'] * 1e3:.2f} ms on a side stream"
    )
    for name, t in res["times"].items():
        r = res["ratio_to_overlap"][name]
        print(
            f"  {name:<22} median {statistics.median(t) * 1e3:8.2f} ms   / overlap "
            f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
        )
