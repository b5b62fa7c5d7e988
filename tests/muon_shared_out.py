"""`torchrun --nproc-per-node 3 tests/muon_shared_out.py`: Muon's orthogonalisation of matrices
split by rows over the ranks (shared out among them, train/optim.py) gives each rank exactly the
rows an all-gather of each whole matrix would give it — with more matrices than ranks (a last
bucket not full), rows not divisible by the ranks, and a rank holding none of a matrix's rows.
Exits 0 when every rank agrees to the bit."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from scaletrain.train.optim import _orthogonalise_shared_out, orthogonalise


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # every rank draws the same matrices
    shapes = [(7, 5), (2, 9), (16, 16), (5, 12), (3, 3)]
    wholes = [torch.randn(shape) for shape in shapes]
    updates = [distribute_tensor(w, mesh, [Shard(0)]) for w in wholes]
    shared = dict(_orthogonalise_shared_out(updates, lambda j: updates[j].to_local(), mesh.get_group(0)))
    assert sorted(shared) == list(range(len(shapes)))
    for whole, update, mine in zip(wholes, updates, [shared[j] for j in range(len(shapes))]):
        expected = distribute_tensor(orthogonalise(whole), mesh, [Shard(0)], src_data_rank=None).to_local()
        assert mine.shape == update.to_local().shape == expected.shape, (mine.shape, expected.shape)
        assert torch.equal(mine, expected), (whole.shape, (mine - expected).abs().max())
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # without the interpreter's teardown (see benchmarks/muon_step.py)


if __name__ == "__main__":
    main()
