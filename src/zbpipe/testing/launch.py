"""Run a function on N local processes joined by a gloo process group, and never hang.

Each rank runs ``fn(rank, world_size, *args)`` with ``torch.set_num_threads(1)`` (the machines
this is built for have few cores) and a process-group timeout. The launcher waits for all
results with a deadline: a rank that raises, dies or outlives the deadline fails the whole run
with every rank's traceback, and the survivors are terminated.

Ranks start from a fork server that has already imported torch (and zbpipe's runtime), where the
platform has one: importing torch costs each fresh interpreter seconds of CPU, which on a 2-core
machine was most of the multi-rank test suite's time. A forked rank imports only what ``fn``'s
module adds. Elsewhere ranks are spawned.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class RankFailure(RuntimeError):
    """One or more ranks raised, died, or timed out."""


#: imported once by the fork server, before it forks any rank (the last loads zbpipe's native
#: weight capture where it is built, so no rank loads it again)
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "zbpipe.schedules.runtime",
    "zbpipe.engines.native.preload",
)


def _context() -> Any:
    """The process context ranks start from: a fork server with torch preloaded, else spawn.

    The fork server is started by the first call and serves every later one in this process (it
    keeps the environment and ``sys.path`` of that moment). Importing torch starts no threads, so
    forking after it is safe; each rank still sets its own thread count.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, pg_timeout: float, fn: Callable, args: tuple, q: Any
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a rank of a test loads zbpipe's native weight capture where it is built, and never starts
    # a build of it in the background (zbpipe.engines.native.availability)
    os.environ.setdefault("ZBPIPE_NATIVE", "load")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world, *args)
        # Pickle here, not in the queue's feeder thread: an unpicklable result (a tensor that
        # requires grad, say) must fail this rank now, not vanish and leave the parent waiting.
        payload = pickle.dumps(result)
        q.put((rank, "ok", payload))
    except BaseException:
        tb = traceback.format_exc()
        q.put((rank, "error", tb))
        # Flush the queue's feeder thread, then exit at once: a clean shutdown of the process
        # group could wait on peers that are themselves waiting on this rank.
        q.close()
        q.join_thread()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level). Raises
    :class:`RankFailure` if any rank fails or the run exceeds ``timeout`` seconds.

    Long because start, wait with a deadline, collect and clean up are one loop over the ranks'
    results.
    """
    ctx = _context()
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, pg_timeout, fn, args, q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results and r not in errors
                ]
                for r in dead:
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                if errors and not any(p.is_alive() for p in procs):
                    break
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors:
                # One rank failed: give the others a moment to report, then stop them.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or missing:
        lines = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        if missing:
            lines.append(f"ranks {missing} did not finish within {timeout:.0f} s")
        raise RankFailure("\n".join(lines))
    return [results[r] for r in range(world_size)]
