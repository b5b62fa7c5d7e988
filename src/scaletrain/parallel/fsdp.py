"""Data parallelism with FSDP2 (`fully_shard`): parameters, gradients and optimizer state
sharded over dp_shard (and cp: context-parallel ranks hold the same parameters) — ZeRO-3,
Rajbhandari et al. 2020 — and replicated over dp_replicate (HSDP when both are above 1; plain
replication, as DDP, when the shard group has one rank)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True, stream_dtype: torch.dtype | None = None) -> None:
    """Shard each block on its own, so that one block's parameters are gathered at a time,
    then the root (embedding, final norm, output head).

    param_dtype below float32 gathers parameters in that dtype for compute (half the
    all-gather traffic in bf16) while the sharded master weights and the optimizer stay
    float32, and gradients are reduced in float32. Pipeline stages keep parameters gathered
    between micro-batches (reshard_after_forward=False) instead of gathering them again for
    each one. stream_dtype: the dtype each block hands the residual stream on in (None: as it
    computes it; float32 under float16 autocast, out of float16's range, as on one device)."""
    dp_mesh = _data_parallel(mesh, "dp_shard_cp")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # Blocks take their inputs as the previous block left them: cast at each block, the attention
    # bias of attention within documents (one tensor for all blocks, in the compute dtype) would
    # become a copy per block, each kept for the backward pass. The root casts the model's inputs.
    # Under float16 each block hands the residual stream on in float32 (stream_dtype), out of
    # float16's range, as on one device (gathering float32 parameters instead would leave
    # autocast's float16 copy of every block's weights on every rank for the backward pass).
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                        output_dtype=stream_dtype, cast_forward_inputs=False)
    within_block = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False)  # (a block's experts: outputs as computed)
    for block in model.layers.values():
        experts = getattr(block.feed_forward, "experts", None)
        if experts is not None and experts.ep_group is not None:
            # Split by expert over ep (and tp), each rank's experts sharded over the ranks that
            # hold the same ones, cp ranks included (model/moe.py scales their gradients by 1 / ep:
            # see _expert_parallel) — all the data-parallel ones when only tp splits them.
            fully_shard(experts, mesh=_data_parallel(mesh, "efsdp_cp") if experts.ep > 1 else dp_mesh,
                        mp_policy=within_block, reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=dp_mesh, mp_policy=block_policy, reshard_after_forward=reshard_after_forward)
    for depth in getattr(model, "mtp", None) or []:  # multi-token prediction's modules, each as a block
        fully_shard(depth, mesh=dp_mesh, mp_policy=block_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def _data_parallel(mesh: DeviceMesh, shard: str) -> DeviceMesh:
    """The mesh FSDP shards over: (dp_replicate, shard) for HSDP, `shard` alone without replicas.
    (A dimension of one rank is not free: DTensor's sharding propagation, run for each new
    operation a parameter meets, grows exponentially with the mesh's dimensions.)"""
    return mesh["dp_replicate", shard] if mesh["dp_replicate"].size() > 1 else mesh[shard]
