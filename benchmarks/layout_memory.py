"""Bytes each rank holds in parameters, gradients and optimizer state under each parallel layout,
for the tiny model with 4 blocks (what plan/'s memory model must predict exactly), and the
tokens/s each layout reaches here (2 CPU cores: a check that nothing is pathologically slow,
not a speed figure). Runs every layout of one process count in one torchrun job.

    .venv/bin/python benchmarks/layout_memory.py [--data DIR] [--out FILE]

Prints one JSON object: layout -> {"world": N, "bytes_by_rank": [...], "max_rank_total": B,
"tokens_per_s": T}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    1: {"single": []},
    2: {"replicate-2": ["parallel.dp_replicate=2", "parallel.dp_shard=1"], "fsdp-2": ["parallel.dp_shard=2"],
        "tp-2": ["parallel.tp=2", "parallel.dp_shard=1"], "cp-2": ["parallel.cp=2", "parallel.dp_shard=1"],
        "pp-2": ["parallel.pp=2", "parallel.dp_shard=1"]},
    4: {"fsdp-4": ["parallel.dp_shard=4", "train.micro_batch=2"], "fsdp-2-x-tp-2": ["parallel.tp=2"],
        "fsdp-2-x-pp-2": ["parallel.pp=2", "train.micro_batch=2"], "tp-2-x-pp-2": ["parallel.tp=2", "parallel.pp=2"],
        "cp-2-x-tp-2": ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"],
        "fsdp-2-x-cp-2": ["parallel.cp=2"]},
    8: {"fsdp-2-x-tp-2-x-pp-2": ["parallel.tp=2", "parallel.pp=2", "train.micro_batch=2"]},
}
COMMON = ["model.n_layers=4", "train.steps=4", "eval.interval=0", "checkpoint.interval=0", "log.interval=2"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None, help="a prepared data directory (default: prepare 400 kB of the stdlib)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    data = args.data
    if data is None:
        from scaletrain.data import prepare

        data = work / "data"
        prepare(["builtin:python-stdlib"], data, vocab_size=512, max_bytes=400_000, val_fraction=0.05, workers=1)
    report = {}
    for world, layouts in LAYOUTS.items():
        spec = [{"config": str(ROOT / "configs" / "tiny.toml"), "stop_at_step": None,
                 "overrides": [f"data.path={data}", f"run.dir={work}", f"run.name={name}", *COMMON, *overrides]}
                for name, overrides in layouts.items()]
        spec_path = work / f"spec-{world}.json"
        spec_path.write_text(json.dumps(spec))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   str(ROOT / "tests" / "run_layouts.py"), str(spec_path)]
        subprocess.run(command, check=True, capture_output=True, env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        for name in layouts:
            by_rank = read_metrics(work / name, "memory")[0]["bytes_by_rank"]
            report[name] = {"world": world, "bytes_by_rank": by_rank,
                            "max_rank_total": max(sum(rank.values()) for rank in by_rank),
                            "tokens_per_s": read_metrics(work / name, "train")[-1]["tokens_per_s"]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
