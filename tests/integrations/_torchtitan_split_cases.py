"""Per-rank bodies of test_torchtitan_split.py: torchtitan 0.3.x's ``pipeline_llm`` builds a
zbpipe schedule on the tiny llama3 of ``_torchtitan_cases``, with the split made for the
schedule and with a user's explicit split."""

from __future__ import annotations

import dataclasses
import os

import torch

from tests.integrations import _torchtitan_cases as tiny

#: an explicit split neither torchtitan's default nor the chosen one (the test checks both)
EXPLICIT = [
    ["tok_embeddings", "layers.0", "layers.1"],
    ["layers.2"],
    ["layers.3"],
    ["norm", "lm_head"],
]


def pieces_held(parts) -> list[str]:
    """The pieces (``tok_embeddings``, ``layers.<i>``, ``norm``, ``lm_head``) a rank's parts
    hold parameters of, in model order."""
    held = set()
    for part in parts:
        for name, _ in part.named_parameters():
            bits = name.split(".")
            held.add(".".join(bits[:2]) if bits[0] == "layers" else bits[0])
    order = ["tok_embeddings", *(f"layers.{i}" for i in range(tiny.N_LAYERS)), "norm", "lm_head"]
    return [n for n in order if n in held]


def build_and_step(rank: int, world: int, schedule: str, local_batch: int, seed: int, fqns):
    import torchtitan.distributed.pipeline_parallel as tt_pp
    from torchtitan.config import CompileConfig, TrainingConfig

    import zbpipe.torchtitan  # noqa: F401  (the integration; pipeline_llm looked up after it)

    dims, parallelism = tiny._parallel_dims(world, schedule)
    parallelism = dataclasses.replace(parallelism, module_fqns_per_model_part=fqns)
    sched, parts, has_first, has_last = tt_pp.pipeline_llm(
        tiny.build_model(seed),
        parallel_dims=dims,
        training=TrainingConfig(local_batch_size=local_batch, seq_len=tiny.SEQ),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
        device=torch.device("cpu"),
        model_config=tiny.tiny_llama3_config(),
        parallelize_fn=lambda m, **_: m,
        loss_fn=tiny._loss_fn(),
    )
    x, y = tiny.batch(local_batch, seed)
    losses: list = []
    sched.step(*((x,) if has_first else ()), target=y if has_last else None, losses=losses)
    grads = {
        n: p.grad.detach().numpy().copy() for part in parts for n, p in part.named_parameters()
    }
    return {
        "stages": [s.stage_index for s in sched._stages],
        "pieces": [pieces_held([part]) for part in parts],
        "grads": grads,
        "loss": torch.stack(losses).sum().item() if has_last else None,
    }


def resplit_runs(rank: int, world: int, schedule: str, local_batch: int, seed: int):
    """The schedule built two ways in one launch: the chosen split and the user's explicit
    split; and, on rank 0, the reference. (torchtitan's default split, ``ZBPIPE_SPLIT=default``,
    is test_torchtitan.py's run.)"""
    os.environ.pop("ZBPIPE_SPLIT", None)
    out = {"chosen": build_and_step(rank, world, schedule, local_batch, seed, None)}
    out["explicit"] = build_and_step(rank, world, schedule, local_batch, seed, EXPLICIT)
    if rank == 0:
        out["reference"] = tiny.unpipelined_grads(local_batch, seed)
    return out
