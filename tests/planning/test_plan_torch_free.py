"""The plan layer imports and runs with torch blocked, and imports nothing above it."""

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PLANNING = SRC / "zbpipe" / "planning"

SCRIPT = """
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError
from zbpipe.planning import Costs, plan, plan_from_csv, plan_to_csv, simulate
pl = plan("ZBH1", 4, 8)
res = simulate(pl, Costs())
text = plan_to_csv(pl)
assert plan_from_csv(text, name="ZBH1").order == pl.order
import zbpipe  # the package's eager names (zbpipe.plan among them) are torch-free too
assert zbpipe.plan("ZBH1", 4, 8).order == pl.order
loaded = [name for name, m in sys.modules.items() if m is not None]
assert not any(name == 'torch' or name.startswith('torch.') for name in loaded)
try:
    plan("torch:1F1B", 4, 8)
except ValueError as e:  # the plan layer never builds torch's schedules
    assert "zbpipe.plan(" in str(e), e
else:
    raise SystemExit("zbpipe.planning.plan must refuse torch: names")
try:
    zbpipe.plan("torch:1F1B", 4, 8)
except ImportError:
    pass
else:
    raise SystemExit("torch: names must need torch")
print(res.makespan)
"""


def test_plan_layer_runs_without_torch():
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == 3 * 8 + (4 - 1)  # the paper's ZB-H1 makespan, unit costs


def _imports(source: str, package: str = "zbpipe.planning") -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source`` (a module of ``package``,
    zbpipe.planning or one of its folders), and ``(line, "<dynamic>")`` for importlib /
    __import__ calls, which would hide one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found.append((node.lineno, module))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                found.append((node.lineno, "<dynamic>"))
    return found


def _package_of(path: Path) -> str:
    """The package a module file of zbpipe.planning belongs to (``zbpipe.planning.v`` ...)."""
    return ".".join(path.parent.relative_to(SRC).parts)


def _above_or_torch(module: str) -> bool:
    top = module.split(".")[0]
    return (
        module == "<dynamic>"
        or top == "torch"
        or (top == "zbpipe" and not (module + ".").startswith("zbpipe.planning."))
    )


def test_plan_layer_imports_nothing_above_it():
    """Data flows down: zbpipe.planning imports itself, the standard library and third-party
    packages (scipy for the MILP), never torch, never another zbpipe module, and never by a
    dynamic import that would hide either."""
    offenders = [
        f"{path.relative_to(SRC)}:{line}: {module}"
        for path in sorted(PLANNING.rglob("*.py"))
        for line, module in _imports(path.read_text(), _package_of(path))
        if _above_or_torch(module)
    ]
    assert not offenders, offenders


def test_import_scan_sees_upward_torch_and_dynamic_imports():
    source = (
        "import importlib\n"
        "from .. import torch_plans\n"
        "from ..schedules import X\n"
        "from .core import Plan\n"
        "from zbpipe.planning.costs import Costs\n"
        "import torch.distributed\n"
        "importlib.import_module('zbpipe.integrations.torch_plans')\n"
    )
    found = [m for _, m in _imports(source)]
    assert found == [
        "importlib",
        "zbpipe",
        "zbpipe.schedules",
        "zbpipe.planning.core",
        "zbpipe.planning.costs",
        "torch.distributed",
        "<dynamic>",
    ]
    assert [_above_or_torch(m) for m in found] == [False, True, True, False, False, True, True]
