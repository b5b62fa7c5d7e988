"""Does data loading keep up with training? Tokens/s of the loader alone against the trainer's
consumption on the same config, measured in the same run. Prints one JSON object.

    .venv/bin/python benchmarks/loader_speed.py [--data data/python-stdlib] [--config configs/demo.toml]

The data directory is prepared first if missing (the demo's: builtin:python-stdlib, 12 MB, 4096 tokens).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.data import prepare
from scaletrain.data.loader import TokenLoader
from scaletrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    parser.add_argument("--data", default=str(ROOT / "data" / "python-stdlib"))
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--loader-steps", type=int, default=500)
    args = parser.parse_args()
    if not (Path(args.data) / "index.json").is_file():
        prepare(["builtin:python-stdlib"], args.data, vocab_size=4096, max_bytes=12_000_000, val_fraction=0.02)
    cfg = load_config(args.config, [f"data.path={args.data}"])

    loader = TokenLoader(cfg.data.sources, cfg.data.seq_len, cfg.seqs_per_step, cfg.train.micro_batch,
                         weights=cfg.data.weights)
    start = time.perf_counter()
    for _ in range(args.loader_steps * loader.micro_steps):
        loader.next_batch()
    loader_tokens_per_s = args.loader_steps * cfg.train.global_batch_tokens / (time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as runs:
        trainer = Trainer(load_config(args.config, [f"data.path={args.data}", f"run.dir={runs}", "run.name=bench"]))
        trainer.train_step()  # warm-up
        start = time.perf_counter()
        for _ in range(args.train_steps):
            trainer.train_step()
        train_tokens_per_s = args.train_steps * cfg.train.global_batch_tokens / (time.perf_counter() - start)
    print(json.dumps({
        "benchmark": "loader_speed", "config": Path(args.config).name, "seq_len": cfg.data.seq_len,
        "loader_tokens_per_s": round(loader_tokens_per_s), "trainer_tokens_per_s": round(train_tokens_per_s),
        "loader_headroom": round(loader_tokens_per_s / train_tokens_per_s, 1), "torch": torch.__version__,
    }, indent=1))


if __name__ == "__main__":
    main()
