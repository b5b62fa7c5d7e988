"""The process layout: a DeviceMesh over data-parallel dimensions, checked before any group starts."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletrain.config import ConfigError, ParallelConfig

# A rank that raises mid-collective leaves the others waiting for gloo's timeout (30 minutes
# by default): fail within minutes instead.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass
class Layout:
    """Sizes of each mesh dimension, resolved against the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp


def resolve_layout(cfg: ParallelConfig, world_size: int) -> Layout:
    """The layout cfg asks for on world_size processes, or a ConfigError saying which constraint fails."""
    fixed = cfg.dp_replicate * cfg.tp
    if cfg.dp_shard == -1:
        if world_size % fixed:
            raise ConfigError(f"parallel.dp_replicate = {cfg.dp_replicate} x parallel.tp = {cfg.tp} does not divide "
                              f"the {world_size} processes; the product of the parallel dimensions must equal the "
                              "number of processes")
        return Layout(cfg.dp_replicate, world_size // fixed, cfg.tp)
    layout = Layout(cfg.dp_replicate, cfg.dp_shard, cfg.tp)
    if layout.world_size != world_size:
        raise ConfigError(f"parallel.dp_replicate x parallel.dp_shard x parallel.tp = {cfg.dp_replicate} x "
                          f"{cfg.dp_shard} x {cfg.tp} = {layout.world_size}, but {world_size} processes were started; "
                          "their product must equal the number of processes (or set parallel.dp_shard = -1 to use "
                          "all remaining ones)")
    return layout


def check_model_fits(layout: Layout, model, seq_len: int) -> None:
    """Tensor parallelism splits heads, MLP columns, the vocabulary and the sequence evenly."""
    if layout.tp == 1:
        return
    sizes = {"model.n_heads": model.n_heads, "model.n_kv_heads": model.kv_heads, "the MLP width (model.ffn_dim)":
             model.hidden_dim, "model.vocab_size": model.vocab, "data.seq_len": seq_len}
    for name, size in sizes.items():
        if size % layout.tp:
            raise ConfigError(f"{name} = {size} is not divisible by parallel.tp = {layout.tp}; tensor parallelism "
                              "splits it evenly over the tp ranks")
    for flag, why in (("tie_embeddings", "the embedding and output head are split differently"),
                      ("qk_norm", "its weights are shared by heads on different ranks")):
        if getattr(model, flag):
            raise ConfigError(f"model.{flag} = true is not supported with parallel.tp > 1 yet ({why}); "
                              f"set model.{flag} = false or parallel.tp = 1")


def world() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment; (0, 0, 1) without it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device: torch.device, layout: Layout) -> DeviceMesh | None:
    """Start the process group (NCCL on GPUs, gloo on CPUs) and the mesh; None in one process."""
    _, _, world_size = world()
    if world_size == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return init_device_mesh(device.type, (layout.dp_replicate, layout.dp_shard, layout.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()  # without it, destroying the group occasionally aborts a rank still in a collective
        dist.destroy_process_group()
