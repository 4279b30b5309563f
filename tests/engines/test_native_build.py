"""How a process gets the native weight capture (zbpipe.engines.native): ZBPIPE_NATIVE, the
folder per Python and torch, the build in a process of its own behind an flock (never a stale
lock), the failure marker, the fork server's preload, the command line, the wheel's source.

The builds here are stand-ins (a ``_torch_build`` that writes a file, a stub module) except
where a test says otherwise: the real build is the ``native_capture`` fixture's, once per
machine and torch. Each test points ``TORCH_EXTENSIONS_DIR`` at its own folder.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from zbpipe.engines import native
from zbpipe.engines.native import availability as A
from zbpipe.engines.native import build_native as B

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty build root and no extension loaded in this process (as far as the code under
    test can tell): the target it computes is unbuilt."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delitem(sys.modules, B.NAME, raising=False)
    return B.target()


def _fake_build(t: B.Target, verbose: bool) -> None:
    t.library.write_text("not a real library")


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, "auto"),
        ("auto", "auto"),
        ("load", "load"),
        ("WAIT", "wait"),
        ("off", "off"),
        ("0", "off"),
        ("false", "off"),
        ("No", "off"),
        ("1", "auto"),
        ("true", "auto"),
        ("yes", "auto"),
        ("ON", "auto"),
    ],
)
def test_zbpipe_native_is_read_and_checked(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(A.ENV, raising=False)
    else:
        monkeypatch.setenv(A.ENV, value)
    assert A.mode() == expected


def test_an_unknown_zbpipe_native_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(A.ENV, "always")
    expected = "ZBPIPE_NATIVE='always' is not one of auto, load, wait, off"
    with pytest.raises(ValueError, match=expected):
        A.mode()


def test_the_build_root_is_torchs(monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert B.build_root() == Path(get_default_build_root())


def test_the_folder_is_per_python_and_torch_and_source(fresh, monkeypatch):
    import torch

    assert fresh.directory.parent.parent == Path(os.environ["TORCH_EXTENSIONS_DIR"])
    assert f"torch{torch.__version__.replace('+', '_')}" in fresh.directory.name
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert B.target().directory != fresh.directory


def test_the_folder_does_not_depend_on_the_kernel_release(fresh, monkeypatch):
    """A capture prebuilt in a container image's build or on a login node (another kernel than
    the compute nodes') is the one the job loads; another CPU architecture or C library is not."""
    import platform

    libc_ver = platform.libc_ver
    monkeypatch.setattr(platform, "release", lambda: "0.0.0-another-kernel")
    monkeypatch.setattr(platform, "platform", lambda *a, **k: "Linux-0.0.0-another-kernel")
    assert B.target().directory == fresh.directory
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "0.1"))
    assert B.target().directory != fresh.directory
    monkeypatch.setattr(platform, "libc_ver", libc_ver)
    monkeypatch.setattr(platform, "machine", lambda: "another-arch")
    assert B.target().directory != fresh.directory


def test_off_loads_nothing(fresh):
    src = A.NativeSource()
    src.start("off")
    assert src.module is None and src.poll() is None and "off" in src.reason


def test_load_takes_a_build_made_before_and_never_starts_one(fresh, monkeypatch, caplog):
    """What the test suite and the ranks of zbpipe.testing.launch run with: no build behind
    their back, one line saying so; a build made before is loaded."""
    monkeypatch.setattr(B, "_torch_build", lambda t, v: pytest.fail("load started a build"))
    src = A.NativeSource()
    with caplog.at_level(logging.INFO, logger="zbpipe.engines.native"):
        src.start("load")
    assert src.module is None and not src.building and not fresh.directory.exists()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "it is not built (ZBPIPE_NATIVE=load" in line and "output hook" in line
    fresh.directory.mkdir(parents=True)
    _fake_build(fresh, False)
    fresh.stamp.write_text("built before\n")
    stub = types.ModuleType(B.NAME)
    monkeypatch.setattr(B, "load", lambda t: stub)
    src = A.NativeSource()
    src.start("load")
    assert src.module is stub


