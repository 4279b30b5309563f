"""Launch torchtitan's own Trainer on CPU ranks and read its losses (the Trainer tests' helpers).

Shared by tests/test_torchtitan_trainer.py (torchtitan 0.3.x) and
tests/test_torchtitan02_trainer.py (torchtitan 0.2.x): both run ``torchrun -m torchtitan.train``
with recipes/torchtitan/ on PYTHONPATH, offline, one thread per rank, every rank logging.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "torchtitan"
#: fp32 throughout; zbpipe's split backward sums each weight's microbatch gradients in another
#: order than torch's fused one, AdamW turns that rounding into slightly different updates.
#: Measured: relative differences of 2e-5 by step 3 (torchtitan 0.3.0).
RTOL = 1e-4
_LOSS_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+(-?[0-9.]+)")
_COLOR = re.compile(r"\x1b\[[0-9;]*m")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], timeout: float = 480) -> str:
    """``torchrun --nproc_per_node nproc -m torchtitan.train *args``; its log (fails on rc != 0)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(RECIPE), os.environ.get("PYTHONPATH", "")]),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "LOG_RANK": ",".join(str(r) for r in range(nproc)),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={_port()}",
        "-m",
        "torchtitan.train",
        *args,
    ]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{log[-6000:]}"
    return log


def losses(log: str, steps: int) -> dict[int, float]:
    """{step: loss} from torchtitan's step lines. Every rank prints one per step; only the rank
    holding the last stage knows the loss (the others print -1)."""
    found = {
        int(s): float(v) for s, v in _LOSS_LINE.findall(_COLOR.sub("", log)) if float(v) != -1.0
    }
    assert sorted(found) == list(range(1, steps + 1)), log[-4000:]
    return found


def assert_same_losses(got: dict[int, float], ref: dict[int, float]) -> None:
    assert got.keys() == ref.keys()
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), f"step {step}: {got} vs {ref}"
