"""Whether this process has the native weight capture, and how it gets it (``ZBPIPE_NATIVE``).

``ZBPIPE_NATIVE`` (read once per process, when its first deferred engine is built; ``0``,
``false`` and ``no`` mean ``off``, ``1``, ``true``, ``yes`` and ``on`` mean ``auto``):

* ``auto`` (the default): a build made before (any earlier process on this machine with this
  Python and torch, or ``python -m zbpipe build-native``) is loaded at once (milliseconds).
  Otherwise, where a C++ compiler and ninja are found, the build starts **in the background**,
  in a process of its own (about half a minute of one core), and the training job goes on with
  the output hook; each schedule switches to the native capture at the first step that begins
  after the build is done. Gradients are bitwise the same either way, so ranks switching at
  different steps train alike. One INFO line says the build started, one that it is in use
  (or why not).
* ``load``: load a build made before, never start one (the output hook where there is
  none). What zbpipe's own test suite and the ranks :func:`zbpipe.testing.launch.run_ranks`
  starts use unless told otherwise: a test run never compiles behind its own back.
* ``wait``: the same as ``auto``, but a schedule's construction waits for the build
  (benchmarks, a job that wants the same capture in every step).
* ``off``: never build or load it: the output hook (and the Python ``autograd.Function``).

No compiler, a failed build (its log is kept: ``python -m zbpipe build-native`` shows it and
retries), an unknown platform: one INFO line, and the output hook. The state is per process
(one extension module per process, like torch's own extensions): every engine of the
process shares one build.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from types import ModuleType

from . import build_native as B

logger = logging.getLogger("zbpipe.engines.native")

__all__ = ["ENV", "NativeSource", "mode", "source"]

ENV = "ZBPIPE_NATIVE"
MODES = ("auto", "load", "wait", "off")


def mode() -> str:
    """``ZBPIPE_NATIVE`` read and checked: ``auto``, ``load``, ``wait`` or ``off``."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value in ("0", "false", "no"):
        value = "off"
    elif value in ("1", "true", "yes", "on"):
        value = "auto"
    if value not in MODES:
        raise ValueError(
            f"zbpipe: {ENV}={os.environ[ENV]!r} is not one of {', '.join(MODES)} (auto: load the "
            "native weight capture, building it in the background if needed; load: only a build "
            "made before; wait: build it before the first step; off: never use it)"
        )
    return value


