"""The pipeline part of benchmarks/moe.py: 2 gloo ranks, the 8 Qwen3 MoE debug blocks.

torch's Schedule1F1B and zbpipe's ZBH1 run one stage of 4 blocks per rank, ZBV two chunks of 2
blocks per rank (V placement). zbpipe's schedules share one set of blocks per rank (the union of
both placements; their weights never change: no optimizer step, ``.grad`` cleared before each
step); torch's runs an unpatched copy with the same weights. "compiled" wraps each block in
``torch.compile(block, fullgraph=True)`` (the eager blocks' weights). Every (mode, schedule)
pair runs once per repetition, in a rotating order.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

KINDS = ("F", "B", "W", "BW")


def _blocks(rank: int) -> dict[int, Any]:
    """{block index: block} of the 8 that rank ``rank`` holds in either placement."""
    from moe import build_blocks

    loop = set(range(4 * rank, 4 * rank + 4))
    v = set(range(2 * rank, 2 * rank + 2)) | set(range(2 * (3 - rank), 2 * (3 - rank) + 2))
    built = build_blocks("qwen3", range(8))
    return {i: b for i, b in enumerate(built) if i in loop | v}


def _rank_main(rank: int, world: int, cfg: Any) -> dict | None:
    import torch
    import torch.distributed as dist
    from moe import Chunk, mse
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from zbpipe import _compat as C
    from zbpipe.observe.trace import Trace, Tracer, attach_stage_tracer
    from zbpipe.schedules import Schedule1F1BMulti, ScheduleZBH1, ScheduleZBV

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    ours = _blocks(rank)
    theirs = {i: b for i, b in _blocks(rank).items() if i // 4 == rank}
    cpu = torch.device("cpu")

    def chunk(blocks: dict[int, Any], first: int, n: int, compiled: bool) -> Chunk:
        picked = [blocks[i] for i in range(first, first + n)]
        if compiled:
            picked = [torch.compile(b, fullgraph=True) for b in picked]
        return Chunk(picked)

    def build(mode: str, name: str) -> tuple[Any, list, Any]:
        compiled = mode == "compiled"
        name, _, split = name.partition("@")
        options = {"split": split} if split else {}
        if name == "ZBV":
            idx = [rank, 3 - rank]
            stages = [PipelineStage(chunk(ours, 2 * c, 2, compiled), c, 4, cpu) for c in idx]
            sched = ScheduleZBV(stages, cfg.microbatches, loss_fn=mse, **options)
            return sched, stages, sched.tracer
        blocks = theirs if name == "torch:1F1B" else ours
        stages = [PipelineStage(chunk(blocks, 4 * rank, 4, compiled), rank, 2, cpu)]
        if name == "torch:1F1B":
            tracer = Tracer(rank=rank)
            attach_stage_tracer(stages[0], tracer)
            return Schedule1F1B(stages[0], cfg.microbatches, loss_fn=mse), stages, tracer
        cls = Schedule1F1BMulti if name == "1F1B" else ScheduleZBH1
        sched = cls(stages, cfg.microbatches, loss_fn=mse, **options)
        return sched, stages, sched.tracer

    pairs = [
        (mode, name)
        for mode in ("eager", "compiled")
        for name in cfg.schedules
        if not (mode == "compiled" and "@graph" in name)  # the graph engine refuses them
    ]
    runs = {pair: build(*pair) for pair in pairs}
    torch.manual_seed(1)
    x = torch.randn(cfg.microbatches, cfg.seq, 256)
    tgt = torch.randn_like(x)

    def one_step(pair: tuple[str, str]) -> tuple[float, list, int]:
        sched, stages, tracer = runs[pair]
        for st in stages:
            for p in st.submod.parameters():
                p.grad = None
        tracer.clear()
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        dist.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        sched.step(*((x,) if has_first else ()), target=tgt if has_last else None)
        elapsed = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return elapsed, list(tracer.events), faults

    counters = C.dynamo_counters()
    for _ in range(2):  # compile, shapes, allocator
        for pair in pairs:
            one_step(pair)
    warm = counters["stats"]["unique_graphs"]
    records = []
    for rep in range(cfg.reps):
        k = rep % len(pairs)
        for pair in pairs[k:] + pairs[:k]:
            records.append((rep, pair, *one_step(pair)))
    end = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (records, warm, end))
    if rank != 0:
        return None
    return _summarise(gathered, pairs, cfg, Trace)


def _summarise(gathered: list, pairs: list, cfg: Any, trace_cls: Any) -> dict:
    from results_io import paired_ratios

    out: dict[str, Any] = {
        "dynamo_graphs_after_warmup_by_rank": [g[1] for g in gathered],
        "dynamo_graphs_breaks_at_end_by_rank": [g[2] for g in gathered],
    }
    for mode, name in pairs:
        times, bubbles, shares, faults = [], [], [], []
        busy: dict[str, list[list[float]]] = {k: [] for k in KINDS}
        for rep in range(cfg.reps):
            per_rank = [
                next(r for r in g[0] if r[0] == rep and r[1] == (mode, name)) for g in gathered
            ]
            times.append(max(r[2] for r in per_rank))
            faults.append([r[4] for r in per_rank])
            trace = trace_cls({i: r[3] for i, r in enumerate(per_rank)})
            bubbles.append(trace.bubble_rate)
            for k in KINDS:
                busy[k].append([trace.busy(k)[i] for i in range(len(per_rank))])
            b = sum(sum(v) for v in busy["B"][-1:])
            w = sum(sum(v) for v in busy["W"][-1:])
            if b + w:
                shares.append(w / (b + w))
        out.setdefault(mode, {})[name] = {
            "step_time_s": times,
            "bubble_rate": bubbles,
            "w_share_of_split_backward": shares,
            "page_faults_per_step_per_rank": [
                statistics.median(f[i] for f in faults) for i in range(len(faults[0]))
            ],
            "busy_s_by_kind_per_rank": {
                k: [statistics.median(r[i] for r in v) for i in range(len(v[0]))]
                for k, v in busy.items()
            },
        }
    for mode in ("eager", "compiled"):
        base = out[mode]["torch:1F1B"]["step_time_s"]
        for r in out[mode].values():
            r["ratio_to_torch_1f1b"] = paired_ratios(r["step_time_s"], base)
    return out


def pipeline(cfg: Any) -> dict:
    from zbpipe.testing import run_ranks

    t0 = time.perf_counter()
    res: dict = run_ranks(_rank_main, 2, cfg, timeout=3600)[0]
    print(
        f"2 ranks, 8 Qwen3 MoE debug blocks, m={cfg.microbatches}, {cfg.reps} interleaved reps "
        f"({time.perf_counter() - t0:.0f} s); dynamo graphs after warm-up "
        f"{res['dynamo_graphs_after_warmup_by_rank']}, (graphs, breaks) at the end "
        f"{res['dynamo_graphs_breaks_at_end_by_rank']}"
    )
    for mode in ("eager", "compiled"):
        for name, r in res[mode].items():
            q = r["ratio_to_torch_1f1b"]
            busy = r["busy_s_by_kind_per_rank"]
            sums = "  ".join(
                f"{k} " + "/".join(f"{v * 1e3:.0f}" for v in busy[k]) for k in KINDS if any(busy[k])
            )
            share = r["w_share_of_split_backward"]
            print(
                f"{mode:9s} {name:11s} {statistics.median(r['step_time_s']) * 1e3:7.0f} ms  "
                f"vs torch 1F1B {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})  "
                f"bubble {statistics.median(r['bubble_rate']):.1%}"
                + (f"  W share {statistics.median(share):.1%}" if share else "")
                + f"  busy ms per rank: {sums}"
                + f"  page faults {r['page_faults_per_step_per_rank']}"
            )
    return res
