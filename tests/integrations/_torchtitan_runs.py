"""A server that runs torchtitan's own ``python -m torchtitan.train``, each run in fresh processes
forked from one that imported torch and torchtitan's stack once.

    python tests/integrations/_torchtitan_runs.py [MODULE ...]

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

On MoE models each rank also logs the load-balancing state of the MoE layers it holds
(:func:`_log_moe_state`): before every optimizer step, each layer's tokens per expert (what
torchtitan's step pre-hook turns into the expert-bias update), and after training each layer's
expert bias, as ``zbpipe-test-moe:`` lines. Nothing is logged for a model without MoE layers.
And every rank logs what zbpipe's W computed (:func:`_count_w_gemms`, ``zbpipe-test-w:``).
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
MOE_MARKER = "zbpipe-test-moe: "
W_MARKER = "zbpipe-test-w: "


def _moe_layers(model_parts: list) -> list:
    """``(fqn, moe module)`` of every MoE layer in ``model_parts`` (torchtitan 0.3's decoders: a
    ``layers`` ModuleDict keyed by the layer's index in the whole model)."""
    found = []
    for part in model_parts:
        layers = getattr(part, "layers", None)
        for key, block in getattr(layers, "items", dict)():
            if getattr(block, "moe_enabled", False):
                found.append((f"layers.{key}", block.moe))
    return found


def _log_moe_state() -> None:
    """Make torchtitan's ``Trainer.train`` log the MoE load-balancing state (module docstring).

    The tokens per expert are read by a global optimizer step pre-hook (torch runs those before
    an optimizer's own pre-hooks, where torchtitan turns the counts into the bias update and
    zeroes them), once per training step."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    try:
        from torchtitan.trainer import Trainer
    except ModuleNotFoundError:
        # torchtitan 0.2 defines its Trainer in torchtitan.train, which runpy executes afresh
        # as __main__ (a patch here would not reach it); its runs are dense, nothing to log.
        return

    original = Trainer.train

    def train(self):  # type: ignore[no-untyped-def]
        layers = _moe_layers(self.model_parts)
        logged = set()

        def before_step(optimizer, args, kwargs):  # type: ignore[no-untyped-def]
            if self.step in logged:
                return
            logged.add(self.step)
            for fqn, moe in layers:
                tokens = [float(v) for v in moe.tokens_per_expert_E.detach().cpu().tolist()]
                print(f"{MOE_MARKER}step={self.step} {fqn} tokens={tokens}", flush=True)

        hook = register_optimizer_step_pre_hook(before_step) if layers else None
        try:
            return original(self)
        finally:
            if hook is not None:
                hook.remove()
            for fqn, moe in layers:
                bias = getattr(moe, "expert_bias_E", None)
                if bias is not None:
                    values = [float(v) for v in bias.detach().cpu().tolist()]
                    print(f"{MOE_MARKER}final {fqn} bias={values}", flush=True)

    Trainer.train = train


def _count_w_gemms() -> dict[str, object]:
    """Count, in this process, what zbpipe's W computes during the next run: every weight GEMM
    its stores ran (``gemms``, the native capture's included) and the distinct weights of the
    GEMMs queued on the Python side (``weights``: compiled Linears queue there; eager ones may go
    to the native capture). Read by the Trainer tests as a behaviour (the split reached W), not
    as a time. Installed before the run, so the run's own zbpipe import finds the patched class
    (a no-op where zbpipe is not importable)."""
    counts: dict[str, object] = {"gemms": 0, "weights": set()}
    try:
        from zbpipe.engines.weight_store import WeightGradStore
    except ImportError:
        return counts
    original = WeightGradStore.run

    def run(self):  # type: ignore[no-untyped-def]
        counts["gemms"] += self.num_gemms  # type: ignore[operator]
        counts["weights"].update(id(e[0]) for e in self._entries or ())  # type: ignore[attr-defined]
        return original(self)

    WeightGradStore.run = run
    return counts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # every interface, as torch's stores bind
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, name: str, args: list[str], log_dir: str) -> None:
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
        )
        print(f"\n{MARKER}{name}", flush=True)  # on a line of its own, whatever came before
        # before any torchtitan import: 0.2's configuration takes the argv of its import
        sys.argv = ["torchtitan.train", *args]
        _log_moe_state()
        w = _count_w_gemms()
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
        print(f"{W_MARKER}gemms={w['gemms']} weights={len(w['weights'])}", flush=True)
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
    for name, args in request["runs"]:
        port = free_port()
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                os.setsid()  # a group of its own: a kill reaches what it starts
                _rank(rank, world, port, name, args, log_dir)
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
