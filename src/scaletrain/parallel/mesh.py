"""The process layout: a DeviceMesh over pp x dp_replicate x dp_shard x cp x tp, checked before any group starts."""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletrain.parallel.layout import DIMS, Layout

# With expert parallelism: dp_shard as efsdp x ep, ep inner (neighbouring ranks: one node). Each
# expert is then sharded by FSDP over efsdp (the ranks holding the same experts).
EP_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")

# A rank that raises mid-collective leaves the others waiting for gloo's timeout (30 minutes
# by default): fail within minutes instead. With the hang watchdog on (train/resilience.py),
# collectives wait a minute longer than it, so that a hung rank's watchdog (and those of the
# ranks waiting for it) ends the job with the stacks, not a collective timeout without them.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def collective_timeout(hang_timeout_s: float) -> datetime.timedelta:
    if hang_timeout_s <= 0:
        return COLLECTIVE_TIMEOUT
    return max(COLLECTIVE_TIMEOUT, datetime.timedelta(seconds=hang_timeout_s + 60))


def world() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment; (0, 0, 1) without it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device: torch.device, layout: Layout,
                     timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> DeviceMesh | None:
    """Start the process group (NCCL on GPUs, gloo on CPUs; collectives fail after `timeout`)
    and the mesh; None in one process."""
    _, _, world_size = world()
    if world_size == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    if layout.ep == 1:
        mesh = init_device_mesh(device.type, layout.sizes, mesh_dim_names=DIMS)
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    else:  # dp_shard split into (efsdp, ep): groups of ep neighbouring ranks share out the experts
        sizes = (layout.pp, layout.dp_replicate, layout.dp_shard // layout.ep, layout.ep, layout.cp, layout.tp)
        mesh = init_device_mesh(device.type, sizes, mesh_dim_names=EP_DIMS)
        mesh["efsdp", "ep"]._flatten("dp_shard")
        mesh["efsdp", "ep", "cp"]._flatten("dp_shard_cp")
        mesh["efsdp", "cp"]._flatten("efsdp_cp")  # the ranks holding the same experts
        if layout.tp > 1:  # the experts split over ep x tp (parallel/expert.py)
            mesh["ep", "tp"]._flatten("ep_tp")
    # FSDP shards over the data-parallel and context-parallel ranks alike: cp ranks hold the same
    # parameters and each contributes the gradient of its part of the sequence. (Slicing
    # ("dp_replicate", "dp_shard_cp") from the root then warns of a future deprecation; torch
    # 2.11-2.13 have no other way to build that 2-D view for HSDP, so the warning is silenced.)
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank calls it, and all get the same answer); `flag`
    itself in one process."""
    if not dist.is_initialized():
        return flag
    found = torch.tensor([float(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


def shutdown(clean: bool = True) -> None:
    """Leave the process group. After an error, without the barrier: the other ranks may never
    reach it, and waiting there would hide this rank's error until the collective timeout."""
    if dist.is_initialized():
        if clean:
            dist.barrier()  # without it, destroying the group occasionally aborts a rank still in a collective
        dist.destroy_process_group()
