"""torchtitan 0.3's own Trainer trains with zbpipe's schedules: losses equal its built-in ones.

Each run is torchtitan's entry point ``torchtitan.train`` on 2 CPU ranks (gloo) with the recipe
``recipes/torchtitan/llama3_debug_cpu.py`` (torchtitan's llama3 debug model, optimizer, loss, LR
schedule and dataloader), a local dataset and tokenizer (tests/integrations/_torchtitan_assets.py),
3 steps of 4 sequences of 32 tokens (4 for the ``ZBV:profile`` runs and their reference: the
profile re-plans at the end of step 3). Every run starts from one seed checkpoint (torchtitan's
``--checkpoint.create_seed_checkpoint``, its own 1-rank launch), so a V placement and a loop
placement start from the same weights. The references are torchtitan's runs with torch's 1F1B
(full and selective activation checkpointing) and Interleaved1F1B, eager; two zbpipe runs are
compiled (torch.compile, ``aot_eager``, with selective and with full AC). Each run is what
``python -m torchtitan.train`` runs, in ranks forked from a server that imported torch and
torchtitan once (tests/integrations/_torchtitan_runs.py).

The compiled runs are checked against the eager references: torchtitan's compiled and eager
runs of this model gave the same losses to the 6 printed digits (stored with every run of
session 14, benchmarks/results/torchtitan_trainer_losses.json), far inside ``RTOL``. Issue 45 cut
the compiled references (1F1B, 1F1B with selective AC, Interleaved1F1B) and the compiled ZB-H1
run with full AC, a launch each: compiled ZB-H1 is checked under selective AC, compiled full AC
under ``ZBV:profile``.

That the split reached torchtitan's Trainer is read off what W computed, not off times: each
rank counts the weight GEMMs its W ran (``zbpipe-test-w:`` lines, _torchtitan_runs.py).

Needs torch >= 2.14 (torchtitan 0.3.0's Trainer calls ``step(arg_mbs=...)``, which torch 2.13's
built-in schedules lack) and torchtitan's training dependencies; CI runs it in its torch 2.14.1
environment (``pytest -m torchtitan_trainer``). Deselected by default, never skipped: a missing
package fails the run. With ``ZBPIPE_WRITE_RESULTS=1`` the losses are stored in
benchmarks/results/torchtitan_trainer_losses.json (docs/results/torchtitan-trainer.md quotes them).
"""

from __future__ import annotations

import re

import pytest

from tests.integrations import _torchtitan_assets as assets
from tests.integrations._torchtitan_trainer import (
    assert_same_losses,
    losses,
    train,
    train_runs,
    write_losses,
)

# Ten runs, each allowed 480 s by the run server, within the test's 1500 s: CI runs them beside
# the main suite on 2 cores.
pytestmark = [pytest.mark.torchtitan_trainer, pytest.mark.timeout(1500)]

STEPS = 3
#: runs given one more step: ``costs="profile"`` re-plans at the end of step 3 (one warm-up
#: step, two measured), so step 4 runs the re-made plan; its reference runs 4 steps too
PROFILED = {
    "zbpipe ZBV:profile": 4,
    "torchtitan Interleaved1F1B": 4,
    "zbpipe ZBV:profile, compiled": 4,
}
#: torchtitan's compile (model and loss, each block compiled with fullgraph=True), with the
#: aot_eager backend: dynamo and AOTAutograd capture each block as one autograd node, which is
#: what the split must see through; inductor's C++ kernels would add minutes of compiling on CPU
#: and change nothing the split sees
COMPILE = ("--compile.enable", "--compile.backend", "aot_eager")
#: run name: (--parallelism.pipeline_parallel_schedule, activation checkpointing mode, compiled)
RUNS = {
    "zbpipe ZBH1": ("ZBH1", "full", False),
    "zbpipe ZBV:profile": ("ZBV:profile", "full", False),
    "zbpipe ZBH1, selective AC": ("ZBH1", "selective", False),
    "torchtitan 1F1B": ("1F1B", "full", False),
    "torchtitan Interleaved1F1B": ("Interleaved1F1B", "full", False),
    "torchtitan 1F1B, selective AC": ("1F1B", "selective", False),
    "zbpipe ZBH1, compiled, selective AC": ("ZBH1", "selective", True),
    # ":profile" (costs measured on the first steps, the plan re-made for them) on a compiled
    # run: the name form a torchtitan config uses (docs/use/torchtitan.md), in a launch that exists
    # anyway
    "zbpipe ZBV:profile, compiled": ("ZBV:profile", "full", True),
    # the zero-bubble schedule of the interleaved placement, under torchtitan's default
    # selective AC (where torch's own InterleavedZeroBubble stops: issue 47)
    "zbpipe ZBInterleaved, selective AC": ("ZBInterleaved", "selective", False),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict[int, float]]:
    """{run name: {step: loss}} of torchtitan's Trainer for every run in RUNS, from one seed."""
    tmp = tmp_path_factory.mktemp("torchtitan")
    common = [
        "--module",
        "llama3_debug_cpu",
        "--config",
        "llama3_debugmodel_cpu",
        "--hf_assets_path",
        str(assets.write_tokenizer(tmp / "tokenizer")),
        "--dataloader.dataset_path",
        str(assets.write_dataset(tmp / "c4_test")),
        "--training.seq_len=32",
        "--training.local_batch_size=4",
        "--training.disable_cuda_graphs",  # CUDA graphs refuse pipeline parallelism
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--debug.seed=0",
        "--checkpoint.enable",
    ]
    train(
        1,
        [
            *common,
            "--dump_folder",
            str(tmp / "seed"),
            "--parallelism.pipeline_parallel_degree=1",
            f"--training.steps={STEPS}",
            "--checkpoint.create_seed_checkpoint",
        ],
        tmp / "logs-seed",
    )
    seed = tmp / "seed" / "checkpoint" / "step-0"
    args = {
        name: [
            *common,
            "--dump_folder",
            str(tmp / f"{schedule.replace(':', '-')}-{ac}{'-compiled' if compiled else ''}"),
            f"--training.steps={PROFILED.get(name, STEPS)}",
            "--parallelism.pipeline_parallel_degree=2",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--checkpoint.initial_load_path={seed}",
            "--checkpoint.interval=1000",
            *(COMPILE if compiled else ()),
            f"activation-checkpoint:{ac}",
        ]
        for name, (schedule, ac, compiled) in RUNS.items()
    }
    logs = train_runs(2, args, tmp / "logs")
    found = {name: losses(log, PROFILED.get(name, STEPS)) for name, log in logs.items()}
    # the profile measured and re-planned at the end of step 3 (rank 0 logs it at INFO)
    replan = "zbpipe profile: ScheduleZBV:profile measured costs"
    for name in ("zbpipe ZBV:profile", "zbpipe ZBV:profile, compiled"):
        assert replan in logs[name], logs[name]
    for name in RUNS:
        if name.startswith("zbpipe"):
            assert_w_ran_the_weight_gemms(logs[name], compiled=RUNS[name][2])
    write_losses("torchtitan_trainer_losses", found, STEPS)
    return found


