"""Task scoring under tensor parallelism: each scored position's log-probability from logits
split over the vocabulary, gathered whole first (what eval.tasks did before) against computed
from each rank's columns (model/loss.py's target_log_probs: three numbers a position cross the
ranks). Two gloo processes on this machine's CPU, each variant in fresh processes so that one's
peak memory does not hide the other's: time per micro-batch and each rank's peak resident
memory above its inputs. Prints JSON.

    python benchmarks/task_scoring.py [--rows 8] [--seq-len 1024] [--vocab 32768] [--tp 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def rank_main(rank: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from scaletrain.model.loss import target_log_probs

    dist.init_process_group("gloo", rank=rank, world_size=args.tp)
    mesh = init_device_mesh("cpu", (args.tp,))
    # Each rank's columns of the logits from a seed of its own; the targets the same on every rank.
    width = args.vocab // args.tp
    local = torch.randn(args.rows, args.seq_len, width, generator=torch.Generator().manual_seed(1 + rank))
    logits = DTensor.from_local(local, mesh, [Shard(2)])
    targets = torch.randint(args.vocab, (args.rows, args.seq_len), generator=torch.Generator().manual_seed(0))
    targets[:, : args.seq_len // 2] = -100  # the context's positions: only the choice's are scored
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if args.variant == "gathered":
            full = logits.full_tensor()
            scored = targets != -100
            picked = torch.log_softmax(full[scored].float(), dim=-1).gather(-1, targets[scored][:, None])[:, 0]
            del full
        else:
            picked = target_log_probs(logits, targets)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_s": round(statistics.median(times), 4),
                       "peak_rss_mb_above_inputs": round((peak - base) / 1024, 1),
                       "sum": picked.double().sum().item()}, f)
    dist.destroy_process_group()


def variant(args: argparse.Namespace, name: str) -> dict:
    """One variant in fresh processes (one per rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--rank", "{rank}", "--variant", name, "--out", out,
               *(f"--{key.replace('_', '-')}={value}" for key, value in
                 (("rows", args.rows), ("seq_len", args.seq_len), ("vocab", args.vocab), ("tp", args.tp),
                  ("repeats", args.repeats)))]
    procs = [subprocess.Popen([part.format(rank=rank) for part in command], env=env) for rank in range(args.tp)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"the {name} variant failed")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=None)  # (a worker of one variant)
    parser.add_argument("--variant", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args, args.out)
        return
    gathered, split = variant(args, "gathered"), variant(args, "split")
    print(json.dumps({
        "rows": args.rows, "seq_len": args.seq_len, "vocab": args.vocab, "tp": args.tp,
        "gathered": gathered, "split": split,
        "difference": abs(gathered["sum"] - split["sum"]) / abs(gathered["sum"]),
        "time_ratio_split_over_gathered": round(split["median_s"] / gathered["median_s"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
