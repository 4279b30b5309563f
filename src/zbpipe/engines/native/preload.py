"""Imported by the fork server of :mod:`zbpipe.testing.launch` before it forks any rank: loads
the native weight capture if it is built already (never builds it), so every forked rank has
it without importing it again. ``ZBPIPE_NATIVE=off`` loads nothing."""

from __future__ import annotations

import contextlib

from . import availability as A
from . import build_native as B

with contextlib.suppress(Exception):  # an optimisation: a rank loads (or builds) it itself
    if A.mode() != "off" and (t := B.target()).is_built():
        B.load(t)