def test_without_a_compiler_the_hook_runs_and_one_line_says_why(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    src = A.NativeSource()
    with caplog.at_level(logging.INFO, logger="zbpipe.engines.native"):
        src.start("auto")
    assert src.module is None and not src.building
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no C++ compiler ('no-such-compiler-here'" in line and "output hook" in line


def test_a_background_build_waits_its_turn_and_is_taken_up_when_done(fresh, monkeypatch, caplog):
    """The builder runs in a process of its own; while another holds the lock it waits (the
    engine keeps polling: no module yet); once the build is there it exits and the next poll
    loads it."""
    if B.toolchain_missing() is not None:
        pytest.skip("the source declines to build without a toolchain")
    stub = types.ModuleType(B.NAME)
    monkeypatch.setattr(B, "load", lambda t: stub)
    src = A.NativeSource()
    caplog.set_level(logging.INFO, logger="zbpipe.engines.native")
    with B._locked(fresh):
        src.start("auto")
        try:
            assert src.building and "in the background" in caplog.records[-1].getMessage()
            time.sleep(0.5)
            assert src.poll() is None  # its builder is waiting on our lock
            fresh.directory.mkdir(parents=True)
            _fake_build(fresh, False)
            fresh.stamp.write_text("built by the test\n")
        except BaseException:  # never let the builder go on to a real build once we let go
            if src._builder is not None:
                src._builder.kill()
                src._builder.wait()
            raise
    deadline = time.monotonic() + 60
    while src.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert src.module is stub and not src.building
    assert "built in the background" in caplog.records[-1].getMessage()


def test_a_killed_builder_leaves_no_lock_behind(fresh, monkeypatch):
    """The flock goes with its holder, however it ends (torch's lock file would not). The
    builder's flock is made non-blocking here: a lock still held raises at once, where the
    builder would wait (no clock: a held lock is seen held, a released one is free)."""
    import fcntl

    flock = fcntl.flock
    monkeypatch.setattr(fcntl, "flock", lambda f, op: flock(f, op | fcntl.LOCK_NB))
    fresh.directory.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
            str(fresh.lock),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(BlockingIOError), B._locked(fresh):  # held while its holder lives
            pass
    finally:
        holder.kill()
        holder.wait()
    with B._locked(fresh):  # then free: taken without waiting
        pass


def test_a_stale_torch_lock_is_removed_and_a_build_stamped(fresh, monkeypatch):
    fresh.directory.mkdir(parents=True)
    (fresh.directory / "lock").write_text("")  # torch's, left by a killed build

    def build(t, verbose):
        assert not (t.directory / "lock").exists()
        _fake_build(t, verbose)

    monkeypatch.setattr(B, "_torch_build", build)
    assert B.build(fresh) and fresh.is_built()


def test_a_failed_build_is_logged_not_retried_and_retried_on_request(fresh, monkeypatch, caplog):
    if B.toolchain_missing() is not None:
        pytest.skip("the source declines to build without a toolchain")

    def broken(t, verbose):
        raise RuntimeError("Error building extension: capture.cpp:1: error: oops")

    monkeypatch.setattr(B, "_torch_build", broken)
    with pytest.raises(RuntimeError, match="oops"):
        B.build(fresh)
    assert fresh.has_failed() and "oops" in fresh.log.read_text()
    src = A.NativeSource()
    with caplog.at_level(logging.INFO, logger="zbpipe.engines.native"):
        src.start("auto")  # no second build: the marker says it failed
    assert src.module is None and not src.building
    assert str(fresh.log) in caplog.records[-1].getMessage()
    monkeypatch.setattr(B, "_torch_build", _fake_build)
    monkeypatch.setattr(B, "load", lambda t: types.ModuleType(B.NAME))
    ok, message = native.prebuild()
    assert ok and "built the native weight capture" in message and not fresh.has_failed()


def test_wait_builds_before_returning(fresh, monkeypatch):
    if B.toolchain_missing() is not None:
        pytest.skip("the source declines to build without a toolchain")
    stub = types.ModuleType(B.NAME)
    monkeypatch.setattr(B, "_torch_build", _fake_build)
    monkeypatch.setattr(B, "load", lambda t: stub)
    src = A.NativeSource()
    src.start("wait")
    assert src.module is stub and fresh.is_built()


def test_the_fork_servers_preload_loads_a_built_capture(native_capture):
    """What zbpipe.testing.launch's fork server imports before forking ranks: the built
    extension, so no rank loads it, without torch's extension builder (setuptools); with
    ZBPIPE_NATIVE=off, nothing. One fresh interpreter (this one has imported the builder)."""
    code = (
        "import sys, zbpipe.engines.native.preload; "
        f"print({B.NAME!r} in sys.modules, 'torch.utils.cpp_extension' in sys.modules)"
    )
    env = {**os.environ, A.ENV: "auto", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "False"], out.stderr
    from zbpipe.testing import launch

    assert "zbpipe.engines.native.preload" in launch.PRELOAD


def test_the_preload_loads_nothing_when_off(native_capture, monkeypatch):
    import importlib

    monkeypatch.setenv(A.ENV, "off")
    monkeypatch.delitem(sys.modules, B.NAME)
    monkeypatch.delitem(sys.modules, "zbpipe.engines.native.preload", raising=False)
    importlib.import_module("zbpipe.engines.native.preload")
    assert B.NAME not in sys.modules


def test_the_command_line_builds_or_says_it_is_built(native_capture, capsys):
    from zbpipe.cli import main

    assert main(["build-native"]) == 0
    assert "the native weight capture is built already" in capsys.readouterr().out


def test_a_wheel_carries_the_source():
    """pyproject's package data names the C++ source beside its package."""
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["zbpipe.engines.native"]
    folder = ROOT / "src/zbpipe/engines/native"
    assert B.SOURCE.parent == folder
    assert any(B.SOURCE in folder.glob(p) for p in patterns)


@pytest.mark.parametrize("how", ["auto", "wait"])
def test_an_unwritable_build_root_runs_the_hook_and_says_so(tmp_path, monkeypatch, caplog, how):
    """A read-only home or cache (here: a build root below a plain file, which root cannot
    write either): one line saying so and the Python capture, never a crash in the schedule's
    construction (wait) or a builder that fails every job with a log it could not write (auto)."""
    if B.toolchain_missing() is not None:
        pytest.skip("the source declines to build without a toolchain")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker / "root"))
    monkeypatch.delitem(sys.modules, B.NAME, raising=False)
    monkeypatch.setattr(B, "_torch_build", lambda t, v: pytest.fail("a build was started"))
    src = A.NativeSource()
    with caplog.at_level(logging.INFO, logger="zbpipe.engines.native"):
        src.start(how)
    assert src.module is None and not src.building
    assert "TORCH_EXTENSIONS_DIR to a writable folder" in src.reason
    assert "output hook" in caplog.records[-1].getMessage()
    ok, message = native.prebuild()
    assert not ok and "cannot make its build folder" in message


