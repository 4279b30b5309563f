"""Build and load zbpipe's native weight capture (``capture.cpp``, shipped as package data).

Built with torch's JIT extension builder (:func:`torch.utils.cpp_extension.load`: ninja and the
C++ compiler that built extensions use, ``c++`` or ``$CXX``) into a folder of its own::

    <$TORCH_EXTENSIONS_DIR, else torch's default build root>/zbpipe_native/<tag>/

``tag`` names the Python and torch versions and a hash of everything the binary depends on:
the source, torch's version and git revision, Python's version, the OS, CPU architecture and C
library, and the flags (not the kernel's release: a build made in a container image's build,
or on a login node, is the one the compute nodes load).
Another torch (a second virtual environment, an upgrade) gets another folder, and each folder
is built once per machine. Loading a built folder imports its ``.so`` directly: no ninja run,
no lock, a few milliseconds.

**One build at a time, and never a stale lock.** torch's own lock is a file that its holder
deletes when done: a build killed midway (a job's time limit, Ctrl-C) leaves it behind, and
every later load of that extension then waits on it forever. Here every builder first takes
an ``flock`` on ``<tag>.lock`` next to the folder, which the kernel releases when its holder
exits however it exits; while holding it, any torch lock file in the folder is stale and is
removed. The ranks of a job on one machine (and the processes of a test run) queue on the
flock: one builds, the others find the build done (a stamp file written after it) and load.
A build that fails writes its log to ``build.log`` and a ``failed`` marker, so the processes
after it do not retry (``python -m zbpipe build-native`` does, and says why it failed).

This file imports only the standard library at the top: run as a script
(``python build_native.py DIR``) it is the background builder a training process starts
(:mod:`zbpipe.engines.native.availability`), and where the build is done already it exits
without importing torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

#: the extension's module name (its ``PyInit_`` symbol): one per process, whichever folder
NAME = "zbpipe_native_capture"
SOURCE = Path(__file__).with_name("capture.cpp")
CFLAGS = ("-O2",)
#: exit status of the background builder when the build failed (its log says why)
FAILED = 3


@dataclass(frozen=True)
class Target:
    """Where the native capture for this Python and torch is built."""

    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / f"{NAME}.so"

    @property
    def stamp(self) -> Path:
        """Written after a build completed: a folder without it is not loaded."""
        return self.directory / "built"

    @property
    def failed(self) -> Path:
        return self.directory / "failed"

    @property
    def log(self) -> Path:
        return self.directory / "build.log"

    @property
    def lock(self) -> Path:
        return self.directory.with_name(self.directory.name + ".lock")

    def is_built(self) -> bool:
        return self.stamp.is_file() and self.library.is_file()

    def has_failed(self) -> bool:
        return self.failed.is_file()


def build_root() -> Path:
    """``$TORCH_EXTENSIONS_DIR``, else the folder ``torch.utils.cpp_extension``'s
    ``get_default_build_root()`` names, without importing that module (it imports setuptools:
    a quarter of a second in every process that only loads a built capture)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    if sys.platform == "darwin":
        cache = Path("~/Library/Caches").expanduser()
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser())
    return Path(os.path.realpath(cache / "torch_extensions"))


def target() -> Target:
    """The folder for this process's Python and torch (imports torch)."""
    import torch

    root = build_root()
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (
        torch.__version__,
        str(torch.version.git_version),
        sys.version,
        # what the binary depends on: the OS, the CPU architecture and the C library, never
        # the kernel's release (platform.platform() has it): a capture built in a container
        # image or on a login node must be the one its compute nodes load
        sys.platform,
        platform.machine(),
        " ".join(platform.libc_ver()),
        " ".join(CFLAGS),
    ):
        h.update(b"\0" + part.encode())
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    tv = torch.__version__.replace("+", "_")
    return Target(root / "zbpipe_native" / f"{py}-torch{tv}-{h.hexdigest()[:16]}")


def toolchain_missing() -> str | None:
    """Why this machine cannot build (no C++ compiler, no ninja), or None."""
    import shutil

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    if shutil.which("ninja") is None:
        return "no ninja on PATH (torch's extension builder needs it: pip install ninja)"
    return None


def unwritable(t: Target) -> str | None:
    """Why this process cannot build ``t`` (its build root cannot be made or written: a
    read-only home or cache), or None. Checked before a build starts, so such a machine logs
    one line and runs the Python capture instead of failing in a builder."""
    parent = t.directory.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot make its build folder ({e})"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"its build folder {parent} is not writable"
    return None


def load(t: Target) -> ModuleType:
    """Import the built extension (once per process: a second call returns the first module)."""
    loaded = sys.modules.get(NAME)
    if loaded is not None:
        return loaded
    import torch  # noqa: F401  # the extension links against the libraries torch loads

    spec = importlib.util.spec_from_file_location(NAME, t.library)
    if spec is None or spec.loader is None:
        raise ImportError(f"zbpipe: cannot import {t.library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[NAME] = module
    return module


@contextlib.contextmanager
def _locked(t: Target) -> Iterator[None]:
    """Hold the flock on ``t.lock`` (blocks while another process builds)."""
    import fcntl

    t.directory.parent.mkdir(parents=True, exist_ok=True)
    with open(t.lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(t: Target, *, retry: bool = False, verbose: bool = False) -> bool:
    """Build ``t`` unless built (or, without ``retry``, failed before); True when it is built.

    Waits while another process builds it. A failure writes ``t.log`` and ``t.failed`` and
    raises :class:`RuntimeError` with the compiler's message.
    """
    with _locked(t):
        if t.is_built():
            return True
        if t.has_failed() and not retry:
            return False
        t.directory.mkdir(parents=True, exist_ok=True)
        for stale in (t.failed, t.directory / "lock"):  # torch's lock: its builder is gone
            stale.unlink(missing_ok=True)
        started = time.monotonic()
        try:
            _torch_build(t, verbose)
        except Exception as e:
            t.log.write_text(f"{type(e).__name__}: {e}\n")
            t.failed.write_text(f"see {t.log}\n")
            raise RuntimeError(f"zbpipe: building {SOURCE.name} failed: {e}") from e
        t.log.write_text(f"built in {time.monotonic() - started:.1f} s\n")
        t.stamp.write_text(f"{SOURCE}\n")
        return True


def _torch_build(t: Target, verbose: bool) -> None:
    from torch.utils.cpp_extension import load as torch_load

    torch_load(
        name=NAME,
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        build_directory=str(t.directory),
        verbose=verbose,
    )


def main(argv: list[str]) -> int:
    """The background builder: ``build_native.py DIR`` builds the target in DIR (computed by
    the process that starts it). Exit 0: built; :data:`FAILED`: the build failed."""
    t = Target(Path(argv[0]))
    if t.is_built():  # the usual case for every rank but one: no torch import
        return 0
    try:
        return 0 if build(t) else FAILED
    except (RuntimeError, OSError):  # OSError: no flock on this filesystem, a read-only root
        return FAILED


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
