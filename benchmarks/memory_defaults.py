"""Peak memory held for backward with DEFAULT arguments (and with costs="profile"), against
torch's Schedule1F1B, on issue 27's GPT.

The model (issue 27): token embedding, 2 x ranks pre-norm blocks (one per V chunk, two per stage
of the one-stage-per-rank schedules; causal attention through nn.Linear q/k/v/o and
F.scaled_dot_product_attention, 4 heads; MLP h -> 4h -> h with GELU), a final LayerNorm and a
Linear head, cross-entropy; hidden 256, 4 sequences of 128 tokens per microbatch.

Per schedule and engine, two ways of building it: ``default`` (no argument but the engine: the
first step measures the bytes each stage holds and the plan is re-made for them) and
``profile`` (``costs="profile"``: one warm-up and two profiled steps, times and bytes). Then
``--steps`` measured steps. A ``SavedActivationMeter`` per rank counts what is held for
backward by the same rules for every schedule; reported: the peak over the measured steps, max
over ranks, divided by torch 1F1B's; for V-Half and V-Min also divided by their formula,
``(p + 2) / 2`` and ``(p + 4) / 3`` microbatches of the model's first p-stage stage (chunks 0
and 1) in the bytes the schedule measured.

Run:  PYTHONPATH=src python benchmarks/memory_defaults.py --ranks 4 --vocab 512 --microbatches 8
Writes benchmarks/results/memory_defaults_<ranks>ranks_v<vocab>_m<m>.json.
Memory does not depend on speed: 4 ranks on 2 cores measure it honestly (slowly).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

SCHEDULES = ("ZBH1", "ZB1P", "ZBV", "ZBVHalf", "ZBVMin")
ENGINES = ("deferred", "graph")
MODES = ("default", "profile")


@dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int = 4
    microbatches: int = 8
    microbatch_size: int = 4
    hidden: int = 256
    seq: int = 128
    vocab: int = 512
    steps: int = 1
    schedules: str = ",".join(SCHEDULES)
    engines: str = ",".join(ENGINES)
    modes: str = ",".join(MODES)


def _model(cfg: Config, n_stages: int, world: int) -> list:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h, nh = cfg.hidden, 4

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
            self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            y = self.ln1(x)
            q, k, v = (
                lin(y).view(b, t, nh, h // nh).transpose(1, 2) for lin in (self.q, self.k, self.v)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab, h)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.tok(ids)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.lm = nn.LayerNorm(h), nn.Linear(h, cfg.vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm(self.ln(x))

    torch.manual_seed(0)
    per = 2 * world // n_stages
    mods = []
    for s in range(n_stages):
        layers: list = [Embed()] if s == 0 else []
        layers += [Block() for _ in range(per)]
        if s == n_stages - 1:
            layers.append(Head())
        mods.append(nn.Sequential(*layers))
    return mods


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _batch(cfg: Config, step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(step)
    ids = torch.randint(
        0, cfg.vocab, (cfg.microbatches * cfg.microbatch_size, cfg.seq + 1), generator=g
    )
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _measure(cfg: Config, rank: int, world: int, name: str, engine: str | None, mode: str) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from zbpipe import ProfileConfig, get_schedule_class
    from zbpipe.memory import SavedActivationMeter
    from zbpipe.patching import undo_all
    from zbpipe.planning import loop_placement, v_placement

    m = cfg.microbatches
    v = name.startswith("ZBV")
    n = 2 * world if v else world
    mods = _model(cfg, n, world)
    placement = v_placement(world) if v else loop_placement(world, n)
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    meter = SavedActivationMeter()
    patches: list = []
    if name == "torch:1F1B":
        sched = Schedule1F1B(stages[0], m, loss_fn=meter.watch_loss(_loss))
        for st in stages:
            patches += meter.attach(st)
        warm = 1
    else:
        options: dict[str, Any] = {"split": engine, "trace": False}
        if mode == "profile":
            options["costs"] = "profile"
            options["profile"] = ProfileConfig(warmup_steps=1, profile_steps=2, comm=0.0)
        sched = get_schedule_class(name)(stages, m, loss_fn=_loss, **options)
        sched.attach_meter(meter)
        warm = 3 if mode == "profile" else 1
    first, last = 0 in mine, n - 1 in mine
    peaks = []
    for step in range(warm + cfg.steps):
        x, y = _batch(cfg, step)
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        gc.collect()
        meter.begin_step()
        sched.step(*((x,) if first else ()), target=y if last else None)
        gc.collect()
        if step >= warm:
            peaks.append(meter.end_step().peak_bytes)
    undo_all(patches)
    dist.barrier()
    out: dict[str, Any] = {"peak": max(peaks)}
    costs = getattr(sched, "measured_costs", None) or getattr(sched, "memory_costs", None)
    unit = getattr(sched, "memory_unit_bytes", None)
    if costs is not None and unit is not None:
        out["stage0_bytes"] = (costs.stage(0).mem_f + costs.stage(1).mem_f) * unit
    return out


def _rank_main(rank: int, world: int, cfg: Config) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    rows = [{"schedule": "torch:1F1B", "engine": None, "mode": None,
             **_measure(cfg, rank, world, "torch:1F1B", None, "")}]  # fmt: skip
    for engine in cfg.engines.split(","):
        for mode in cfg.modes.split(","):
            for name in cfg.schedules.split(","):
                row = _measure(cfg, rank, world, name, engine, mode)
                rows.append({"schedule": name, "engine": engine, "mode": mode, **row})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(Config()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(default), default=default)
    ap.add_argument("--out", default=None)
    args = vars(ap.parse_args(argv))
    out_path = args.pop("out")
    cfg = Config(**args)
    from memory_table import peak_table  # the same table as memory_table.py's

    from zbpipe.testing import run_ranks

    per_rank = run_ranks(_rank_main, cfg.ranks, cfg, timeout=6000, pg_timeout=900)
    table = peak_table(per_rank, cfg.ranks, ("schedule", "engine", "mode"), "formula")
    from results_io import write_result

    result = {"config": asdict(cfg), "rows": table}
    write_result(
        f"memory_defaults_{cfg.ranks}ranks_v{cfg.vocab}_m{cfg.microbatches}", result, path=out_path
    )
    print(
        f"{'schedule':<11} {'engine':<9} {'mode':<8} {'peak MiB per rank':<30} vs 1F1B  vs formula"
    )
    for e in table:
        per = "/".join(f"{b / 2**20:.1f}" for b in e["peak_bytes_per_rank"])
        vf = f"{e['vs_formula']:.3f}" if "vs_formula" in e else ""
        print(
            f"{e['schedule']:<11} {e['engine'] or '':<9} {e['mode'] or '':<8} {per:<30} "
            f"{e['vs_torch_1f1b']:.3f}    {vf}"
        )
    return result


if __name__ == "__main__":
    main()
