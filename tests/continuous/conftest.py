"""Fixtures for this folder's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """torch on one intra-op thread in this process while a module's tests run, as in every rank
    (zbpipe.testing.launch): the unpipelined references computed here are tiny ops, for which a
    second thread only spins. On the 2-core CI machine, loaded by the ranks, that spinning was
    most of the CPU time tests/continuous/test_continuous.py took (44 s against 18 s on one
    thread, whole file, ranks included)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
