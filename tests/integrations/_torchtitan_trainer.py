"""Launch torchtitan's own Trainer on CPU ranks and read its losses (the Trainer tests' helpers).

Shared by tests/integrations/test_torchtitan_trainer.py (torchtitan 0.3.x) and
tests/integrations/test_torchtitan02_trainer.py (torchtitan 0.2.x): both run ``torchrun -m
torchtitan.train`` (the seed checkpoint) and one torchrun launch of several such runs
(``torchrun_runs``), with recipes/torchtitan/ on PYTHONPATH, offline, one thread per rank, every
rank logging.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations import _torchtitan_runs

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "torchtitan"
_RUNS_ENTRY = Path(_torchtitan_runs.__file__)
#: fp32 throughout; zbpipe's split backward sums each weight's microbatch gradients in another
#: order than torch's fused one, AdamW turns that rounding into slightly different updates.
#: Measured: up to 2e-5 relative by step 3 (torchtitan 0.3.0; 9e-6 with one seed checkpoint).
RTOL = 1e-4
_LOSS_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+(-?[0-9.]+)")
_COLOR = re.compile(r"\x1b\[[0-9;]*m")


def _launch(nproc: int, target: list[str], timeout: float) -> str:
    """``torchrun --nproc_per_node nproc TARGET...`` offline, one thread per rank, every rank
    logging; its output (fails on rc != 0)."""
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
        f"--master_port={_torchtitan_runs.free_port()}",
        *target,
    ]
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True)
    out, err, timed_out = "", "", False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also when pytest-timeout interrupts the wait
        if proc.poll() is None:
            # SIGTERM: torchrun's agent then stops its ranks (each in a session of its own, out
            # of reach of a kill of the agent's group) before it exits.
            proc.terminate()
            try:
                more_out, more_err = proc.communicate(timeout=60)
                out, err = out + more_out, err + more_err
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    log = out + err
    assert not timed_out, f"{' '.join(cmd)}: over {timeout} s\n{log[-6000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{log[-6000:]}"
    return log


def torchrun(nproc: int, args: list[str], timeout: float = 480) -> str:
    """``torchrun --nproc_per_node nproc -m torchtitan.train *args``; its log (fails on rc != 0)."""
    return _launch(nproc, ["-m", "torchtitan.train", *args], timeout)


def torchrun_runs(
    nproc: int, runs: dict[str, list[str]], log_dir: Path, timeout: float = 480
) -> dict[str, str]:
    """One torchrun launch whose ranks run ``python -m torchtitan.train ARGS`` for each of
    ``runs`` ({name: ARGS}) in order (tests/integrations/_torchtitan_runs.py says how and why);
    each run's log, every rank's lines of it. Fails, with every rank's log tail, if any run
    fails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    runs_json = log_dir / "runs.json"
    runs_json.write_text(json.dumps(list(runs.items())))
    rank_logs = [log_dir / f"rank{r}.log" for r in range(nproc)]
    try:
        _launch(nproc, [str(_RUNS_ENTRY), str(runs_json), str(log_dir), str(RECIPE)], timeout)
    except AssertionError as failed:
        tails = "\n".join(f"--- {f.name} ---\n{_read(f)[-4000:]}" for f in rank_logs)
        raise AssertionError(f"{failed}\n{tails}") from None
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
