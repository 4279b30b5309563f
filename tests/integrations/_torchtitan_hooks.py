"""What the Trainer tests' ranks log beside torchtitan's own lines (the run server's hooks:
``"hooks": "tests.integrations._torchtitan_hooks"`` in a request to
:mod:`zbpipe.testing.torchtitan_runs`).

On MoE models each rank logs the load-balancing state of the MoE layers it holds
(:func:`_log_moe_state`): before every optimizer step, each layer's tokens per expert (what
torchtitan's step pre-hook turns into the expert-bias update), and after training each layer's
expert bias, as ``zbpipe-test-moe:`` lines. Nothing is logged for a model without MoE layers.
And every rank logs what zbpipe's W computed (:func:`_count_w_gemms`, ``zbpipe-test-w:``).
"""

from collections.abc import Callable

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


def install() -> Callable[[], None]:
    """Patch this rank for the next run; the returned callable logs W's counts after it."""
    _log_moe_state()
    w = _count_w_gemms()

    def after() -> None:
        print(f"{W_MARKER}gemms={w['gemms']} weights={len(w['weights'])}", flush=True)

    return after
