"""CPU training throughput of the demo model, against the CPU's own matmul rate measured in the same run.

Prints one JSON object: tokens/s of full training steps (forward, backward, AdamW) of
configs/demo.toml's model on random tokens, the model FLOP/s this implies (model/flops.py),
the float32 matmul FLOP/s of the same machine (square matmuls the size of the model's
largest), and their ratio — an MFU whose peak is measured here rather than looked up.

    .venv/bin/python benchmarks/cpu_throughput.py [--steps 8] [--config configs/demo.toml]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.model.flops import train_flops_per_token
from scaletrain.model.llama import Transformer
from scaletrain.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]


def matmul_flops_per_s(n: int, repeats: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    cfg = load_config(args.config, [f"model.vocab_size={args.vocab_size}"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                                device=torch.device("cpu"))
    micro_steps = cfg.seqs_per_step // cfg.train.micro_batch
    shape = (cfg.train.micro_batch, cfg.data.seq_len + 1)

    def step() -> None:
        for _ in range(micro_steps):
            batch = torch.randint(0, args.vocab_size, shape)
            (model(batch[:, :-1], batch[:, 1:]) / micro_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, optimizer state
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    tokens_per_s = args.steps * cfg.train.global_batch_tokens / seconds
    flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
    model_flops = tokens_per_s * flops_per_token
    matmul = matmul_flops_per_s(max(cfg.model.dim, cfg.model.hidden_dim, 1024))
    print(json.dumps({
        "benchmark": "cpu_throughput",
        "config": str(Path(args.config).name),
        "params": sum(p.numel() for p in model.parameters()),
        "global_batch_tokens": cfg.train.global_batch_tokens,
        "steps": args.steps,
        "tokens_per_s": round(tokens_per_s, 1),
        "train_flops_per_token": flops_per_token,
        "model_gflops_per_s": round(model_flops / 1e9, 2),
        "matmul_gflops_per_s": round(matmul / 1e9, 2),
        "mfu_vs_measured_matmul": round(model_flops / matmul, 4),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }, indent=1))


if __name__ == "__main__":
    main()
