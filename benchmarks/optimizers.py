"""AdamW against Muon (train.optimizer) on the same run: the same model, data, seed, schedule,
learning rate and weight decay (Muon scaled as Moonlight did, so that they carry over), trained
one after the other in this process. Prints JSON: each one's training loss over the last tenth
of the steps, final validation loss, median step time and the bytes its optimizer holds.

    python benchmarks/optimizers.py configs/demo.toml data.path=DIR [train.steps=N ...]
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


def run(config: str, overrides: list[str], optimizer: str) -> dict:
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(config, [*overrides, f"run.dir={root}", "run.name=run", "log.interval=1",
                                   "checkpoint.interval=0", f"train.optimizer={optimizer}"])
        train(cfg)
        records = read_metrics(Path(root) / "run")
    steps = [r for r in records if r["kind"] == "train"]
    tail = steps[-max(1, len(steps) // 10):]
    evals = [r for r in records if r["kind"] == "eval"]
    return {"train_loss_last_tenth": round(statistics.mean(r["loss"] for r in tail), 4),
            "val_loss": round(evals[-1]["loss"], 4) if evals else None,
            "val_loss_by_step": {r["step"]: round(r["loss"], 4) for r in evals},
            "median_step_s": round(statistics.median(cfg.train.global_batch_tokens / r["tokens_per_s"]
                                                     for r in steps[1:]), 4),
            "optimizer_bytes": next(r for r in records if r["kind"] == "memory")["bytes_by_rank"][0]["optimizer"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(args.config, args.overrides)
    result = {"config": args.config, "overrides": args.overrides, "steps": cfg.total_steps,
              "lr": cfg.train.lr, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads()}
    for optimizer in ("adamw", "muon"):
        result[optimizer] = run(args.config, args.overrides, optimizer)
    result["muon_step_time_ratio"] = round(result["muon"]["median_step_s"] / result["adamw"]["median_step_s"], 3)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
