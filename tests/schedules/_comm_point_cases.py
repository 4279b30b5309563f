"""Per-rank body of the communication-point test (module level: spawned ranks import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zbpipe.engines.segmented import Exchange
from zbpipe.schedules.comm_points import find_points, install, restore


def titan_dispatcher_round_trip(rank, world):
    """torchtitan's dispatcher, found in a module tree, exchanges through zbpipe's point and
    gets what its own method gets; restored afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=4, top_k=1))
    dispatcher.ep_mesh = init_device_mesh("cpu", (world,))  # what wire_meshes would set
    holder = nn.Module()
    holder.token_dispatcher = dispatcher  # where torchtitan's RoutedExperts keeps it
    points = find_points([nn.Sequential(holder)])
    group = dist.group.WORLD
    splits = [4] * world
    x = torch.randn(4 * world, 3, requires_grad=True)
    own = dispatcher._dispatch_token_exchange(x, group, splits, splits) * 1  # waited
    seen = []

    def exchange(t, collective):
        seen.append(type(collective).__name__)
        return Exchange.apply(t, collective, None)

    patches = install(points, exchange)
    ours = dispatcher._dispatch_token_exchange(x, group, splits, splits)
    back = dispatcher._combine_token_exchange(ours, group, splits, splits)
    back.sum().backward()
    restore(patches)
    assert "_dispatch_token_exchange" not in vars(dispatcher)
    return (
        [p.method for p in points],
        seen,
        torch.equal(own, ours),
        torch.equal(back.detach(), x.detach()),
        torch.equal(x.grad, torch.ones_like(x)),
    )
