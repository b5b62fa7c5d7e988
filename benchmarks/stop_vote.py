"""What the per-step stop vote of train/resilience.py costs a data-parallel job: the same loop of a
matmul and an all-reduce (a stand-in for a step's compute and gradient reduction) with and
without `StopSignals.stop_before_next_step()`, alternated in rounds. Prints JSON from rank 0.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/stop_vote.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from scaletrain.train.resilience import StopSignals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each variant, alternated")
    parser.add_argument("--width", type=int, default=256, help="the matmul's size")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    signals = StopSignals(dist.new_group(backend="gloo"))
    signals.install()
    x = torch.randn(args.width, args.width)
    gradient = torch.zeros(args.width)
    times: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(args.rounds):
        for variant in times:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                gradient += (x @ x)[0]
                dist.all_reduce(gradient)
                if variant == "with":
                    signals.stop_before_next_step()
            times[variant].append((time.perf_counter() - t0) / args.steps)
    signals.uninstall(finished=True)
    if dist.get_rank() == 0:
        median = {variant: statistics.median(t) for variant, t in times.items()}
        print(json.dumps({"world_size": dist.get_world_size(), "steps": args.steps, "rounds": args.rounds,
                          "step_us_without_vote": round(median["without"] * 1e6, 1),
                          "step_us_with_vote": round(median["with"] * 1e6, 1),
                          "vote_us": round((median["with"] - median["without"]) * 1e6, 1),
                          "torch": torch.__version__}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
