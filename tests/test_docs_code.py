"""Every python code block in the docs runs, unless it is marked as one that cannot run here.

Convention: a block that needs a process group (torchrun, several ranks), or is a signature or
a fragment that uses names defined elsewhere, is preceded by the line

    <!-- docs-test: skip (why) -->

(an HTML comment: invisible on the rendered page). Every other ```python block must run as a
script, on its own, in a fresh interpreter with no process group: that is what a reader who
copies it gets. A new example is therefore tested unless its author says why it cannot be.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)```", re.S)
_SKIP = re.compile(r"<!-- docs-test: skip \((?P<why>[^)]+)\) -->")


def _blocks():
    for page in PAGES:
        text = "\n" + page.read_text()
        for m in _BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n")
            skip = _SKIP.fullmatch(m.group("before").strip())
            yield pytest.param(
                m.group("code"),
                id=f"{page.relative_to(ROOT)}:{line}",
                marks=[pytest.mark.skip(reason=skip.group("why"))] if skip else [],
            )


@pytest.mark.parametrize("code", list(_blocks()))
def test_docs_code_block_runs(code, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"the block failed:\n{code}\n--- stderr ---\n{result.stderr}"


def test_skip_markers_sit_right_before_a_python_block():
    # A marker anywhere else would silently stop protecting nothing: catch typos in the convention.
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if "docs-test:" in line:
                assert _SKIP.fullmatch(line.strip()), f"{page.name}:{i + 1}: malformed marker"
                assert lines[i + 1].startswith("```python"), f"{page.name}:{i + 1}: no block after"
