"""Does the best learning rate carry over from a narrow model to wider ones? The same run (config,
data, seed, steps) at several widths (heads of 16, depth and everything else fixed) and learning
rates, in the standard parametrization and under muP (model.mup_base_dim = the narrowest
width), trained one after the other in this process. Prints JSON: each run's final validation
loss, each width's best learning rate, and how far (in factors of two) the best rate moved from
the narrowest width to the widest.

    python benchmarks/mup_transfer.py configs/tiny.toml data.path=DIR [train.steps=N ...]
        [--widths 64,128,256] [--lrs 0.001,0.002,...]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train


def val_loss(config: str, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(config, [*overrides, f"run.dir={root}", "run.name=run", "log.interval=1000000",
                                   "checkpoint.interval=0", "eval.interval=0"])
        train(cfg)
        evals = [r for r in read_metrics(Path(root) / "run") if r["kind"] == "eval"]
    return evals[-1]["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--lrs", default=",".join(f"{2 ** k / 1024:g}" for k in range(0, 7)))  # 2^-10 .. 2^-4
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    widths = [int(w) for w in args.widths.split(",")]
    lrs = [float(lr) for lr in args.lrs.split(",")]
    cfg = load_config(args.config, args.overrides)
    result = {"config": args.config, "overrides": args.overrides, "steps": cfg.total_steps, "widths": widths,
              "lrs": lrs, "mup_base_dim": widths[0], "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    start = time.perf_counter()
    for name, extra in (("standard", []), ("mup", [f"model.mup_base_dim={widths[0]}"])):
        losses = {}
        for width in widths:
            shape = [f"model.dim={width}", f"model.n_heads={width // 16}", f"model.n_kv_heads={width // 16}"]
            losses[width] = {lr: round(val_loss(args.config, [*args.overrides, *shape, *extra, f"train.lr={lr}"]), 4)
                             for lr in lrs}
        best = {width: min(by_lr, key=lambda lr: by_lr[lr] if math.isfinite(by_lr[lr]) else math.inf)
                for width, by_lr in losses.items()}
        result[name] = {"val_loss": {str(w): {f"{lr:g}": loss for lr, loss in by_lr.items()}
                                     for w, by_lr in losses.items()},
                        "best_lr": {str(w): lr for w, lr in best.items()},
                        "best_val_loss": {str(w): losses[w][best[w]] for w in widths},
                        "best_lr_shift_doublings": round(math.log2(best[widths[-1]] / best[widths[0]]), 2)}
    result["seconds"] = round(time.perf_counter() - start, 1)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
