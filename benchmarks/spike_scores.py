"""How far an ordinary run's loss strays above its running mean, in running standard deviations,
against a real spike: what train.spike_sigmas must clear. Trains CONFIG logging every step's loss
(over the global batch), then judges the losses as train.spike_sigmas does (the trainer's own
`loss_spike`) for several windows; with --boost STEP, the same run again with the update of that
step at 100 times its learning rate. Prints JSON.

    python benchmarks/spike_scores.py configs/demo.toml data.path=DIR [--windows 20,50,100] [--boost 200]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import tempfile
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.train import trainer
from scaletrain.train.metrics import read_metrics
from scaletrain.train.resilience import loss_spike
from scaletrain.train.schedule import run_lr


def losses(config: str, overrides: list[str], boost: int | None) -> list[float]:
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(config, [*overrides, f"run.dir={root}", "run.name=run", "log.interval=1",
                                   "eval.interval=0", "checkpoint.interval=0"])

        def boosted(cfg, step):
            return run_lr(cfg, step) * (100 if step + 1 == boost else 1)
        trainer.run_lr = boosted
        try:
            trainer.train(cfg)
        finally:
            trainer.run_lr = run_lr
        return [r["loss"] for r in read_metrics(Path(root) / "run", "train")]


def scores(series: list[float], window: int) -> list[float]:
    """Each judged step's excess over the running mean, in running standard deviations."""
    stats, out = torch.zeros(4), []
    for loss in series:
        seen, mean, var, _ = stats.tolist()
        if seen >= window:
            out.append((loss - mean) / math.sqrt(var) if var > 0 else math.inf)
        stats, _ = loss_spike(stats, torch.tensor(loss), sigmas=math.inf, window=window)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--windows", default="20,50,100")
    parser.add_argument("--boost", type=int, default=None, help="also a run whose update of this step is 100x")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(args.config, args.overrides)
    result = {"config": args.config, "overrides": args.overrides, "steps": cfg.total_steps,
              "global_batch_tokens": cfg.train.global_batch_tokens, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "windows": {}}
    plain = losses(args.config, args.overrides, None)
    spiked = losses(args.config, args.overrides, args.boost) if args.boost else None
    for window in (int(w) for w in args.windows.split(",")):
        judged = scores(plain, window)
        entry = {"judged_steps": len(judged), "max_sigmas": round(max(judged), 2),
                 "at_step": window + 1 + judged.index(max(judged)),
                 "steps_above": {k: sum(s > k for s in judged) for k in (3, 4, 5, 6, 7)}}
        if spiked:  # the boosted update's step is the last with the plain loss; the next one spikes
            entry["boosted_spike_sigmas"] = round(scores(spiked[:args.boost + 1], window)[-1], 1)
        result["windows"][window] = entry
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
