"""torchtitan 0.2's own Trainer, switched to zbpipe by a TOML file, trains like its built-in ones.

Each run is ``torchrun -m torchtitan.train --job.config_file FILE`` with FILE
recipes/torchtitan/llama3_debug_cpu_zbv.toml or ..._zbh1.toml, on 2 CPU ranks (gloo):
torchtitan 0.2.2's llama3 debug model, AdamW, LR schedule, loss, dataloader and the debug
config's selective activation checkpointing (every 2nd block), with ``[experimental]
custom_import`` importing zbpipe's integration (recipes/torchtitan/zbpipe_torchtitan_cpu.py),
over a local dataset and tokenizer (tests/_torchtitan_assets.py), 3 steps of 4 sequences of 32
tokens. Every run loads one seed checkpoint (``--checkpoint.create_seed_checkpoint``), so V and
loop placements start from the same weights. The references are the same files with torch's
``Interleaved1F1B`` (for ZBV) and ``1F1B`` (for ZBH1) named on the command line.

Needs torchtitan 0.2.x and its training dependencies (CI: the torch 2.11.0 venv,
``bash .ci/torchtitan-trainer .venv-2.11.0 0.2``). Deselected by default (marker
``torchtitan02_trainer``), never skipped: a missing package fails the run. With
``ZBPIPE_WRITE_RESULTS=1`` the losses are stored in
benchmarks/results/torchtitan02_trainer_losses.json (docs/torchtitan.md quotes them).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

import _torchtitan_assets as assets
from _torchtitan_trainer import RECIPE, ROOT, assert_same_losses, losses, torchrun

pytestmark = [pytest.mark.torchtitan02_trainer, pytest.mark.timeout(900)]

STEPS = 3
ZBV_TOML = RECIPE / "llama3_debug_cpu_zbv.toml"
ZBH1_TOML = RECIPE / "llama3_debug_cpu_zbh1.toml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(toml, schedule=None)`` -> {step: loss} of torchtitan's Trainer on 2 ranks, from one
    seed checkpoint; ``schedule`` overrides the file's ``pipeline_parallel_schedule``."""
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

    def _torchrun(nproc: int, toml: Path, dump: str, *extra: str) -> str:
        config = ["--job.config_file", str(toml), "--job.dump_folder", str(tmp / dump)]
        return torchrun(nproc, [*config, *common, *extra])

    _torchrun(
        1,
        ZBV_TOML,
        "seed",
        "--parallelism.pipeline_parallel_degree=1",
        "--checkpoint.create_seed_checkpoint",
    )
    from_seed = [
        f"--checkpoint.initial_load_path={tmp / 'seed' / 'checkpoint' / 'step-0'}",
        "--checkpoint.interval=1000",
    ]
    seen: dict[str, dict[int, float]] = {}

    def _run(toml: Path, schedule: str | None = None) -> dict[int, float]:
        """The file's own (zbpipe) schedule, or ``schedule`` named on the command line."""
        override = [f"--parallelism.pipeline_parallel_schedule={schedule}"] if schedule else []
        log = _torchrun(2, toml, schedule or toml.stem, *override, *from_seed)
        if schedule is None:  # custom_import ran: zbpipe patched torchtitan 0.2.x's functions
            assert "integration installed (0.2.x targets)" in log, log[-4000:]
        label = f"torchtitan {schedule}" if schedule else f"zbpipe {_schedule_in(toml)}"
        seen[f"{label} ({toml.name})"] = found = losses(log, STEPS)
        return found

    yield _run
    if os.environ.get("ZBPIPE_WRITE_RESULTS") == "1" and seen:
        _write_results(seen)


def _schedule_in(toml: Path) -> str:
    found = re.search(r'^pipeline_parallel_schedule = "(\w+)"', toml.read_text(), re.MULTILINE)
    assert found, f"{toml} names no pipeline_parallel_schedule"
    return found.group(1)


def _write_results(seen: dict[str, dict[int, float]]) -> None:
    from importlib.metadata import version

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from results_io import write_result

    write_result(
        "torchtitan02_trainer_losses",
        {
            "torchtitan": version("torchtitan"),
            "setup": f"2 gloo ranks, CPU, {STEPS} steps of 4 sequences of 32 tokens, "
            "one seed checkpoint",
            "losses_per_step": {
                run: [found[s] for s in sorted(found)] for run, found in seen.items()
            },
        },
    )


def test_zbv_toml_trains_like_torchtitans_interleaved_1f1b(run):
    assert_same_losses(run(ZBV_TOML), run(ZBV_TOML, "Interleaved1F1B"))


def test_zbh1_toml_trains_like_torchtitans_1f1b(run):
    assert_same_losses(run(ZBH1_TOML), run(ZBH1_TOML, "1F1B"))
