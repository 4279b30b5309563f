"""Write a benchmark's result to benchmarks/results/<name>.json with where and when it was measured.

Every number quoted in README.md and docs/*.md must appear in one of these files
(tests/test_docs_numbers.py checks it). A script calls ``write_result("my_bench", data)``: the
file gets ``data`` plus a ``meta`` block (machine, torch version, date, command line), so a reader
can tell a number from a quiet GPU machine from one taken on a shared 2-core box.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """CPU count, platform and accelerator, in words (no host name)."""
    words = f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.system()}"
    try:
        import torch

        if torch.cuda.is_available():
            words += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return words


def cpu_model() -> str:
    """The CPU's model name (``lscpu``'s "Model name"; "unknown" where there is none): results
    from machines with and without AVX-512 or bf16 differ by tens of times."""
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")),
        "unknown",
    )


def meta() -> dict[str, str]:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the simulator scripts need no torch
        torch_version = "not installed (simulator only)"
    return {
        "machine": machine(),
        "torch": torch_version,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }


def write_result(name: str, data: dict[str, Any], path: str | Path | None = None) -> Path:
    """Write ``data`` and a ``meta`` block to ``benchmarks/results/<name>.json`` (or ``path``)."""
    out = Path(path) if path is not None else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta(), **data}, indent=1) + "\n")
    return out


def paired_ratios(times: list[float], base: list[float]) -> dict[str, float]:
    """Median, min and max of ``times[i] / base[i]``: repetitions paired with the baseline's."""
    r = [a / b for a, b in zip(times, base, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def extract_src(rev: str, into: Path) -> Path:
    """``src/`` of git revision ``rev`` unpacked under ``into`` (a before/after comparison's
    "before" side); returns the unpacked ``src`` folder."""
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def short_rev(rev: str) -> str:
    """``rev``'s short hash (what a result file records as the code it measured)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
