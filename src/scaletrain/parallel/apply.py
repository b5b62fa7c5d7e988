"""`parallelize(model, mesh)`: the one place a single-device model becomes distributed.

Order (each step wraps what the previous one built): tensor parallelism (turns weights into
DTensors on the tp mesh), activation recomputation around each block, per-block
torch.compile, then FSDP over the data-parallel dimensions (which shards what the blocks
have become).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.parallel.fsdp import apply_fsdp
from scaletrain.parallel.recompute import apply_recompute
from scaletrain.parallel.tensor import apply_tp


def parallelize(model: nn.Module, mesh: DeviceMesh | None, compile_blocks: bool = False,
                recompute: str = "none") -> nn.Module:
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    apply_recompute(model, recompute)
    if compile_blocks:
        for block in model.layers:
            block.compile()
    if mesh is not None:
        apply_fsdp(model, mesh)
    return model
