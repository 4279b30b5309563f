"""A server that runs torchtitan's own ``python -m torchtitan.train``, each run in fresh processes
forked from one that imported torch and torchtitan's stack once.

    python -m zbpipe.testing.torchtitan_runs [MODULE ...]

It imports the MODULEs (torch, torchtitan's trainer and data stack: about 13 s of CPU a process,
several times what a 3-step run of a debug model takes), prints ``ready``, then reads one JSON
request per line from stdin, ``{"ranks": N, "runs": [[name, [arg, ...]], ...], "log_dir": DIR,
"timeout": S}``, and answers each with one JSON line, ``{"ok": bool, "error": text}``. For every
run, in order, it forks N rank processes with what torchrun gives a rank (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: a port free at that moment, one
per run); each runs the module ``torchtitan.train`` exactly as ``python -m torchtitan.train
ARG...`` would (``runpy`` with ``run_name="__main__"``, which is what ``-m`` does): torchtitan's
entry parses the arguments, builds its Trainer, trains, closes it and destroys the process group.
A run that fails or outlives the request's timeout (its ranks are killed) ends the request.

Why forks and not one torchrun launch per group of runs (before issue 45): every launch paid the
imports again in each rank and in torchrun's agent, and a process could hold one compiled
Trainer only (the next one's first recompile failed building a dynamo guard on torchtitan's SPMD
mesh stack: two copies of ``torchtitan.distributed.spmd_types``, the one a module alias of
dynamo pointed at and the one the run read). A fork starts each run from the same clean state,
compiled or not. The server never initializes a process group and runs nothing of torchtitan's.
torchtitan 0.2's configuration reads ``sys.argv`` when its config module is imported: for it
the caller preloads torch and the data stack only.

Every rank appends its stdout and stderr to ``DIR/rank{RANK}.log``, a line ``zbpipe-test-run:
NAME`` before each run, so the caller can split a rank's log by run.

Optional in a request: a run may carry a third item, ``{VAR: value}``, set in its ranks'
environment (e.g. ``ZBPIPE_SPLIT=default``); ``"hooks": MODULE`` names a module whose
``install()`` each rank calls before the run (what it patches, the run's imports then find) and
whose return value, a callable or None, it calls after a run that succeeded (the Trainer tests
log MoE state and W's GEMMs so: tests/integrations/_torchtitan_hooks.py).

Shared by the Trainer tests (tests/integrations/_torchtitan_trainer.py) and
benchmarks/trainer.py, which times runs without hooks; it lives in the package so that a
benchmark imports nothing from tests/.
"""

import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

MARKER = "zbpipe-test-run: "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # every interface, as torch's stores bind
        return s.getsockname()[1]


def _rank(
    rank: int,
    world: int,
    port: int,
    name: str,
    args: list[str],
    log_dir: str,
    env: dict[str, str],
    hooks: str | None,
) -> None:
    """The body of one forked rank: what torchrun's rank would run, then ``os._exit``."""
    code = 1
    try:
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "a")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **env,
        )
        print(f"\n{MARKER}{name}", flush=True)  # on a line of its own, whatever came before
        # before any torchtitan import: 0.2's configuration takes the argv of its import
        sys.argv = ["torchtitan.train", *args]
        # installed before the run, so the run's own imports find what they patch
        after = importlib.import_module(hooks).install() if hooks else None
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
        if after is not None:
            after()
        code = 0
    except SystemExit as exit_:  # torchtitan's entry may exit; 0 or None is success
        code = 0 if exit_.code in (0, None) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(request: dict) -> dict:
    """Run the request's runs in order, each in fresh forked ranks; the first failure ends it."""
    world, log_dir, timeout = request["ranks"], request["log_dir"], request["timeout"]
    hooks = request.get("hooks")
    for name, args, *env in request["runs"]:
        port = free_port()
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                os.setsid()  # a group of its own: a kill reaches what it starts
                _rank(rank, world, port, name, args, log_dir, env[0] if env else {}, hooks)
            pids.append(pid)
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        while len(codes) < len(pids) and time.monotonic() < deadline:
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if any(codes.values()):
                break  # a rank failed: its peers would wait on it
            time.sleep(0.05)
        for pid in pids:  # the survivors of a failure or of the deadline
            if pid not in codes:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
        if len(codes) < len(pids) and not any(codes.values()):
            return {"ok": False, "error": f"run {name!r}: over {timeout} s"}
        if any(codes.values()):
            return {"ok": False, "error": f"run {name!r}: exit codes {list(codes.values())}"}
    return {"ok": True, "error": ""}


def main() -> None:
    preload, sys.argv[1:] = sys.argv[1:], []  # no module imported here sees them as options
    for module in preload:
        importlib.import_module(module)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_serve(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
