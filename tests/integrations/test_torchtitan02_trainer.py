"""torchtitan 0.2's own Trainer, switched to zbpipe by a TOML file, trains like its built-in ones.

Each run is torchtitan's entry point ``torchtitan.train --job.config_file FILE`` with FILE
recipes/torchtitan/llama3_debug_cpu_zbv.toml or ..._zbh1.toml, on 2 CPU ranks (gloo):
torchtitan 0.2.2's llama3 debug model, AdamW, LR schedule, loss, dataloader and the debug
config's selective activation checkpointing (every 2nd block), with ``[experimental]
custom_import`` importing zbpipe's integration (recipes/torchtitan/zbpipe_torchtitan_cpu.py),
over a local dataset and tokenizer (tests/integrations/_torchtitan_assets.py), 3 steps of 4
sequences of 32 tokens. Every run loads one seed checkpoint
(``--checkpoint.create_seed_checkpoint``), so V and loop placements start from the same weights.
The references are the same files with torch's ``Interleaved1F1B`` (for ZBV) and ``1F1B`` (for
ZBH1) named on the command line. With torchtitan's compile on (``--compile.enable``: each
TransformerBlock and the loss), ZBV with full activation checkpointing and ZBH1 with the file's
selective one, each against the same torchtitan run with torch's schedule. Each run is what
``python -m torchtitan.train`` runs, in ranks forked from a server that imported torch and the
data stack once (tests/integrations/_torchtitan_runs.py).

Needs torchtitan 0.2.x and its training dependencies (CI: the torch 2.11.0 venv,
``bash .ci/torchtitan-trainer .venv-2.11.0 0.2``). Deselected by default (marker
``torchtitan02_trainer``), never skipped: a missing package fails the run. With
``ZBPIPE_WRITE_RESULTS=1`` the losses are stored in
benchmarks/results/torchtitan02_trainer_losses.json (docs/results/torchtitan-trainer.md quotes
them).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integrations import _torchtitan_assets as assets
from tests.integrations._torchtitan_trainer import (
    RECIPE,
    assert_same_losses,
    losses,
    train,
    train_runs,
    write_losses,
)

# The seed and eight runs, each allowed 480 s by the run server, within 1200 s.
pytestmark = [pytest.mark.torchtitan02_trainer, pytest.mark.timeout(1200)]

STEPS = 3
ZBV_TOML = RECIPE / "llama3_debug_cpu_zbv.toml"
ZBH1_TOML = RECIPE / "llama3_debug_cpu_zbh1.toml"


#: torchtitan 0.2.2's compile (each TransformerBlock wrapped by ``torch.compile(block,
#: fullgraph=True)``, and the loss) with the aot_eager backend (why aot_eager:
#: tests/integrations/test_torchtitan_trainer.py's COMPILE)
COMPILE = ("--compile.enable", "--compile.backend", "aot_eager")
#: run name: (TOML file, --parallelism.pipeline_parallel_schedule or None for the file's own,
#: None for the file's settings (eager, selective AC every 2nd block) or, compiled, the
#: --activation_checkpoint.mode)
RUNS = {
    "zbpipe ZBV (llama3_debug_cpu_zbv.toml)": (ZBV_TOML, None, None),
    "torchtitan Interleaved1F1B (llama3_debug_cpu_zbv.toml)": (ZBV_TOML, "Interleaved1F1B", None),
    "zbpipe ZBH1 (llama3_debug_cpu_zbh1.toml)": (ZBH1_TOML, None, None),
    "torchtitan 1F1B (llama3_debug_cpu_zbh1.toml)": (ZBH1_TOML, "1F1B", None),
    "zbpipe ZBV, compiled, full AC": (ZBV_TOML, None, "full"),
    "torchtitan Interleaved1F1B, compiled, full AC": (ZBV_TOML, "Interleaved1F1B", "full"),
    "zbpipe ZBH1, compiled, selective AC": (ZBH1_TOML, None, "selective"),
    "torchtitan 1F1B, compiled, selective AC": (ZBH1_TOML, "1F1B", "selective"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict[int, float]]:
    """{run name: {step: loss}} of torchtitan's Trainer on 2 ranks for every run in RUNS, from
    one seed checkpoint (tests/integrations/_torchtitan_runs.py runs them)."""
    tmp = tmp_path_factory.mktemp("torchtitan02")
    common = [
        "--model.hf_assets_path",
        str(assets.write_tokenizer(tmp / "tokenizer")),
        "--training.dataset_path",
        str(assets.write_dataset(tmp / "c4_test")),
        f"--training.steps={STEPS}",
        "--debug.seed=0",
        "--checkpoint.enable",
    ]

    def _args(toml: Path, dump: str, *extra: str) -> list[str]:
        config = ["--job.config_file", str(toml), "--job.dump_folder", str(tmp / dump)]
        return [*config, *common, *extra]

    train(
        1,
        _args(
            ZBV_TOML,
            "seed",
            "--parallelism.pipeline_parallel_degree=1",
            "--checkpoint.create_seed_checkpoint",
        ),
        tmp / "logs-seed",
    )
    from_seed = [
        f"--checkpoint.initial_load_path={tmp / 'seed' / 'checkpoint' / 'step-0'}",
        "--checkpoint.interval=1000",
    ]
    logs = train_runs(
        2,
        {
            name: _args(
                toml,
                f"{schedule or toml.stem}-{ac or 'eager'}",
                *([f"--parallelism.pipeline_parallel_schedule={schedule}"] if schedule else []),
                *((*COMPILE, f"--activation_checkpoint.mode={ac}") if ac else ()),
                *from_seed,
            )
            for name, (toml, schedule, ac) in RUNS.items()
        },
        tmp / "logs",
    )
    for name, (toml, schedule, ac) in RUNS.items():
        if schedule is None:  # custom_import ran: zbpipe patched torchtitan 0.2.x's functions
            assert "integration installed (0.2.x targets)" in logs[name], logs[name][-4000:]
            assert re.match(rf"zbpipe {_schedule_in(toml)}\b", name), (name, toml)
        if ac:  # torchtitan compiled the blocks and the loss
            assert "Compiling each TransformerBlock with torch.compile" in logs[name], name
            assert "Compiling the loss function with torch.compile" in logs[name], name
    found = {name: losses(log, STEPS) for name, log in logs.items()}
    write_losses("torchtitan02_trainer_losses", found, STEPS)
    return found


def _schedule_in(toml: Path) -> str:
    found = re.search(r'^pipeline_parallel_schedule = "(\w+)"', toml.read_text(), re.MULTILINE)
    assert found, f"{toml} names no pipeline_parallel_schedule"
    return found.group(1)


def test_zbv_toml_trains_like_torchtitans_interleaved_1f1b(trained):
    assert_same_losses(
        trained["zbpipe ZBV (llama3_debug_cpu_zbv.toml)"],
        trained["torchtitan Interleaved1F1B (llama3_debug_cpu_zbv.toml)"],
    )


def test_zbh1_toml_trains_like_torchtitans_1f1b(trained):
    assert_same_losses(
        trained["zbpipe ZBH1 (llama3_debug_cpu_zbh1.toml)"],
        trained["torchtitan 1F1B (llama3_debug_cpu_zbh1.toml)"],
    )


def test_compiled_zbv_with_full_ac_trains_like_torchtitans_compiled_interleaved_1f1b(trained):
    assert_same_losses(
        trained["zbpipe ZBV, compiled, full AC"],
        trained["torchtitan Interleaved1F1B, compiled, full AC"],
    )


def test_compiled_zbh1_with_selective_ac_trains_like_torchtitans_compiled_1f1b(trained):
    assert_same_losses(
        trained["zbpipe ZBH1, compiled, selective AC"],
        trained["torchtitan 1F1B, compiled, selective AC"],
    )
