"""The torchtitan 0.2.x TOML recipes name what exists: a zbpipe schedule and an importable module.

The debug-model files run in tests/integrations/test_torchtitan02_trainer.py (torchtitan 0.2.2
only, not in the default suite); the 8B files need GPUs and run nowhere here. This checks all of
them without torchtitan: each parses, its ``pipeline_parallel_schedule`` is one of zbpipe's names,
and its ``custom_import`` is ``zbpipe.torchtitan`` or a module in recipes/torchtitan/ that
imports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zbpipe.integrations.names import lookup_zbpipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # torchtitan's own fallback on Python 3.10
    tomllib = pytest.importorskip("tomli")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "torchtitan"
TOMLS = sorted(RECIPE.glob("*.toml"))


def test_there_are_toml_recipes():
    assert {p.name for p in TOMLS} >= {"llama3_debug_cpu_zbv.toml", "llama3_debug_cpu_zbh1.toml"}


@pytest.mark.parametrize("path", TOMLS, ids=lambda p: p.name)
def test_toml_names_a_zbpipe_schedule(path):
    schedule = tomllib.loads(path.read_text())["parallelism"]["pipeline_parallel_schedule"]
    assert lookup_zbpipe(schedule) is not None, (
        f"{path.name}: {schedule!r} is not a zbpipe schedule"
    )


@pytest.mark.parametrize("path", TOMLS, ids=lambda p: p.name)
def test_toml_custom_import_installs_zbpipe(path):
    module = tomllib.loads(path.read_text())["experimental"]["custom_import"]
    if module == "zbpipe.torchtitan":
        return
    source = RECIPE / f"{module}.py"
    assert source.is_file(), f"{path.name}: custom_import {module!r} is not in {RECIPE}"
    assert "import zbpipe.torchtitan" in source.read_text()
