"""The references of issue 6's table, measured in the same process as scaletrain's runs: a plain
GPT-2 (nanoGPT's recipe) and a plain Llama, each a bare training loop with nothing around it —
whole-model `torch.compile`, bf16 autocast, fused AdamW, gradient clipping, no data loader (the
batches are drawn on the device once), no metrics, the loss read on the host only after the last
step. What scaletrain's trainer adds (its loader, logging, checkpoints, per-block compilation,
chunked loss) is then measured against this on the same device and day rather than against
figures taken elsewhere. The loop reads the loss less often than nanoGPT's (every step by
default), so it is if anything faster than nanoGPT itself.

    PYTHONPATH=src python benchmarks/plain_loops.py [--tiny]   # prints JSON

benchmarks/gpu_suite.py runs these as its "baselines" section.

GPT-2 as Radford et al. 2019 describe it (and nanoGPT builds it): learned position embeddings,
pre-LayerNorm blocks with biases, a 4x GELU MLP, the output head tied to the token embedding,
weights N(0, 0.02) with the residual projections scaled by 1 / sqrt(2 L). The Llama is
scaletrain's own model (model/llama.py) with its loss over the whole batch, compiled whole.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import load_config
from scaletrain.model.flops import train_flops_per_token
from scaletrain.model.llama import Transformer
from scaletrain.plan.hardware import peak_flops

# name -> (shape, sequences a step, sequence length): issue 6's references.
GPT2_SHAPES = {"gpt2-124m": (dict(dim=768, n_layers=12, n_heads=12, vocab=50304), 16, 1024)}
LLAMA_SHAPES = {"llama-126m": (["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=4",
                                "model.vocab_size=32768"], 16, 2048),
                "llama-1.1b": (["model.dim=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=8",
                                "model.ffn_dim=8192", "model.vocab_size=32768"], 8, 2048)}
TINY_GPT2 = (dict(dim=64, n_layers=2, n_heads=4, vocab=512), 4, 64)
TINY_LLAMA = (["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512"],
              4, 64)


class GPT2Block(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.fc_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (part.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for part in self.qkv(self.ln_1(x)).split(d, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attended)
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT2(nn.Module):
    def __init__(self, dim: int, n_layers: int, n_heads: int, vocab: int, seq_len: int):
        super().__init__()
        self.n_layers, self.n_heads, self.dim, self.vocab = n_layers, n_heads, dim, vocab
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(GPT2Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "fc_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.reshape(-1))

    def flops_per_token(self, seq_len: int, causal: bool = False) -> int:
        """6 N + 12 L d T as model/flops.py counts a Llama: N the blocks' matmuls and the head (equal
        to its count of gpu_suite's Llama-style gpt2-124m, whose SwiGLU has the 4x MLP's weights;
        tests/test_benchmarks.py checks)."""
        attention = 12 * self.n_layers * self.dim * seq_len
        return 6 * (12 * self.n_layers * self.dim ** 2 + self.vocab * self.dim) + (attention // 2 if causal else attention)


def measure(model: nn.Module, flops_per_token: tuple[int, int], seqs: int, seq_len: int, vocab: int, steps: int,
            warmup: int, device: torch.device, compile: bool) -> dict:
    """`steps` steps of the bare loop on random tokens; the last steps - warmup timed."""
    model = model.to(device)
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # decayed; biases and norms not (nanoGPT's groups)
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_fn = torch.compile(model) if compile else model
    gen = torch.Generator(device=device).manual_seed(0)
    batch = torch.randint(0, vocab, (seqs, seq_len + 1), device=device, generator=gen)
    tokens, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    called = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            sync()
            started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = step_fn(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            sync()
            first_step_s = time.perf_counter() - called
    final = loss.item()  # (waits for the device)
    step_s = (time.perf_counter() - started) / (steps - warmup)
    tokens_per_s = seqs * seq_len / step_s
    peak = peak_flops(torch.cuda.get_device_name(), "bf16") if cuda else None
    mfu, mfu_causal = ((None, None) if peak is None else
                       (round(tokens_per_s * flops_per_token[0] / peak, 4),
                        round(tokens_per_s * flops_per_token[1] / peak, 4)))
    return {"tokens_per_step": seqs * seq_len, "timed_steps": steps - warmup, "step_ms": round(1000 * step_s, 2),
            "tokens_per_s": round(tokens_per_s), "mfu": mfu, "mfu_causal": mfu_causal,
            "cold_start_s": round(first_step_s, 1), "final_loss": round(final, 4),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
            "mean_tokens_per_s": round(tokens_per_s),  # (the loop's is a mean: its clock spans every timed step)
            "parameters": sum(p.numel() for p in model.parameters())}


def baselines(names: list[str], steps: int, warmup: int, tiny: bool = False) -> dict:
    """Each named reference measured with the bare loop (on the CPU, uncompiled, with tiny
    shapes); a failure is its row's error, not the end."""
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    compile = device.type == "cuda"
    out = {}
    for name in names:
        torch.manual_seed(0)
        try:
            if name in GPT2_SHAPES:
                shape, seqs, seq_len = TINY_GPT2 if tiny else GPT2_SHAPES[name]
                model = GPT2(**shape, seq_len=seq_len)
                flops = (model.flops_per_token(seq_len), model.flops_per_token(seq_len, causal=True))
                vocab = shape["vocab"]
                what = "plain GPT-2, nanoGPT's recipe (whole-model compile, fused AdamW)"
            else:
                shape, seqs, seq_len = TINY_LLAMA if tiny else LLAMA_SHAPES[name]
                cfg = load_config(None, [*shape, "train.steps=1", f"model.max_seq_len={seq_len}",
                                         f"data.seq_len={seq_len}"]).model
                with torch.device(device):
                    model = Transformer(cfg)
                flops = (train_flops_per_token(cfg, seq_len), train_flops_per_token(cfg, seq_len, causal=True))
                vocab = cfg.vocab
                what = "plain Llama: scaletrain's model, whole-model compile, whole-batch loss, fused AdamW"
            out[name] = {"what": what, "sequences": seqs, "seq_len": seq_len,
                         **measure(model, flops, seqs, seq_len, vocab, steps, warmup, device, compile)}
        except Exception as e:  # (out of memory, a compile failure: a row of its own)
            what = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            out[name] = {"error": f"{what}: {str(e)[:300]}"}
        finally:  # (dynamo's cache is kept: gpu_suite's ablations reuse the trainer's compiled blocks)
            model = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                # What the loop left behind (a compiled model kept alive would show here).
                out[name]["left_allocated_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--names", default=",".join([*GPT2_SHAPES, *LLAMA_SHAPES]))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the loop, measures nothing")
    args = parser.parse_args()
    print(json.dumps(baselines(args.names.split(","), args.steps, args.warmup, args.tiny), indent=1))


if __name__ == "__main__":
    main()
