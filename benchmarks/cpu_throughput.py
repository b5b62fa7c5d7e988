"""CPU training throughput of the demo model, against the CPU's own matmul rate measured in the same run.

Prints one JSON object: tokens/s of full training steps (forward, backward, AdamW) of
configs/demo.toml's model on random tokens, the model FLOP/s this implies (model/flops.py),
the float32 matmul FLOP/s of the same machine (square matmuls the size of the model's
largest), and their ratio — an MFU whose peak is measured here rather than looked up.

    .venv/bin/python benchmarks/cpu_throughput.py [--steps 8] [--config configs/demo.toml] [--documents 200]

With --documents L the same steps run again on sequences of packed documents (an end-of-document
token after each, lengths drawn around L tokens) with attention kept within documents
(model.document_mask), reported beside the causal run as "document_mask": its tokens/s, their
ratio to the causal run's, and the bytes autograd saves for one micro-batch in each.
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
from scaletrain.model.llama import Transformer, document_ids
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
    parser.add_argument("--documents", type=int, default=0,
                        help="also time attention within packed documents of about this many tokens")
    args = parser.parse_args()

    cfg = load_config(args.config, [f"model.vocab_size={args.vocab_size}"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                                device=torch.device("cpu"))
    micro_steps = cfg.seqs_per_step // cfg.train.micro_batch
    shape = (cfg.train.micro_batch, cfg.data.seq_len + 1)
    eos = args.vocab_size - 1

    def batch(documents: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = torch.randint(0, eos, shape)
        if not documents:
            return tokens, None
        tokens[torch.rand(shape) < 1 / args.documents] = eos  # documents of ~L tokens, geometric lengths
        return tokens, document_ids(tokens[:, :-1], eos)

    def step(documents: bool) -> None:
        for _ in range(micro_steps):
            tokens, ids = batch(documents)
            (model(tokens[:, :-1], tokens[:, 1:], documents=ids) / micro_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def tokens_per_s_of(documents: bool) -> float:
        step(documents)  # warm-up: allocations, optimizer state
        start = time.perf_counter()
        for _ in range(args.steps):
            step(documents)
        return args.steps * cfg.train.global_batch_tokens / (time.perf_counter() - start)

    def saved_bytes(documents: bool) -> int:
        """What autograd keeps for the backward pass of one micro-batch (each storage once)."""
        storages = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        tokens, ids = batch(documents)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(tokens[:, :-1], tokens[:, 1:], documents=ids)
        del loss
        return sum(storages.values())

    tokens_per_s = tokens_per_s_of(False)
    masked = None
    if args.documents:  # alternately, each its faster of two: the machine's drift hits both alike
        masked_speed = tokens_per_s_of(True)
        tokens_per_s = max(tokens_per_s, tokens_per_s_of(False))
        masked_speed = max(masked_speed, tokens_per_s_of(True))
        masked = {"mean_document_tokens": args.documents, "tokens_per_s": round(masked_speed, 1),
                  "ratio_to_causal": round(masked_speed / tokens_per_s, 3),
                  "saved_bytes_per_micro_batch": saved_bytes(True), "causal_saved_bytes": saved_bytes(False)}
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
        **({"document_mask": masked} if masked else {}),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }, indent=1))


if __name__ == "__main__":
    main()
