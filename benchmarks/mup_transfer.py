"""Does the best learning rate carry over from a narrow model to wider ones, or from a shallow one
to deeper ones? The same run (config, data, seed, steps) at several widths (heads of 16, depth
and everything else fixed) — or, with --depths, at several depths (the width fixed) — and
learning rates, in the standard parametrization and under muP (model.mup_base_dim = the
narrowest width; with --depths depth-wise muP, CompleteP: model.mup_base_layers = the
shallowest depth), trained one after the other in this process. Prints JSON: each run's final
validation loss, the median of its logged gradient norms and the share of them clipped, each
size's best learning rate, and how far (in factors of two) the best rate moved from the
smallest size to the largest.

    python benchmarks/mup_transfer.py configs/tiny.toml data.path=DIR [train.steps=N ...]
        [--widths 64,128,256 | --depths 2,4,8] [--lrs 0.001,0.002,...] [--only standard|mup]
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


def trained(config: str, overrides: list[str]) -> tuple[float, float, float]:
    """One run's final validation loss, the median of its logged gradient norms (every tenth step;
    under muP with its multipliers written out, as clipping counts them) and the share of those
    steps clipped (norm above train.clip)."""
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(config, [*overrides, f"run.dir={root}", "run.name=run", "log.interval=10",
                                   "checkpoint.interval=0", "eval.interval=0"])
        train(cfg)
        records = read_metrics(Path(root) / "run")
    norms = sorted(r["grad_norm"] for r in records if r["kind"] == "train")
    clipped = sum(n > cfg.train.clip for n in norms) / len(norms) if cfg.train.clip else 0.0
    return [r for r in records if r["kind"] == "eval"][-1]["loss"], norms[len(norms) // 2], clipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--depths", default=None, help="vary the depth instead of the width (depth-wise muP)")
    parser.add_argument("--lrs", default=",".join(f"{2 ** k / 1024:g}" for k in range(0, 7)))  # 2^-10 .. 2^-4
    parser.add_argument("--only", choices=("standard", "mup"), default=None,
                        help="one parametrization (the other's rows measured before)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    lrs = [float(lr) for lr in args.lrs.split(",")]
    cfg = load_config(args.config, args.overrides)
    result = {"config": args.config, "overrides": args.overrides, "steps": cfg.total_steps, "lrs": lrs,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads()}
    if args.depths:
        sizes = [int(d) for d in args.depths.split(",")]
        result.update(depths=sizes, mup_base_layers=sizes[0], width=cfg.model.dim)

        def shape(depth: int) -> list[str]:
            return [f"model.n_layers={depth}"]
        mup = [f"model.mup_base_layers={sizes[0]}"]
    else:
        sizes = [int(w) for w in args.widths.split(",")]
        result.update(widths=sizes, mup_base_dim=sizes[0])

        def shape(width: int) -> list[str]:
            return [f"model.dim={width}", f"model.n_heads={width // 16}", f"model.n_kv_heads={width // 16}"]
        mup = [f"model.mup_base_dim={sizes[0]}"]
    start = time.perf_counter()
    for name, extra in (("standard", []), ("mup", mup)):
        if args.only not in (None, name):
            continue
        runs = {size: {lr: trained(args.config, [*args.overrides, *shape(size), *extra, f"train.lr={lr}"])
                       for lr in lrs} for size in sizes}
        losses = {size: {lr: round(run[0], 4) for lr, run in by_lr.items()} for size, by_lr in runs.items()}
        best = {size: min(by_lr, key=lambda lr: by_lr[lr] if math.isfinite(by_lr[lr]) else math.inf)
                for size, by_lr in losses.items()}
        result[name] = {"val_loss": {str(size): {f"{lr:g}": loss for lr, loss in by_lr.items()}
                                     for size, by_lr in losses.items()},
                        "best_lr": {str(size): lr for size, lr in best.items()},
                        "best_val_loss": {str(size): losses[size][best[size]] for size in sizes},
                        "best_lr_shift_doublings": round(math.log2(best[sizes[-1]] / best[sizes[0]]), 2),
                        "median_grad_norm": {str(size): {f"{lr:g}": round(run[1], 4) for lr, run in by_lr.items()}
                                             for size, by_lr in runs.items()},
                        "clipped_share": {str(size): {f"{lr:g}": round(run[2], 3) for lr, run in by_lr.items()}
                                          for size, by_lr in runs.items()}}
    result["seconds"] = round(time.perf_counter() - start, 1)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
