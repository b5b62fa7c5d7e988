"""Data parallelism with FSDP2 (`fully_shard`): parameters, gradients and optimizer state
sharded over dp_shard (ZeRO-3, Rajbhandari et al. 2020), replicated over dp_replicate (HSDP
when both are above 1; plain replication, as DDP, when dp_shard is 1)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard each block on its own, so that one block's parameters are gathered at a time,
    then the root (embedding, final norm, output head)."""
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
