"""The plan layer imports and runs with torch blocked."""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = """
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError
from zbpipe.planning import Costs, plan, plan_from_csv, plan_to_csv, simulate
pl = plan("ZBH1", 4, 8)
res = simulate(pl, Costs())
text = plan_to_csv(pl)
assert plan_from_csv(text, name="ZBH1").order == pl.order
loaded = [name for name, m in sys.modules.items() if m is not None]
assert not any(name == 'torch' or name.startswith('torch.') for name in loaded)
try:
    plan("torch:1F1B", 4, 8)
except ImportError:
    pass
else:
    raise SystemExit("torch: names must need torch")
print(res.makespan)
"""


def test_plan_layer_runs_without_torch():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == 3 * 8 + (4 - 1)  # the paper's ZB-H1 makespan, unit costs
