"""``split="auto"`` under selective activation checkpointing (issue 46 item 4).

The graph engine's W replays B's recompute (torch 2.13 and later), so a selectively
checkpointed stage no longer forces the deferred engine: ``auto`` decides by the weight work
each engine defers, as without checkpointing. The reference is the same stage unwrapped: the
wrapper must not change the choice. On a torch whose recompute cannot be replayed (2.11) the
graph engine still refuses the wrapper and ``auto`` takes the deferred engine.
"""

from __future__ import annotations

import functools
import logging
import types

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from zbpipe import _compat as C
from zbpipe.engines import choose_engine
from zbpipe.engines.weight_share import engine_shares


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _stage(selective: bool) -> types.SimpleNamespace:
    """Mostly convolution weight (which only the graph engine defers), and a small Linear."""
    block = nn.Sequential(nn.Conv1d(8, 8, 5, padding=2), nn.Flatten(), nn.Linear(8 * 4, 4))
    if selective:
        context = functools.partial(create_selective_checkpoint_contexts, _recompute_all)
        block = checkpoint_wrapper(block, context_fn=context)
    return types.SimpleNamespace(stage_index=0, submod=nn.Sequential(block))


def test_selective_wrapper_does_not_change_the_auto_choice_where_w_replays(caplog):
    plain, wrapped = _stage(False), _stage(True)
    assert C.selective_checkpoint_submodule(wrapped.submod) is not None
    reference = choose_engine("auto", [plain], "Test").name
    assert reference == "graph"  # the convolution's weight work outweighs the Linear's
    shares = engine_shares([wrapped])
    replayable = C.checkpoint_recompute_replayable()
    assert shares["graph"].refused is not replayable
    with caplog.at_level(logging.INFO, logger="zbpipe.engines"):
        got = choose_engine("auto", [wrapped], "Test").name
    assert got == (reference if replayable else "deferred")
    if replayable:
        assert "refuses" not in caplog.text
