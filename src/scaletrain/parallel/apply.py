"""`parallelize(model, mesh)`: the one place a single-device model becomes distributed.

Order (each step wraps what the previous one built): activation recomputation around each
block, per-block torch.compile, then FSDP (which shards what the blocks have become).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.parallel.fsdp import apply_fsdp
from scaletrain.parallel.recompute import apply_recompute


def parallelize(model: nn.Module, mesh: DeviceMesh | None, compile_blocks: bool = False,
                recompute: str = "none") -> nn.Module:
    apply_recompute(model, recompute)
    if compile_blocks:
        for block in model.layers:
            block.compile()
    if mesh is not None:
        apply_fsdp(model, mesh)
    return model
