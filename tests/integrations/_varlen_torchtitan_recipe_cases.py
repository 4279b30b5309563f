"""Per-rank body of tests/integrations/test_varlen_torchtitan_recipe.py: the recipe's own loop
(recipes/varlen_torchtitan_blocks.py, ``train``) against a reference built here.

The reference is torchtitan's llama3 debug model cut to the same layers, built from the same
seed by torchtitan's config and init, with torchtitan's own *causal* ``ScaledDotProductAttention``
(no mask at all) run on each document of the packed row as a sequence of its own (positions from
0), the summed cross-entropy of every token divided by the row's token count, and AdamW at the
recipe's learning rate between the steps. It shares none of the recipe's document mask, positions,
stage split, microbatch split or schedule: a token that attended across documents (0.72 of the
largest gradient, tried) or a microbatch's loss scaled wrongly (``scale_grads=True``: 0.75) shows.
Positions not restarted at each document do not: RoPE's scores depend only on the distance
between two tokens, which within one document is the same either way (tried: no difference).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "varlen_torchtitan_blocks.py"


def load_recipe() -> Any:
    """The recipe as a module (recipes/ is not a package)."""
    name = "varlen_torchtitan_blocks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, RECIPE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def reference_model(n_layers: int, seed: int) -> torch.nn.Module:
    """torchtitan's llama3 debug model, first ``n_layers`` layers, torchtitan's causal SDPA."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        model.init_states(buffer_device=None)
    return model


def reference_steps(recipe: Any, args: Any) -> tuple[dict, list[dict], list[float]]:
    """The initial weights, each step's gradients (both by parameter name) and each step's
    loss, one document at a time."""
    model = reference_model(args.layers, args.seed)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    grads, losses = [], []
    for step in range(args.steps):
        tokens, labels, cu = recipe.packed_row(
            step, args.row_tokens, args.median_doc, args.microbatches, args.seed
        )
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            logits = model(tokens[:, a:b])  # positions None: 0..n-1; causal, one document
            total = total + F.cross_entropy(
                logits.flatten(0, 1).float(), labels[:, a:b].flatten(), reduction="sum"
            )
        loss = total / labels.numel()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(float(loss.detach()))
        opt.step()
    return init, grads, losses


class GradChecker:
    """``train``'s ``on_grads``: compares this rank's parameters with the reference's, by name."""

    def __init__(self, init: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]):
        self.init, self.grads = init, grads
        self.worst, self.names = [0.0] * len(grads), set[str]()

    def __call__(self, step: int, params: dict[str, torch.nn.Parameter]) -> None:
        for name, p in params.items():
            if step == 0:  # the same initial weights: the comparison is of the same model
                torch.testing.assert_close(p.detach(), self.init[name], rtol=0, atol=0)
            ref = self.grads[step][name]
            scale = max(float(ref.abs().max()), 1e-12)
            assert p.grad is not None, name
            diff = float((p.grad - ref).abs().max()) / scale
            self.worst[step] = max(self.worst[step], diff)
            self.names.add(name)


def recipe_against_reference(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Each argv in ``runs`` through the recipe's ``train``; per run, this rank's largest
    gradient difference (relative to the reference gradient's largest entry, per parameter and
    step), the parameter names it checked, and the recipe's and the reference's losses."""
    recipe = load_recipe()
    results, references = [], {}
    for argv in runs:
        args = recipe.parse_args(argv)
        # the schedule does not change the reference: runs that differ only there share one
        key = tuple(v for k, v in sorted(vars(args).items()) if k != "schedule")
        if key not in references:
            references[key] = reference_steps(recipe, args)
        init, expected, ref_losses = references[key]
        check = GradChecker(init, expected)
        records = recipe.train(rank, world, args, on_grads=check)
        results.append(
            {
                "rank": rank,
                "worst": check.worst,
                "names": sorted(check.names),
                "all_names": sorted(expected[0]),
                "losses": [r["loss"] for r in records],
                "ref_losses": ref_losses,
            }
        )
    return results
