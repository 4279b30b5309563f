"""The split zbpipe chooses for torchtitan's debug models, from FLOPs alone and over the head's
cost range (issue 47): simulated, no run.

For llama3 debug, Qwen3 MoE debug and DeepSeek-V3 debug (torchtitan 0.3's flavours, built on
the meta device), seq 128, PP = 2, microbatches of 1 sequence, 4 of them: the split
``choose_split`` makes for ZBV, ZBH1 and ZBInterleaved from the analytic costs alone and with
``head_scales=(1, HEAD_COST_MAX)``, with a plain and with a chunked loss (torchtitan's
``ChunkedLossWrapper``: the head all F), their simulated gains over torchtitan's even split (at
the analytic costs and the worst over the range), and for llama3 ZBV the two splits' step
times against the head's scale.

    PYTHONPATH=src python benchmarks/split_head_range.py

Writes benchmarks/results/split_head_range.json; docs/use/torchtitan.md quotes it.
"""

from __future__ import annotations

import importlib

import torch
from results_io import write_result

from zbpipe.integrations import torchtitan_split as ts
from zbpipe.planning.split import choose_split, scale_head

MODELS = [("llama3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("deepseek_v3", "debugmodel")]
SCHEDULES = ["ZBV", "ZBH1", "ZBInterleaved"]
SEQ, RANKS, M = 128, 2, 4


def _model(name: str, flavor: str):
    config = importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor).model
    with torch.device("meta"):
        return config.build(), config


def main() -> None:
    rows, curves = [], {}
    for name, flavor in MODELS:
        model, config = _model(name, flavor)
        for chunked in (False, True):
            pieces = ts.model_layer_costs(model, config, SEQ, 1, chunked=chunked)
            layer = pieces[1].f + pieces[1].b + pieces[1].w
            for schedule in SCHEDULES:
                flops = choose_split(pieces, RANKS, schedule, M)
                robust = choose_split(
                    pieces, RANKS, schedule, M, head_scales=(1.0, ts.HEAD_COST_MAX)
                )
                row = {
                    "model": f"{name}:{flavor}",
                    "chunked_loss": chunked,
                    "schedule": schedule,
                    "head_over_layer_flops": (pieces[-1].f + pieces[-1].b + pieces[-1].w) / layer,
                    "default": list(robust.baseline_sizes),
                    "flop_split": list(flops.sizes),
                    "flop_gain": flops.gain,
                    "robust_split": list(robust.sizes),
                    "robust_gain": robust.gain,
                    "robust_worst_gain": robust.worst_gain,
                    "head_scales_judged": list(robust.head_scales),
                }
                rows.append(row)
                print(row)
            if name == "llama3":
                for sizes in ((2, 2, 2, 2), (3, 1, 2, 2)):
                    key = f"ZBV chunked={chunked} {list(sizes)}"
                    curves[key] = [
                        (
                            s,
                            choose_split(
                                scale_head(pieces, s), RANKS, "ZBV", M, baseline=sizes, max_evals=1
                            ).baseline_makespan
                            / layer,
                        )
                        for s in (1.0, 2.0, 2.3, 2.4, 2.5, 3.0)
                    ]
    model, config = _model("llama3", "debugmodel")
    pieces = ts.model_layer_costs(model, config, SEQ, 1, chunked=True)
    layer = pieces[1].f + pieces[1].b + pieces[1].w

    def zbv_step(sizes: tuple[int, ...], scale: float) -> float:
        return (
            choose_split(
                scale_head(pieces, scale), RANKS, "ZBV", M, baseline=sizes, max_evals=1
            ).baseline_makespan
            / layer
        )

    at_max = {
        "default": zbv_step((2, 2, 2, 2), ts.HEAD_COST_MAX),
        "flop_split": zbv_step((3, 1, 2, 2), ts.HEAD_COST_MAX),
    }
    # the first head scale (a grid of 0.05) where llama3's ZB-V FLOP split is slower
    grid = [1.0 + 0.05 * i for i in range(61)]
    loses = next((x for x in grid if zbv_step((3, 1, 2, 2), x) > zbv_step((2, 2, 2, 2), x)), None)
    write_result(
        "split_head_range",
        {
            "head_cost_max": ts.HEAD_COST_MAX,
            "seq": SEQ,
            "ranks": RANKS,
            "microbatches": M,
            "rows": rows,
            "zbv_step_in_layers_by_head_scale": curves,
            "llama3_zbv_chunked_step_in_layers_at_head_cost_max": at_max,
            "llama3_zbv_chunked_flop_split_slower_from_head_scale": loses,
        },
    )


if __name__ == "__main__":
    main()
