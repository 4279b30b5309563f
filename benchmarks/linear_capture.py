"""How the deferred Linear captures its weight GEMM, measured: the alternatives, a C++ prototype.

``linear`` (default): one stage of Llama-style blocks (benchmarks/llama_blocks.py, hidden 64,
seq 32, 4 blocks: 20 Linears a microbatch, Python most of the time), m microbatches each run F,
B (the store deferring, or adding each GEMM at once with ``--immediate``, as a fused BW through
the store does) and W, every Linear captured one way:

* ``plain``: ``nn.Linear`` and one fused backward (the reference: no split at all);
* ``function``: zbpipe's Python ``autograd.Function`` (engines/weight_capture.py, the general
  path);
* ``hook``: zbpipe's output hook (``deferred_linear``'s fast path: ``F.linear`` on a detached
  weight, a tensor pre-hook registered without a handle);
* ``register_hook`` / ``register_prehook``: the same with torch's public registrations
  (``Tensor.register_hook``, ``grad_fn.register_prehook``);
* ``custom_op``: a ``torch.library.custom_op`` with a registered autograd formula (what the
  compiled path's op does, in eager);
* ``compiled_linear``: the compiled path's Function and weight op (engines/compiled_linear.py)
  run in eager;
* ``cpp``: a C++ autograd Function (benchmarks/csrc/deferred_linear.cpp, built with
  ``torch.utils.cpp_extension.load``; a prototype zbpipe does not ship).

Thread CPU time per step, repetitions interleaved; every variant's gradients compared bitwise
with the Function's.

``steps``: the schedules of benchmarks/host_overhead.py (one rank) with the output hook and with
the C++ prototype in place of it, against torch's ``Schedule1F1B``.

    PYTHONPATH=src python benchmarks/linear_capture.py --reps 30 --out linear_capture
    PYTHONPATH=src python benchmarks/linear_capture.py steps --reps 20 --out linear_capture_steps
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def load_cpp() -> Any:
    """The C++ prototype (compiled once into torch's extension cache), or None."""
    try:
        from torch.utils.cpp_extension import load

        src = os.path.join(HERE, "csrc", "deferred_linear.cpp")
        return load(name="zbpipe_deferred_linear_proto", sources=[src], extra_cflags=["-O2"])
    except Exception as e:  # no compiler, no ninja: the row is left out
        print(f"C++ prototype unavailable: {e}")
        return None


def _variants(cpp: Any) -> dict[str, Any]:
    """name -> forward(lin, x, store) for a Linear whose store is in its slot."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from zbpipe.engines import weight_capture as wc
    from zbpipe.engines.compiled_linear import compiled_linear

    def queue(store: Any, cell: list[Any], g: torch.Tensor) -> None:
        weight, x = cell
        cell.clear()
        g2d = g if g.dim() == 2 else g.reshape(-1, g.shape[-1])
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        store.put(weight, x2d, g2d, None)

    def tensor_hook(lin: nn.Module, x: torch.Tensor, store: Any) -> torch.Tensor:
        out = F.linear(x, lin.weight.detach(), lin.bias)
        out.register_hook(functools.partial(queue, store, [lin.weight, x]))
        return out

    def node_prehook(lin: nn.Module, x: torch.Tensor, store: Any) -> torch.Tensor:
        out = F.linear(x, lin.weight.detach(), lin.bias)
        cell = [lin.weight, x]
        out.grad_fn.register_prehook(lambda grads: queue(store, cell, grads[0]))
        return out

    schema = "(Tensor x, Tensor w) -> Tensor"

    @torch.library.custom_op("zbpipe_bench::linear", mutates_args=(), schema=schema)
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    @op.register_fake
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], w.shape[0])

    def setup(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        queue(_STORE[0], [w, x], g)
        return g.matmul(w), None

    op.register_autograd(backward, setup_context=setup)

    def custom_op(lin: nn.Module, x: torch.Tensor, store: Any) -> torch.Tensor:
        _STORE[0] = store
        return op(x, lin.weight)

    out = {
        "function": lambda lin, x, s: wc._apply_linear(x, lin.weight, lin.bias, s),
        "hook": lambda lin, x, s: wc.deferred_linear(x, lin.weight, lin.bias, s),
        "register_hook": tensor_hook,
        "register_prehook": node_prehook,
        "custom_op": custom_op,
        "compiled_linear": lambda lin, x, s: compiled_linear(x, lin.weight, lin.bias),
    }
    if cpp is not None:
        out["cpp"] = lambda lin, x, s: cpp.deferred_linear(x, lin.weight, lin.bias, id(s))
    return out


_STORE: list[Any] = [None]


class Rig:
    """One copy of the blocks whose Linears run ``variant``; :meth:`step` runs F, B, W."""

    def __init__(self, variant: str, forward: Any, args: argparse.Namespace, cpp: Any) -> None:
        import torch
        from llama_blocks import build_chunks
        from torch import nn

        from zbpipe.engines.compiled_routes import route_parameter
        from zbpipe.engines.linear_patch import StoreSlot, patch_linears

        self.variant, self.cpp, self.args = variant, cpp, args
        cpu = torch.device("cpu")
        self.mod = build_chunks(
            args.hidden, args.blocks, 1, seed=0, dtype=torch.float32, device=cpu
        )[0]
        self.slot = StoreSlot()
        self.linears = [m for m in self.mod.modules() if isinstance(m, nn.Linear)]
        if variant == "compiled_linear":  # its op finds the store through the weight's route
            patch_linears(self.mod, self.slot)
            self._nodes = [route_parameter(lin, lin.weight) for lin in self.linears]
        for lin in self.linears:
            if variant != "plain":
                lin.forward = functools.partial(self._forward, lin, forward)
        torch.manual_seed(1)
        self.x = torch.randn(args.microbatches, args.seq, args.hidden)
        self.y = torch.randn_like(self.x)

    def _forward(self, lin: Any, forward: Any, x: Any) -> Any:
        import torch.nn.functional as F

        store = self.slot.store
        if store is None:
            return F.linear(x, lin.weight, lin.bias)
        return forward(lin, x, store)

    def step(self) -> tuple[int, list[Any]]:
        import time as _t

        from llama_blocks import mse_loss

        from zbpipe.engines.deferred import WeightGradStore
        from zbpipe.engines.weight_capture import CaptureState

        for p in self.mod.parameters():
            p.grad = None
        inputs, ns = [], 0
        for i in range(self.args.microbatches):
            x = self.x[i : i + 1].clone().requires_grad_()
            y = self.y[i : i + 1]
            t = _t.thread_time_ns()
            if self.variant == "plain":
                mse_loss(self.mod(x), y).backward()
            else:
                store = WeightGradStore()
                store.immediate, store.capture = self.args.immediate, CaptureState(fast=True)
                self.slot.store = store
                loss = mse_loss(self.mod(x), y)
                store.deferring = True
                if self.cpp is not None:
                    self.cpp.set_flags(id(store), True, self.args.immediate)
                loss.backward()
                store.deferring = False
                self.slot.store = None
                if self.cpp is not None:
                    self.cpp.set_flags(id(store), False, False)
                    for w, x2d, g2d in self.cpp.take(id(store)):
                        store.put(w, x2d, g2d, None)
                store.run()
            ns += _t.thread_time_ns() - t
            inputs.append(x.grad)
        return ns, [p.grad.clone() for p in self.mod.parameters()] + inputs


def linear_table(args: argparse.Namespace) -> dict[str, Any]:
    cpp = load_cpp()
    forwards = _variants(cpp)
    names = ["plain", *forwards]
    rigs = {n: Rig(n, forwards.get(n), args, cpp if n == "cpp" else None) for n in names}
    for r in rigs.values():
        r.step()
        r.step()
    times: dict[str, list[int]] = {n: [] for n in names}
    grads: dict[str, list[Any]] = {}
    for rep in range(args.reps):
        k = rep % len(names)
        for n in names[k:] + names[:k]:
            ns, grads[n] = rigs[n].step()
            times[n].append(ns)
    import torch

    calls = args.microbatches * len(rigs["plain"].linears)
    base = statistics.median(times["plain"])
    table = {}
    for n in names:
        med = statistics.median(times[n])
        r = [a / b for a, b in zip(times[n], times["plain"], strict=True)]
        table[n] = {
            "step_ms": med / 1e6,
            "vs_plain": {"median": statistics.median(r), "min": min(r), "max": max(r)},
            "extra_us_per_linear_call": (med - base) / calls / 1e3,
            "bitwise_equal_to_function": all(
                torch.equal(a, b) for a, b in zip(grads[n], grads["function"], strict=True)
            ),
        }
        t = table[n]
        print(
            f"{n:16} {t['step_ms']:7.2f} ms  vs plain {t['vs_plain']['median']:.3f} "
            f"({t['vs_plain']['min']:.3f}-{t['vs_plain']['max']:.3f})  "
            f"+{t['extra_us_per_linear_call']:5.2f} us per Linear call  "
            f"bitwise={t['bitwise_equal_to_function']}"
        )
    return {"rows": table, "step_ns": times}


def steps_table(args: argparse.Namespace) -> dict[str, Any]:
    """The schedules with the output hook and with the C++ prototype (patched in per step)."""
    import host_overhead as H
    import torch
    from torch import nn

    from zbpipe.engines import deferred as D
    from zbpipe.engines import linear_patch as lp

    cpp = load_cpp()
    if cpp is None:
        raise SystemExit("steps needs the C++ prototype")
    H._setup()
    use = {"cpp": False}
    hook = lp.deferred_linear

    def deferred_linear(x: Any, weight: Any, bias: Any, store: Any) -> Any:
        if (
            use["cpp"]
            and store.capture.fast
            and type(weight) is nn.Parameter
            and type(x) is torch.Tensor
        ):
            return cpp.deferred_linear(x, weight, bias, id(store))
        return hook(x, weight, bias, store)

    lp.deferred_linear = deferred_linear
    backward_input, run = D.DeferredEngine.backward_input, D.WeightGradStore.run

    def b(self: Any, key: Any, *a: Any, **k: Any) -> Any:
        store = self._stores[key]
        cpp.set_flags(id(store), True, store.immediate and not store.exact)
        try:
            return backward_input(self, key, *a, **k)
        finally:
            cpp.set_flags(id(store), False, False)

    def w(self: Any) -> None:
        for weight, x2d, g2d in cpp.take(id(self)):
            self._entries.append((weight, x2d, g2d, None, None))
        run(self)

    D.DeferredEngine.backward_input, D.WeightGradStore.run = b, w  # type: ignore[method-assign]
    rows = [("torch:1F1B", False)]
    rows += [(r, c) for r in ("1F1BMulti", "ZBH1", "ZBV") for c in (False, True)]
    rows.insert(3, ("1F1BMulti exact", False))
    names = [f"{r} cpp" if c else r for r, c in rows]
    x, y = H._batch(args)
    runs = {}
    for (row, c), n in zip(rows, names, strict=True):
        runs[n] = H.build(row, args, None)
        use["cpp"] = c
        for _ in range(3):
            H._step(*runs[n], x, y)
    times: dict[str, list[int]] = {n: [] for n in names}
    pairs = list(zip(rows, names, strict=True))
    for rep in range(args.reps):
        k = rep % len(pairs)
        for (_, c), n in pairs[k:] + pairs[:k]:
            use["cpp"] = c
            times[n].append(H._step(*runs[n], x, y))
    table = {}
    for n in names:
        r = [a / b for a, b in zip(times[n], times["torch:1F1B"], strict=True)]
        table[n] = {
            "step_ms": statistics.median(times[n]) / 1e6,
            "vs_torch_1f1b": {"median": statistics.median(r), "min": min(r), "max": max(r)},
        }
        q = table[n]["vs_torch_1f1b"]
        print(
            f"{n:18} {table[n]['step_ms']:7.2f} ms  vs torch {q['median']:.3f} "
            f"({q['min']:.3f}-{q['max']:.3f})"
        )
    for row in ("1F1BMulti", "ZBH1", "ZBV"):
        a = [p.grad for m in runs[row][1] for p in m.parameters()]
        c = [p.grad for m in runs[row + " cpp"][1] for p in m.parameters()]
        same = all(torch.equal(u, v) for u, v in zip(a, c, strict=True))
        table[row + " cpp"]["bitwise_equal_to_hook"] = same
        print(f"{row}: C++ gradients bitwise equal to the hook's: {same}")
    return {"rows": table, "step_ns": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="linear", choices=("linear", "steps"))
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--immediate", action="store_true", help="linear: each GEMM added in B")
    ap.add_argument("--out", default=None, help="results file name (benchmarks/results/)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    res = linear_table(args) if args.mode == "linear" else steps_table(args)
    if args.out:
        from results_io import write_result

        config = {k: getattr(args, k) for k in ("hidden", "seq", "blocks", "microbatches", "reps")}
        config["mode"], config["immediate"] = args.mode, args.immediate
        print("wrote", write_result(args.out, {"config": config, **res}))


if __name__ == "__main__":
    main()