def test_wait_behind_a_build_that_failed_elsewhere_says_so(fresh, monkeypatch):
    """Ranks of one machine under ``wait`` queue on the flock: when the one building fails,
    the others find its marker and say that (not a failed load of a library never made)."""
    if B.toolchain_missing() is not None:
        pytest.skip("the source declines to build without a toolchain")

    def failed_elsewhere(t, **kw):
        t.directory.mkdir(parents=True, exist_ok=True)
        t.failed.write_text("the other rank's\n")
        return False  # what build() returns behind another process's failure

    monkeypatch.setattr(B, "build", failed_elsewhere)
    monkeypatch.setattr(B, "load", lambda t: pytest.fail("loaded a library never built"))
    src = A.NativeSource()
    src.start("wait")
    assert src.module is None and "its build failed in another process" in src.reason


def test_build_native_over_a_corrupt_build_says_what_to_remove(fresh):
    """A stamped folder whose library cannot be imported (a disk filled during its link, a
    copy from another machine): the command says so and names the folder, no traceback."""
    fresh.directory.mkdir(parents=True)
    _fake_build(fresh, False)  # not a shared object
    fresh.stamp.write_text("built before\n")
    ok, message = native.prebuild()
    assert not ok and str(fresh.directory) in message and "remove" in message
