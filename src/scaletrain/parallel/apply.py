"""`parallelize(model, mesh)`: the one place a single-device model becomes distributed.

Order (each step wraps what the previous one built): per-block torch.compile, then FSDP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.parallel.fsdp import apply_fsdp


def parallelize(model: nn.Module, mesh: DeviceMesh | None, compile_blocks: bool = False) -> nn.Module:
    if compile_blocks:
        for block in model.layers:
            block.compile()
    if mesh is not None:
        apply_fsdp(model, mesh)
    return model
