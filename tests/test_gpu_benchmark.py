"""benchmarks/gpu.py runs end to end on the CPU (its smoke test; the real run needs a CUDA GPU).

No timing is asserted: only that both tables are produced for every engine and schedule, and that
every schedule's fp32 gradients match the plain loop's.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# Both smoke runs in one interpreter (importing torch is seconds of a core), each as
# ``python benchmarks/gpu.py ARGS`` runs it: the script as __main__, with its own sys.argv.
_TWO_RUNS = """
import runpy, sys
sys.path.insert(0, "benchmarks")
for args in sys.argv[1:]:
    sys.argv = ["benchmarks/gpu.py", *args.split()]
    try:
        runpy.run_path("benchmarks/gpu.py", run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
"""


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """``benchmarks/gpu.py --device cpu --quick`` and, after it, the same with ``--overlap``:
    their stdout and JSON outputs."""
    tmp = tmp_path_factory.mktemp("gpu")
    out, overlap = tmp / "gpu.json", tmp / "gpu_overlap.json"
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_RUNS]
        + [f"--device cpu --quick --out {out}", f"--device cpu --quick --overlap --out {overlap}"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text()), json.loads(overlap.read_text())


@pytest.mark.timeout(900)
def test_gpu_benchmark_runs_on_cpu_quick(quick_runs):
    stdout, res, _ = quick_runs
    assert "(a) split backward" in stdout and "(b) one-rank pipelines" in stdout
    (row,) = res["split_backward"].values()
    assert {"deferred", "graph"} <= set(row["ratio"])  # each engine against the fused backward
    # fp32 on the CPU: the deferred engine runs autograd's own GEMMs (bitwise), the graph engine
    # the same ops in another order.
    assert row["max_rel_grad_diff"]["deferred"] == 0.0
    assert row["max_rel_grad_diff"]["graph"] < 1e-5
    pipes = res["pipelines"]
    assert "plain loop" in pipes and "torch:Schedule1F1B" in pipes
    assert any(name.startswith("ZBV") for name in pipes)
    for name, r in pipes.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        # fp32 on the CPU, same ops per microbatch: only summation order may differ.
        assert r["fp32_grad_rel_error"] < 1e-5, name


def _load_gpu_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks/gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_split_option_is_found_through_kwargs_of_subclasses():
    gpu = _load_gpu_script()

    class Base:
        def __init__(self, stages, n, *, split="auto", **plan_options): ...

    class Sub(Base):
        def __init__(self, *args, exact=False, **kwargs): ...

    class Closed:
        def __init__(self, stages, n, **kwargs): ...

    assert gpu.accepts(Sub, "split") and gpu.accepts(Base, "split")
    assert not gpu.accepts(Closed, "split")


@pytest.mark.timeout(900)
def test_gpu_benchmark_overlap_case_runs_on_cpu_quick(quick_runs):
    """Table (c), DualPipeV's overlapped pairs: on the CPU its side stream is a host sleep."""
    stdout, _, res = quick_runs
    assert "(c) overlapped pairs" in stdout
    assert set(res["times"]) == {"DualPipeV overlap", "DualPipeV no overlap", "ZBV"}
