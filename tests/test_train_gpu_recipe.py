"""recipes/train_gpu.py without torchrun is a one-rank pipeline; --device cpu is its smoke test."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = "--steps 2 --hidden 32 --seq 16 --vocab 64 --heads 2 --microbatches 4 --microbatch-size 2"


@pytest.mark.timeout(300)
def test_train_gpu_runs_every_stage_on_one_rank_on_cpu(tmp_path):
    trace = tmp_path / "trace.json"
    args = ["--device", "cpu", "--schedule", "ZBV", "--trace", str(trace), *TINY.split()]
    proc = subprocess.run(
        [sys.executable, "recipes/train_gpu.py", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 ranks, 2 stages" in proc.stdout and "rank 0 holds stages [0, 1]" in proc.stdout
    assert proc.stdout.count(" loss ") == 2
    kinds = {e.get("cat") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"F", "B", "W"} <= kinds  # ZBV splits the backward: the last step's timeline shows it
