"""Muon's orthogonalisation of FSDP-sharded matrices: shared out among the ranks (each rank runs
the iterations on its bucket's matrix, train/optim.py) against every matrix gathered whole on
every rank (the all-gather way, Moonlight's), on the block matrices of a Llama-style model split
by rows over N real processes. Both are timed in the same run, alternately; the results are
checked equal to the bit. Prints JSON (rank 0): median seconds of each over the repeats, and
their ratio.

    python benchmarks/muon_step.py [--nproc 2] [--dim 1024] [--layers 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def worker(dim: int, layers: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from scaletrain.train.optim import _orthogonalise_shared_out, orthogonalise

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core a process, as the machine's cores are shared out
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    hidden = 256 * -(-8 * dim // 3 // 256)  # Llama's SwiGLU width, rounded up to 256
    shapes = [(dim, dim)] * 4 + [(hidden, dim), (hidden, dim), (dim, hidden)]
    torch.manual_seed(0)
    updates = [distribute_tensor(torch.randn(shape), mesh, [Shard(0)]) for shape in shapes * layers]

    def gathered() -> list[torch.Tensor]:
        return [distribute_tensor(orthogonalise(u.full_tensor()), mesh, [Shard(0)], src_data_rank=None).to_local()
                for u in updates]

    def shared() -> list[torch.Tensor]:
        parts = dict(_orthogonalise_shared_out(updates, lambda j: updates[j].to_local(), mesh.get_group(0)))
        return [parts[j] for j in range(len(updates))]

    times: dict[str, list[float]] = {"gathered": [], "shared_out": []}
    identical = all(torch.equal(a, b) for a, b in zip(gathered(), shared()))  # (also the warm-up)
    for _ in range(repeats):
        for name, fn in (("gathered", gathered), ("shared_out", shared)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        median = {name: statistics.median(values) for name, values in times.items()}
        print(json.dumps({
            "processes": dist.get_world_size(), "dim": dim, "layers": layers, "matrices": len(updates),
            "entries": sum(u.numel() for u in updates), "repeats": repeats,
            "gathered_s": round(median["gathered"], 4), "shared_out_s": round(median["shared_out"], 4),
            "speedup": round(median["gathered"] / median["shared_out"], 3), "identical": identical,
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        }))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: once (in CI) a rank aborted there, after its work,
    # with "terminate called without an active exception" from a C++ thread still joinable.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.dim, args.layers, args.repeats)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), __file__,
               "--worker", "--dim", str(args.dim), "--layers", str(args.layers), "--repeats", str(args.repeats)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    print(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
