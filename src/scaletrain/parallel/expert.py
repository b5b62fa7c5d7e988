"""Expert parallelism: the routed experts of each mixture-of-experts block split over the ep
ranks of a group and, under tensor parallelism, over each one's tp ranks too (each of the ep x tp
ranks holds moe_experts / (ep x tp) of them), tokens exchanged by all-to-all (model/moe.py).
The tp ranks hold other parts of the same sequences, so they route different tokens, as data
parallelism's ranks do; whole experts on each of them would be tp copies of most of a
mixture's weights. The expert weights become DTensors sharded by expert over the "ep" mesh
dimension (ep and tp flattened, "ep_tp", with both), so checkpoints hold whole experts under
their usual names and resume in any layout; FSDP then shards each rank's experts over the
ranks that hold the same experts (parallel/fsdp.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from scaletrain.model.moe import MoE


def expert_mesh(mesh: DeviceMesh, ep: int, tp: int) -> DeviceMesh | None:
    """The mesh dimension the experts split over: ep, tp, both flattened, or None (neither)."""
    if ep > 1 and tp > 1:
        return mesh["ep_tp"]
    if ep > 1 or tp > 1:
        return mesh["ep" if ep > 1 else "tp"]
    return None


def apply_ep(model: nn.Module, split: DeviceMesh, ep: int) -> None:
    """Keep this rank's share of every MoE block's experts (every rank built the same model),
    split over the mesh `split` of which `ep` ranks train on different data."""
    rank, size = split.get_local_rank(), split.size()
    for block in model.layers.values():
        if not isinstance(block.feed_forward, MoE):
            continue
        experts = block.feed_forward.experts
        for name in ("w1", "w2", "w3"):
            local = getattr(experts, name).detach().chunk(size, dim=0)[rank].clone()
            setattr(experts, name, nn.Parameter(DTensor.from_local(local, split, [Shard(0)], run_check=False)))
        experts.ep_group, experts.ep = split.get_group(), ep