#: a block of the llama3 debug model holds 7 Linears (wq, wk, wv, wo, w1, w2, w3)
BLOCK_LINEARS = 7


def assert_w_ran_the_weight_gemms(log: str, compiled: bool) -> None:
    """The split happened in torchtitan's Trainer: on every rank W computed weight GEMMs
    (before torchtitan's instance-level forwards were reached, every weight GEMM ran in B and W
    had none). A compiled run's W holds its compiled blocks' Linears too (before they reached W,
    FSDP2 handing compiled code its unsharded parameters, W held only the eager head's GEMM;
    docs/results/torchtitan-trainer.md): at least one block's Linears, queued on the Python side
    (the native capture serves eager Linears only)."""
    counts = [
        (int(g), int(k)) for g, k in re.findall(r"zbpipe-test-w: gemms=(\d+) weights=(\d+)", log)
    ]
    assert len(counts) == 2, log[-4000:]  # one line per rank
    for gemms, weights in counts:
        assert gemms > 0, counts
        if compiled:
            assert weights >= BLOCK_LINEARS, counts


def test_zbh1_trains_like_torchtitans_1f1b(trained):
    assert_same_losses(trained["zbpipe ZBH1"], trained["torchtitan 1F1B"])


def test_zbv_trains_like_torchtitans_interleaved_1f1b(trained):
    """Against the built-in schedule with the same four model chunks: torchtitan's own 1F1B (two
    chunks) differs from it by 3e-5 relative at step 3 (measured), the chunking's rounding.
    Named ``"ZBV:profile"``: 4 steps, the last on the plan re-made for the measured costs (the
    fixture also checks that its W ran the weight GEMMs)."""
    assert_same_losses(trained["zbpipe ZBV:profile"], trained["torchtitan Interleaved1F1B"])


def test_zbh1_with_torchtitans_default_selective_ac(trained):
    """torchtitan's default selective activation checkpointing trains with the default (deferred)
    split: its B is one autograd pass. (The graph engine's W would backward a second time through
    SAC's regions, which torch forbids.)"""
    assert_same_losses(
        trained["zbpipe ZBH1, selective AC"], trained["torchtitan 1F1B, selective AC"]
    )


def test_compiled_zbv_with_profiled_costs_trains_like_torchtitans_interleaved_1f1b(trained):
    """``pipeline_parallel_schedule = "ZBV:profile"``, compiled with full AC (it replaces the
    compiled ZB-H1 run with full AC, and its compiled reference): 4 steps, the last on the plan
    re-made from the measured costs; measuring and re-planning change the order, not the math."""
    assert_same_losses(
        trained["zbpipe ZBV:profile, compiled"], trained["torchtitan Interleaved1F1B"]
    )


def test_compiled_zbh1_with_torchtitans_default_selective_ac(trained):
    """The deferred engine's compiled Linears keep the split inside the compiled blocks
    (tests/engines/ count it) under torchtitan's default selective AC."""
    assert_same_losses(
        trained["zbpipe ZBH1, compiled, selective AC"], trained["torchtitan 1F1B, selective AC"]
    )


def test_zb_interleaved_with_torchtitans_default_selective_ac(trained):
    """``pipeline_parallel_schedule = "ZBInterleaved"``: torchtitan builds two loop-placed stages
    per rank (rank 0 holds stages 0 and 2) and zbpipe's split backward trains them under the
    default selective AC with the losses of torchtitan's Interleaved1F1B over the same four
    chunks (its first three steps; the fixture also checks that W ran the weight GEMMs)."""
    got = trained["zbpipe ZBInterleaved, selective AC"]
    ref = trained["torchtitan Interleaved1F1B"]
    assert_same_losses(got, {step: ref[step] for step in got})
