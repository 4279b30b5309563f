"""zbpipe on one CUDA GPU: the split backward per engine, and one-rank pipelines of several stages.

Two processes cannot share one GPU for a pipeline (NCCL refuses a duplicate GPU, gloo cannot send
CUDA tensors), so the GPU test is a one-rank pipeline holding several stages: local hand-offs
instead of messages, every kernel on the one device.

(a) split backward: a stage of bf16 Llama-style blocks (RMSNorm, causal SDPA, SwiGLU) at hidden
    512, 1024, 2048, 4096 (seq = hidden). The fused backward (``torch.autograd.backward``)
    against B + W of every engine in ``ENGINES``, each called directly on fresh forwards (the
    measurement of benchmarks/split_backward.py): device time and host time per pass (medians
    over repetitions), for a step's first microbatch and for the accumulating ones, and the
    largest gradient difference from the fused backward (relative to the largest gradient).
(b) pipelines: the same model (``--blocks`` blocks) split into as many stages as each schedule
    places on one rank: every zbpipe schedule against torch's Schedule1F1B,
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and a plain
    loop over microbatches. Per schedule: step time (ratio to torch's Schedule1F1B, paired per
    repetition), host time spent inside ``step()``, the step's own peak CUDA memory (above
    the weights every run keeps resident), the fp32 gradient error against the plain loop (a
    separate fp32 step), whether a step ran under
    ``torch.cuda.set_sync_debug_mode("error")`` without a host-device synchronisation, and the
    tracer's timeline (CUDA events) of the last step.

Repetitions are interleaved (each runs every schedule once, in a rotating order).

    python benchmarks/gpu.py                          # cuda:0, full run: both tables + JSON
    python benchmarks/gpu.py --device cpu --quick     # smoke test (CI): tiny sizes, 1 rep
    python benchmarks/gpu.py --compile                # table (b) on compiled blocks (issue 26)
    python benchmarks/gpu.py --overlap                # only table (c): DualPipeV's overlapped
                                                      # pairs (benchmarks/gpu_overlap.py)

Tables on stdout; JSON to ``--out`` (default benchmarks/results/gpu_<device type>.json).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llama_blocks import build_chunks, mse_loss
from results_io import paired_ratios

#: The split-backward engines to compare: values of the schedules' ``split=`` option. Add an
#: engine here and both tables pick it up. A zbpipe without the option runs its one engine,
#: reported as ``"builtin"``.
ENGINES = ("graph", "deferred")

#: zbpipe's schedules in table (b): row name -> (class name, constructor options).
ZBPIPE_SCHEDULES = {
    "1F1BMulti": ("Schedule1F1BMulti", {}),
    "ZBH1": ("ScheduleZBH1", {}),
    "ZBH2": ("ScheduleZBH2", {}),
    "ZBAuto": ("ScheduleZBAuto", {}),
    "ZBV": ("ScheduleZBV", {}),
    "ZBVHalf": ("ScheduleZBV", {"memory": "half"}),
    "ZBVMin": ("ScheduleZBV", {"memory": "min"}),
}
#: torch's built-ins in table (b): class name -> stages on the one rank.
TORCH_SCHEDULES = {
    "Schedule1F1B": 1,
    "ScheduleInterleaved1F1B": 2,
    "ScheduleInterleavedZeroBubble": 2,
    "ScheduleZBVZeroBubble": 2,
}
BASELINE = "torch:Schedule1F1B"


@dataclass(frozen=True, kw_only=True)
class Config:
    device: str = "cuda"
    dtype: str = "bfloat16"
    """dtype of the timed runs (the gradient-error check is always fp32)"""
    reps: int = 10
    split_hidden: tuple[int, ...] = (512, 1024, 2048, 4096)
    """table (a): hidden sizes (seq = hidden, at most max_seq)"""
    split_blocks: int = 2
    """table (a): blocks in the one stage"""
    split_microbatches: int = 4
    hidden: int = 4096
    """table (b): model width"""
    seq: int = 4096
    blocks: int = 4
    """table (b): blocks in the whole model (a multiple of 2)"""
    microbatches: int = 8
    max_seq: int = 4096
    compile: bool = False
    """table (b): compile every block in place, ``block.compile(fullgraph=True)`` (torchtitan's
    way), before its schedule is built (the graph engine refuses them: error rows)"""
    overlap: bool = False
    """run only table (c), ScheduleDualPipeV's overlapped pairs (benchmarks/gpu_overlap.py);
    its model is ``hidden`` wide with ``seq`` tokens, capped at 2048"""


QUICK: dict[str, Any] = {
    "reps": 1,
    "split_hidden": (64,),
    "split_blocks": 2,
    "hidden": 64,
    "seq": 32,
    "blocks": 4,
    "microbatches": 4,
}


# ---------------------------------------------------------------- process group and schedules
def init_one_rank_group(device: torch.device) -> None:
    """A one-process group: a pipeline stage needs a group even when every stage is local.

    On CUDA, NCCL for CUDA tensors (should torch's stage set-up communicate at all) and gloo for
    the CPU-side object collectives zbpipe's construction checks use.
    """
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def accepts(cls: type, option: str) -> bool:
    """Whether a schedule's constructor takes ``option`` (the split= option is recent).

    Follows ``**kwargs`` up the class hierarchy: ``ScheduleZBH1.__init__(*args, exact, **kwargs)``
    hands ``split=`` on to the base class that declares it.
    """
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        if option in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False
    return False


def zbpipe_stage_count(cls: type) -> int:
    return len(cls.stage_index_to_rank(1))


def zbpipe_rows() -> list[tuple[str, type, dict[str, Any]]]:
    """(row name, class, options): split schedules once per engine when the option exists."""
    import zbpipe

    rows = []
    for name, (cls_name, options) in ZBPIPE_SCHEDULES.items():
        cls = getattr(zbpipe, cls_name)
        if cls_name == "Schedule1F1BMulti" or not accepts(cls, "split"):
            rows.append((name, cls, options))
        else:
            rows += [(f"{name}[{e}]", cls, {**options, "split": e}) for e in ENGINES]
    return rows


@dataclass
class Run:
    """One schedule built on its own copy of the model, ready to step."""

    name: str
    step: Callable[[torch.Tensor, torch.Tensor], None]
    modules: list[torch.nn.Module]
    tracer: Any
    host_pass: dict[str, list[float]]


def time_host_per_pass(tracer: Any) -> dict[str, list[float]]:
    """Wrap ``tracer.span`` to also record host seconds per pass (kernel launches on a GPU)."""
    host: dict[str, list[float]] = defaultdict(list)
    span = tracer.span

    @contextlib.contextmanager
    def timed_span(kind: str, stage: int, mb: int) -> Iterator[None]:
        t0 = time.perf_counter()
        with span(kind, stage, mb):
            yield
        host[kind].append(time.perf_counter() - t0)

    tracer.span = timed_span
    return host


def build_zbpipe(name: str, cls: type, options: dict, chunks: list, m: int, device) -> Run:
    from torch.distributed.pipelining import PipelineStage

    n = len(chunks)
    stages = [PipelineStage(c, i, n, device) for i, c in enumerate(chunks)]
    sched = cls(stages, m, loss_fn=mse_loss, **options)
    host = time_host_per_pass(sched.tracer)
    return Run(name, lambda x, t: sched.step(x, target=t), chunks, sched.tracer, host)


def build_torch(cls_name: str, chunks: list, m: int, device) -> Run:
    import torch.distributed.pipelining as pp

    from zbpipe.observe.trace import Tracer, attach_stage_tracer

    n = len(chunks)
    stages = [pp.PipelineStage(c, i, n, device) for i, c in enumerate(chunks)]
    tracer = Tracer(rank=0, device=device)
    for st in stages:
        attach_stage_tracer(st, tracer)
    host = time_host_per_pass(tracer)
    from zbpipe._compat import with_local_stage_init

    cls = getattr(pp, cls_name)
    if n > 1:
        # torch 2.11's own stage set-up sends to every neighbour stage, its own rank included,
        # and fails one-rank: zbpipe's fix of that set-up (compute untouched; no-op on >= 2.13).
        cls = with_local_stage_init(cls)
    sched = cls(stages[0] if n == 1 else stages, m, loss_fn=mse_loss)
    return Run(f"torch:{cls_name}", lambda x, t: sched.step(x, target=t), chunks, tracer, host)


def build_plain_loop(chunks: list, m: int) -> Run:
    """The reference: every microbatch forward and backward in turn, loss averaged like
    ``scale_grads=True``."""

    def step(x: torch.Tensor, t: torch.Tensor) -> None:
        for xm, tm in zip(x.chunk(m), t.chunk(m)):
            out = xm
            for c in chunks:
                out = c(out)
            (mse_loss(out, tm) / m).backward()

    return Run("plain loop", step, chunks, None, {})


def all_runs(cfg: Config, dtype: torch.dtype, device) -> list[tuple[str, Callable[[], Run]]]:
    """(name, builder) for every row of table (b); each builder makes a fresh model copy."""

    def chunks(n: int) -> list:
        built = build_chunks(cfg.hidden, cfg.blocks, n, seed=0, dtype=dtype, device=device)
        for block in (b for chunk in built for b in chunk) if cfg.compile else ():
            block.compile(fullgraph=True)
        return built

    m = cfg.microbatches
    out: list[tuple[str, Callable[[], Run]]] = [
        ("plain loop", lambda: build_plain_loop(chunks(1), m))
    ]
    for cls_name, n in TORCH_SCHEDULES.items():
        out.append(
            (f"torch:{cls_name}", lambda c=cls_name, n=n: build_torch(c, chunks(n), m, device))
        )
    for name, cls, options in zbpipe_rows():
        n = zbpipe_stage_count(cls)
        out.append(
            (
                name,
                lambda name=name, cls=cls, o=options, n=n: build_zbpipe(
                    name, cls, o, chunks(n), m, device
                ),
            )
        )
    return out


# ---------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(run: Run, x, t, device, keep_grads: bool = False) -> dict[str, float]:
    for mod in run.modules:
        mod.zero_grad(set_to_none=True)
    if run.tracer is not None:
        run.tracer.clear()
    for v in run.host_pass.values():
        v.clear()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)  # every run's weights, the batch
    t0 = time.perf_counter()
    run.step(x, t)
    host = time.perf_counter() - t0  # host time inside step(): returns before the GPU is done
    sync(device)
    wall = time.perf_counter() - t0
    # The step's own peak (activations, gradients, workspaces), not the other runs' weights.
    peak = torch.cuda.max_memory_allocated(device) - resident if device.type == "cuda" else None
    if not keep_grads:  # only one run's gradients alive at a time
        for mod in run.modules:
            mod.zero_grad(set_to_none=True)
    return {"step_s": wall, "host_s": host, "peak_bytes": peak}


def sync_free_step(run: Run, x, t, device) -> str:
    """Run one step under ``set_sync_debug_mode("error")``: "none" or the synchronising call.

    Run last for each schedule: an error leaves the schedule mid-step, unfit to be timed.
    """
    if device.type != "cuda":
        return "n/a (cpu)"
    for mod in run.modules:
        mod.zero_grad(set_to_none=True)
    sync(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        run.step(x, t)
        return "none"
    except RuntimeError as e:
        return f"synchronises: {str(e).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        sync(device)
        for mod in run.modules:
            mod.zero_grad(set_to_none=True)


def free_memory(device: torch.device) -> None:
    """Collect dropped runs (schedules and stages refer to each other) and return their memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def grads(mods: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p.grad.detach().float() for m in mods for p in m.parameters()]


def relative_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max |got - ref| / max |ref| over every parameter (inf when a gradient is missing)."""
    if len(got) != len(ref):
        return float("inf")
    scale = max(r.abs().max().item() for r in ref) or 1.0
    return max((g - r).abs().max().item() for g, r in zip(got, ref)) / scale


def make_batch(hidden: int, seq: int, m: int, dtype, device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, seq, hidden, generator=g).to(device=device, dtype=dtype)
    t = torch.randn(m, seq, hidden, generator=g).to(device=device, dtype=dtype)
    return x, t


def timeline(tracer: Any) -> dict[str, Any] | None:
    if tracer is None:
        return None
    from zbpipe.observe.trace import Trace

    events = list(tracer.events)
    trace = Trace({0: events})
    return {
        "bubble_rate": trace.bubble_rate,
        "busy_s": {k: trace.busy(k)[0] for k in ("F", "B", "W", "BW") if trace.busy(k)[0]},
        "events": [[e.kind, e.stage, e.microbatch, e.start, e.end] for e in events],
    }


def pipelines(cfg: Config, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Table (b)."""
    seq = min(cfg.seq, cfg.max_seq)
    x, t = make_batch(cfg.hidden, seq, cfg.microbatches, dtype, device)
    builders = all_runs(cfg, dtype, device)
    results: dict[str, Any] = {}
    runs: dict[str, Run] = {}
    for name, build in builders:
        try:
            runs[name] = build()
            one_step(runs[name], x, t, device)  # warm-up: shape inference, allocator, kernels
            results[name] = {}
        except Exception as e:  # noqa: BLE001  (a failing schedule is a row, not a crash)
            runs.pop(name, None)
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    names = list(runs)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(cfg.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(one_step(runs[name], x, t, device))
    for name in names:
        s = samples[name]
        results[name].update(
            step_s=[r["step_s"] for r in s],
            host_s=[r["host_s"] for r in s],
            peak_bytes=max((r["peak_bytes"] or 0) for r in s) or None,
            timeline=timeline(runs[name].tracer),
        )
        results[name]["sync_in_step"] = sync_free_step(runs[name], x, t, device)
    if BASELINE in runs:
        for name in names:
            results[name]["ratio_to_torch_1f1b"] = paired_ratios(
                results[name]["step_s"], results[BASELINE]["step_s"]
            )
    runs.clear()
    free_memory(device)  # the bf16 copies go before the fp32 ones come
    _fp32_errors(cfg, device, builders_fp32=all_runs(cfg, torch.float32, device), out=results)
    return results


def _fp32_errors(cfg: Config, device, builders_fp32, out: dict) -> None:
    """One fp32 step of every schedule against the plain loop's gradients."""
    seq = min(cfg.seq, cfg.max_seq)
    x, t = make_batch(cfg.hidden, seq, cfg.microbatches, torch.float32, device)
    ref: list[torch.Tensor] | None = None
    for name, build in builders_fp32:
        if "error" in out.get(name, {}):
            continue
        run = build()
        one_step(run, x, t, device, keep_grads=True)
        g = grads(run.modules)
        if ref is None:  # the plain loop is built first
            ref = g
        out[name]["fp32_grad_rel_error"] = relative_error(g, ref)
        del run, g
        free_memory(device)


def split_backward(cfg: Config, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Table (a): B + W of each engine against the fused backward on one Llama-style stage.

    The measurement of benchmarks/split_backward.py (each engine called directly on fresh
    forwards, interleaved): a one-stage pipeline would not show it, since the runtime fuses a W
    that directly follows its own B into one BW.
    """
    import split_backward as split_bench

    out: dict[str, Any] = {}
    for hidden in cfg.split_hidden:
        seq = min(hidden, cfg.max_seq)
        case = {
            "name": f"llama h{hidden} seq{seq} x{cfg.split_blocks}",
            "make": lambda h=hidden: build_chunks(
                h, cfg.split_blocks, 1, seed=0, dtype=dtype, device=device
            )[0],
            "shape": (1, seq, hidden),
            "first": False,
        }
        out[str(hidden)] = split_bench.measure(case, cfg.reps, 1, device, dtype)
        free_memory(device)
    return out


# ---------------------------------------------------------------- output
def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def print_split_table(res: dict[str, Any], cuda: bool) -> None:
    import split_backward as split_bench

    print("\n(a) split backward, one stage: (B + W) / fused per engine")
    split_bench.print_rows(list(res.values()), cuda)


def print_pipeline_table(res: dict[str, Any]) -> None:
    print("\n(b) one-rank pipelines: medians over repetitions")
    head = (
        f"{'schedule':<36} {'step ms':>9} {'vs torch 1F1B':>22} {'host ms':>8} {'step MiB':>9} "
        f"{'fp32 err':>8} {'bubble':>7}  sync in step()"
    )
    print(head)
    for name, r in res.items():
        if "error" in r:
            print(f"{name:<36} failed: {r['error']}")
            continue
        q = r.get("ratio_to_torch_1f1b")
        ratio = f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})" if q else "-"
        peak = f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] else "-"
        bubble = f"{r['timeline']['bubble_rate']:.1%}" if r["timeline"] else "-"
        err = r.get("fp32_grad_rel_error")
        print(
            f"{name:<36} {statistics.median(r['step_s']) * 1e3:>9.2f} {ratio:>22} "
            f"{statistics.median(r['host_s']) * 1e3:>8.2f} {peak:>9} "
            f"{'-' if err is None else f'{err:.1e}':>8} {bubble:>7}  {r['sync_in_step']}"
        )


def parse_args(argv: list[str] | None = None) -> tuple[Config, str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: a smoke test)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on CUDA")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--hidden", type=int, help="table (b) width (default 4096)")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--blocks", type=int)
    ap.add_argument("--microbatches", type=int)
    ap.add_argument("--split-hidden", help="table (a) widths, comma-separated")
    ap.add_argument("--compile", action="store_true", help="table (b): compile every block")
    ap.add_argument("--overlap", action="store_true", help="only table (c): overlapped pairs")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/gpu_<device>.json)")
    a = ap.parse_args(argv)
    fields: dict[str, Any] = dict(QUICK) if a.quick else {}
    fields["device"] = a.device
    fields["dtype"] = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    for f in ("reps", "hidden", "seq", "blocks", "microbatches"):
        if getattr(a, f) is not None:
            fields[f] = getattr(a, f)
    if a.split_hidden:
        fields["split_hidden"] = tuple(int(h) for h in a.split_hidden.split(","))
    fields["compile"] = a.compile
    fields["overlap"] = a.overlap
    if a.overlap and not a.quick:  # the MoE model's all-to-alls dominate at this size
        fields.setdefault("hidden", 2048)
        fields.setdefault("seq", 2048)
    cfg = Config(**fields)
    suffix = "_overlap" if a.overlap else "_compiled" if cfg.compile else ""
    out = a.out or f"benchmarks/results/gpu_{torch.device(cfg.device).type}{suffix}.json"
    return cfg, out


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: pass --device cpu for the smoke test")
        if device.index is None:  # torch 2.11's set_device wants an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the CPU run is a smoke test: keep it off the other cores
    dtype = getattr(torch, cfg.dtype)
    if cfg.compile:
        # Every schedule builds fresh blocks (and a separate fp32 copy) from the one Block class:
        # dynamo counts their compiles against one code object, past its default limit of 8,
        # which a training script that compiles its model once never meets.
        torch._dynamo.config.recompile_limit = 512
        torch._dynamo.config.accumulated_recompile_limit = 4096
    init_one_rank_group(device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"zbpipe GPU benchmark on {machine}, torch {torch.__version__}, {cfg.dtype}")
    if cfg.overlap:
        return _overlap_only(cfg, device, dtype, machine, out)
    t0 = time.perf_counter()
    split = split_backward(cfg, dtype, device)
    print_split_table(split, device.type == "cuda")
    pipes = pipelines(cfg, dtype, device)
    print_pipeline_table(pipes)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "machine": machine,
                "torch": torch.__version__,
                "config": asdict(cfg),
                "engines": list(ENGINES),
                "split_backward": split,
                "pipelines": pipes,
            },
            f,
            indent=1,
        )
    print(f"JSON: {out}")
    dist.destroy_process_group()
    return 0


def _overlap_only(cfg: Config, device: torch.device, dtype: Any, machine: str, out: str) -> int:
    """Table (c): ScheduleDualPipeV's overlapped pairs on a side stream (gpu_overlap.py)."""
    import gpu_overlap

    res = gpu_overlap.run(cfg, device, dtype, share=0.5)
    gpu_overlap.print_table(res)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": machine, "torch": torch.__version__, "config": asdict(cfg), **res}, f)
    print(f"JSON: {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
