"""What multi-token prediction (model.mtp_depth) does to the next-token loss and to the speed: the
same run (config, data, seed, steps) at each depth, one after the other in this process. Prints
JSON: each depth's validation losses at the run's evaluations (of the trunk: the next-token
loss), its last train and mtp loss, median tokens/s and FLOPs per token, and the final
validation loss and speed against depth 0's.

    python benchmarks/mtp.py configs/tiny.toml data.path=DIR [train.steps=N ...] [--depths 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train


def run(config: str, overrides: list[str], depth: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(config, [*overrides, f"model.mtp_depth={depth}", f"run.dir={root}", "run.name=run",
                                   "checkpoint.interval=0"])
        train(cfg)
        records = read_metrics(Path(root) / "run")
    steps = [r for r in records if r["kind"] == "train"]
    return {"val_loss": {r["step"]: r["loss"] for r in records if r["kind"] == "eval"},
            "train_loss": steps[-1]["loss"], "mtp_loss": steps[-1].get("mtp_loss"),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:] or steps),
            "flops_per_token": next(r for r in records if r["kind"] == "start")["flops_per_token"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--depths", default="0,1,2")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    depths = [int(d) for d in args.depths.split(",")]
    runs = {depth: run(args.config, args.overrides, depth) for depth in depths}
    base = runs[depths[0]]
    final = max(base["val_loss"])
    for entry in runs.values():
        entry["final_val_loss_minus_first"] = entry["val_loss"][final] - base["val_loss"][final]
        entry["speed_ratio_to_first"] = entry["tokens_per_s"] / base["tokens_per_s"]
        entry["flops_ratio_to_first"] = entry["flops_per_token"] / base["flops_per_token"]
    json.dump({"config": args.config, "overrides": args.overrides, "depths": runs, "torch": torch.__version__,
               "python": sys.version.split()[0], "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads()}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
