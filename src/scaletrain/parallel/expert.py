"""Expert parallelism: the routed experts of each mixture-of-experts block split over the ep
ranks of a group (each rank holds moe_experts / ep of them), tokens exchanged by all-to-all
(model/moe.py). The expert weights become DTensors sharded by expert over the "ep" mesh
dimension, so checkpoints hold whole experts under their usual names and resume in any layout;
FSDP then shards each rank's experts over the "efsdp" ranks, which hold the same experts
(parallel/fsdp.py)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from scaletrain.model.moe import MoE


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's share of every MoE block's experts (every rank built the same model)."""
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    for block in model.layers.values():
        if not isinstance(block.feed_forward, MoE):
            continue
        experts = block.feed_forward.experts
        for name in ("w1", "w2", "w3"):
            local = getattr(experts, name).detach().chunk(size, dim=0)[rank].clone()
            setattr(experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
        experts.ep_group = ep_mesh.get_group()
