"""What zbpipe asks of torch's profiler: whether one is recording, and a cheap named range.

torch's action runtime opens a ``record_function`` range around every action, profiler or not
(pytorch #160753): a few microseconds of host time each with nothing recording. zbpipe's action
loop asks once per step whether a profiler records (:func:`profiler_recording`) and only then
opens one range per action, with torch's C++ context manager (:func:`profiler_range`), under the
names torch's runtime gives them (``PP:<action>``), so traces read the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._profiler import _RecordFunctionFast


def profiler_recording() -> bool:
    """Whether a profiler (torch.profiler, the autograd profiler, emit_nvtx) records on this
    thread now (``torch._C._autograd._profiler_enabled``)."""
    return bool(torch._C._autograd._profiler_enabled())


def profiler_range(name: str) -> Any:
    """A context manager recording ``name`` as one range (``_RecordFunctionFast``)."""
    return _RecordFunctionFast(name)
