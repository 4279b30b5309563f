"""Fixtures shared by more than one test file.

Only fixtures live here: pytest finds them by name, and a conftest is not meant to be imported.
Plain helpers that tests import are modules beside it (``_strategies.py``, the ``_*_cases.py``
bodies of the multi-rank tests). Imports are inside the fixtures, so the plan-layer tests that
need none of them do not pay for importing torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# torch on one intra-op thread in the pytest process too, as in every rank
# (zbpipe.testing.launch): the references computed here are tiny ops, for which a second thread
# only spins, and on the 2-core CI machine the ranks hold the cores (issue 45: test_continuous.py
# took 44 s of CPU on two threads, 15 s on one, ranks included). Read when torch is first
# imported, which no fixture here does before the tests that need it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite never builds zbpipe's native weight capture behind its own back (a build is half a
# minute of a core CI does not have): a process of it, and every rank it starts, loads a build
# made before or runs the Python capture. Only the native_capture fixture builds.
os.environ.setdefault("ZBPIPE_NATIVE", "load")


@pytest.fixture
def torch_get() -> Iterator[Any]:
    """torch's own get_schedule_class, with zbpipe registered for the test and unregistered after.

    Registering rebinds torch's module-level function; unregistering puts torch's back, so no
    other test sees zbpipe's names in torch's lookup unless it registers them itself.
    """
    import torch.distributed.pipelining.schedules as torch_schedules

    from zbpipe.integrations import names as registration

    registration.register()
    yield torch_schedules.get_schedule_class
    registration.unregister()


@pytest.fixture(scope="session")
def native_capture() -> Any:
    """zbpipe's native weight capture (the extension module), built once per machine and torch
    if it is not yet (the one place in the suite that builds it: about half a minute of a core,
    then cached in torch's extension folder for every later run). Skips only where this machine
    has no C++ compiler or ninja; a build that fails there fails the tests that use it."""
    import sys

    from zbpipe.engines.native import build_native, prebuild

    missing = build_native.toolchain_missing()
    if missing is not None:
        pytest.skip(f"no native weight capture on this machine: {missing}")
    ok, message = prebuild()
    assert ok, message
    return sys.modules[build_native.NAME]
