"""zbpipe's native weight capture: the deferred Linear's capture as a C++ autograd Function.

``capture.cpp`` (package data) is :class:`zbpipe.engines.weight_capture._LinearFunction` in C++,
op for op, with each (stage, microbatch) store's queue on the C++ side: no Python runs in F
beyond the call that enters it, none in B, and W adds the common case inside the GEMM in C++.
Gradients are bitwise those of the Python captures (tests/engines/test_native_capture.py).
It is built on the user's machine with torch's JIT extension builder, once per Python and torch
(:mod:`.build_native`); whether and when a process uses it is :mod:`.availability`
(``ZBPIPE_NATIVE``: ``auto``, ``load``, ``wait``, ``off``). docs/design/backward.md says why it
exists.
"""

from __future__ import annotations

from . import build_native
from .availability import ENV, NativeSource, mode, source

__all__ = ["ENV", "NativeSource", "mode", "prebuild", "source"]


def prebuild(*, verbose: bool = False) -> tuple[bool, str]:
    """Build this Python and torch's native capture now (again, if an earlier build failed)
    and load it: ``(ok, what happened)``. What ``python -m zbpipe build-native`` runs."""
    t = build_native.target()
    off = f" ({ENV}=off here: unset it to use it)" if mode() == "off" else ""
    if t.is_built():
        try:
            build_native.load(t)
        except Exception as e:  # a corrupt library: a traceback would not say what to do
            return False, (
                f"zbpipe: the native weight capture in {t.directory} is built but cannot be "
                f"loaded ({e}): remove that folder and run `python -m zbpipe build-native` again"
            )
        return True, f"zbpipe: the native weight capture is built already: {t.directory}{off}"
    missing = build_native.toolchain_missing() or build_native.unwritable(t)
    if missing is not None:
        return False, f"zbpipe: cannot build the native weight capture: {missing}"
    try:
        build_native.build(t, retry=True, verbose=verbose)
        build_native.load(t)
    except Exception as e:
        return False, f"{e}\n(log: {t.log})"
    return True, f"zbpipe: built the native weight capture in {t.directory}{off}"