class NativeSource:
    """This process's native capture: the module once loaded, or a build under way.

    :meth:`poll` is what a schedule asks at each step's start: the module, or None (not yet,
    or never). Cheap when settled (an attribute read).
    """

    def __init__(self) -> None:
        self.module: ModuleType | None = None
        #: why there is no module ('' while undecided or loaded)
        self.reason = ""
        self._target: B.Target | None = None
        self._builder: subprocess.Popen[bytes] | None = None
        self._started = 0.0
        #: whether a step was told it runs beside the background build (once per process)
        self._step_told = False

    def start(self, how: str) -> None:
        """Load, build or decline, as ``how`` (a :func:`mode`) says; logs what it does."""
        if how == "off":
            return self._decline(f"{ENV}=off", level=logging.DEBUG)
        if B.NAME in sys.modules:  # preloaded (the fork server), or another engine loaded it
            self.module = sys.modules[B.NAME]
            return None
        try:
            t = self._target = B.target()
        except Exception as e:  # the source unreadable, say: the hook, said once
            return self._decline(f"no build folder ({e})")
        if t.is_built():
            return self._load(t, "")
        if t.has_failed():
            return self._decline(
                f"its build failed before (log: {t.log}; `python -m zbpipe build-native` "
                "retries and shows why)"
            )
        if how == "load":
            return self._decline(
                f"it is not built ({ENV}=load; `python -m zbpipe build-native` builds it)"
            )
        missing = B.toolchain_missing()
        if missing is not None or sys.platform == "win32":
            return self._decline(missing or "no build on Windows yet")
        unwritable = B.unwritable(t)
        if unwritable is not None:
            return self._decline(
                f"{unwritable}; set TORCH_EXTENSIONS_DIR to a writable folder, or build it "
                "where one is with `python -m zbpipe build-native`"
            )
        if how == "wait":
            logger.info(
                "zbpipe: building the native weight capture (one C++ file, about half a minute "
                "of one core; once per machine and torch) before the first step, as %s=wait "
                "asks, in %s",
                ENV,
                t.directory,
            )
            try:
                built = B.build(t)
            except RuntimeError as e:
                return self._decline(f"the build failed: {e} (log: {t.log})")
            except OSError as e:  # no flock on this filesystem, say: the hook, never a crash
                return self._decline(f"the build could not start: {e}")
            if not built:  # another process's build failed while this one waited for it
                return self._decline(
                    f"its build failed in another process (log: {t.log}; `python -m zbpipe "
                    "build-native` retries and shows why)"
                )
            return self._load(t, " (built)")
        self._spawn(t)
        return None

    def poll(self) -> ModuleType | None:
        """The module if loaded; loads it when the background build has just finished."""
        builder = self._builder
        if builder is None or builder.poll() is None:
            return self.module
        self._builder = None
        assert self._target is not None
        took = time.monotonic() - self._started
        if builder.returncode == 0 and self._target.is_built():
            self._load(self._target, f" (built in the background in {took:.0f} s)")
        else:
            log = f"log: {self._target.log}; " if self._target.log.is_file() else ""
            self._decline(
                f"the background build failed (exit status {builder.returncode}; {log}"
                "`python -m zbpipe build-native` retries and shows why)"
            )
        return self.module

    @property
    def building(self) -> bool:
        return self._builder is not None

    def step_begins(self) -> None:
        """A schedule's step begins (after :meth:`poll`): the first one that starts while the
        background build runs says so, once per process, at INFO. The build's core is taken
        from the training job (on the issue 47 runs, a 2-core machine, that first run was 35%
        slower), and the start line went out at construction, far above the step lines a user
        reads, so the step's log names it with the command that builds it ahead of a job."""
        if self._step_told or not self.building:
            return
        self._step_told = True
        logger.info(
            "zbpipe: this step runs while the native weight capture builds in the background "
            "(about half a minute of one core, taken from this job: steps are slower until it "
            "is done, then the deferred Linears switch to it). Build it ahead of a job, once per "
            "machine and torch: `python -m zbpipe build-native`; or %s=off",
            ENV,
        )

    def _spawn(self, t: B.Target) -> None:
        script = os.path.abspath(B.__file__)
        self._started = time.monotonic()
        # A process of its own, not a thread: no thread in the training process (a fork of it,
        # a DataLoader worker say, is safe), and a build outlives this process if it ends
        # first: the next one finds it done instead of a half-written folder.
        self._builder = subprocess.Popen(
            [sys.executable, script, str(t.directory)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        logger.info(
            "zbpipe: building the native weight capture in the background (one C++ file, "
            "about half a minute of one core; once per machine and torch; in %s). The "
            "deferred Linears use the output hook until it is built, then switch at a step's "
            "start. Prebuild: `python -m zbpipe build-native`; opt out: %s=off",
            t.directory,
            ENV,
        )

    def _load(self, t: B.Target, how: str) -> None:
        try:
            self.module = B.load(t)
        except Exception as e:  # a corrupt .so, an ABI surprise: the hook, said once
            return self._decline(f"loading {t.library} failed: {e}")
        logger.info("zbpipe: the deferred Linears use the native weight capture%s", how)
        return None

    def _decline(self, why: str, level: int = logging.INFO) -> None:
        self.reason = why
        logger.log(level, "zbpipe: no native weight capture: %s; the output hook runs", why)


_SOURCE: list[NativeSource] = []  # the process's one source (a list: no global statement)


def source() -> NativeSource:
    """This process's :class:`NativeSource`, started on first use (``ZBPIPE_NATIVE`` read)."""
    if not _SOURCE:
        src = NativeSource()
        src.start(mode())
        _SOURCE.append(src)
    return _SOURCE[0]
