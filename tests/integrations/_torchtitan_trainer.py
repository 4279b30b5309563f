"""Run torchtitan's own Trainer on CPU ranks and read its losses (the Trainer tests' helpers).

Shared by tests/integrations/test_torchtitan_trainer.py and test_torchtitan_moe_trainer.py
(torchtitan 0.3.x) and tests/integrations/test_torchtitan02_trainer.py (torchtitan 0.2.x): each
run is ``python -m torchtitan.train ARGS`` on N ranks, forked from one server process per test
session that imported torch and torchtitan's stack once (zbpipe/testing/torchtitan_runs.py
says how and why), with recipes/torchtitan/ on PYTHONPATH, offline, one thread per rank, every
rank logging.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.integrations import _torchtitan_runs

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "torchtitan"
#: the run server, run as a module (its folder on sys.path would shadow top-level names)
_RUNS_ENTRY = ("-m", "zbpipe.testing.torchtitan_runs")
#: fp32 throughout; zbpipe's split backward sums each weight's microbatch gradients in another
#: order than torch's fused one, AdamW turns that rounding into slightly different updates.
#: Measured: up to 2e-5 relative by step 3 (torchtitan 0.3.0; 9e-6 with one seed checkpoint).
RTOL = 1e-4
_LOSS_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+(-?[0-9.]+)")
_COLOR = re.compile(r"\x1b\[[0-9;]*m")
#: what the server imports before it forks a run: torchtitan 0.3's trainer and its stack; for
#: 0.2, whose config module reads ``sys.argv`` at import, torch and the data stack only
_PRELOAD = {
    "0.3": ("torch.distributed", "datasets", "torchtitan.trainer"),
    "0.2": ("torch.distributed", "datasets"),
}
_server: subprocess.Popen | None = None


def _the_server() -> subprocess.Popen:
    """The session's run server (started on first use, stopped at exit)."""
    global _server
    if _server is not None and _server.poll() is None:
        return _server
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(RECIPE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "LOG_RANK": "0,1,2,3",
    }
    preload = _PRELOAD["0.2" if version("torchtitan").startswith("0.2") else "0.3"]
    pipe = subprocess.PIPE
    _server = subprocess.Popen(
        [sys.executable, *_RUNS_ENTRY, *preload], env=env, stdin=pipe, stdout=pipe, text=True
    )
    atexit.register(_server.kill)
    assert _reply(_server, 300) == "ready", "the Trainer run server did not start"
    return _server


def _reply(server: subprocess.Popen, timeout: float) -> str:
    """The server's next line, or fail (killing it) after ``timeout`` seconds."""
    assert server.stdout is not None
    ready, _, _ = select.select([server.stdout], [], [], timeout)
    line = server.stdout.readline() if ready else ""
    if not line:
        server.kill()
        pytest.fail(f"the Trainer run server gave no answer in {timeout} s (rc {server.poll()})")
    return line.strip()


def train_runs(
    nproc: int, runs: dict[str, list[str]], log_dir: Path, timeout: float = 480
) -> dict[str, str]:
    """Run ``python -m torchtitan.train ARGS`` on ``nproc`` ranks for each of ``runs`` ({name:
    ARGS}) in order, each in fresh ranks forked by the server; each run's log, every rank's
    lines of it. Fails, with every rank's log tail, if any run fails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rank_logs = [log_dir / f"rank{r}.log" for r in range(nproc)]
    server = _the_server()
    assert server.stdin is not None
    request = {
        "ranks": nproc,
        "runs": list(runs.items()),
        "log_dir": str(log_dir),
        "hooks": "tests.integrations._torchtitan_hooks",
    }
    server.stdin.write(json.dumps({**request, "timeout": timeout}) + "\n")
    server.stdin.flush()
    answer = json.loads(_reply(server, timeout * len(runs) + 60))
    if not answer["ok"]:
        tails = "\n".join(f"--- {f.name} ---\n{_read(f)[-4000:]}" for f in rank_logs)
        raise AssertionError(f"{answer['error']}\n{tails}")
    by_run: dict[str, list[str]] = {name: [] for name in runs}
    for f in rank_logs:
        name, seen = None, []
        for line in _read(f).splitlines():
            if line.startswith(_torchtitan_runs.MARKER):
                name = line[len(_torchtitan_runs.MARKER) :]
                seen.append(name)
            elif name is not None:
                by_run[name].append(line)
        # every run's section, once and in order: no run's lines can be filed under another's
        assert seen == list(runs), f"{f.name}: runs {seen}, expected {list(runs)}"
    return {name: "\n".join(lines) for name, lines in by_run.items()}


def train(nproc: int, args: list[str], log_dir: Path, timeout: float = 480) -> str:
    """``python -m torchtitan.train *args`` on ``nproc`` ranks; its log (fails if it fails)."""
    return train_runs(nproc, {"run": args}, log_dir, timeout)["run"]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def losses(log: str, steps: int) -> dict[int, float]:
    """{step: loss} from torchtitan's step lines. Every rank prints one per step; only the ranks
    holding the last stage know the loss (the others print -1, summed over the data-parallel
    ranks: -2 with two)."""
    found: dict[int, float] = {}
    for s, v in _LOSS_LINE.findall(_COLOR.sub("", log)):
        if not (float(v) < 0 and float(v).is_integer()):
            assert found.setdefault(int(s), float(v)) == float(v), f"step {s} twice\n{log[-4000:]}"
    assert sorted(found) == list(range(1, steps + 1)), log[-4000:]
    return found


def assert_same_losses(got: dict[int, float], ref: dict[int, float]) -> None:
    assert got.keys() == ref.keys()
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), f"step {step}: {got} vs {ref}"


def write_losses(
    name: str, found: dict[str, dict[int, float]], steps: int, extra: dict | None = None
) -> None:
    """With ``ZBPIPE_WRITE_RESULTS=1``, store {run: losses per step} as
    benchmarks/results/NAME.json (docs/results/torchtitan-trainer.md quotes them); otherwise
    nothing."""
    if os.environ.get("ZBPIPE_WRITE_RESULTS") != "1":
        return
    from importlib.metadata import version

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from results_io import write_result

    write_result(
        name,
        {
            "torchtitan": version("torchtitan"),
            "setup": f"2 gloo ranks, CPU, {steps} steps of 4 sequences of 32 tokens, "
            "one seed checkpoint",
            "losses_per_step": {
                run: [by_step[s] for s in sorted(by_step)] for run, by_step in found.items()
            },
            **(extra or {}),
        },
    )
