"""What one transformer block saves for its backward pass, eager against torch.compile'd, beside
plan/memory.py's tally (which counts the eager block). Bytes per token, counted with a
saved-tensors hook (tests/test_memory.py's counting_saves) over one block on this machine's CPU,
in float32 and under bf16 autocast, for shapes that vary one of width d, key/value width k, MLP
width F and heads h at a time, so that the compiled block's terms can be read off. Inductor's
partitioner chooses what a compiled block saves and what it recomputes; it is the same on CUDA,
but CUDA's kernels (flash attention, the fused norm) may change its choices: not measured there.
Prints JSON, one object a shape and dtype.

    python benchmarks/compiled_activations.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

SHAPES = [dict(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=384), dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=384),
          dict(dim=128, n_heads=4, n_kv_heads=4, ffn_dim=384), dict(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=512),
          dict(dim=128, n_heads=8, n_kv_heads=2, ffn_dim=384),
          dict(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=384, qk_norm=True)]


def saved_per_token(block, model, tokens, bf16: bool) -> float:
    import torch
    from test_memory import counting_saves

    for _ in range(2):  # (the first call compiles)
        x = model.tok_embeddings(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), counting_saves(model) as seen:
            block(x, model.rope_cos, model.rope_sin)
    return sum(seen.values()) / tokens.numel()


def main() -> None:
    import torch
    import torch._dynamo

    from scaletrain.config import ModelConfig
    from scaletrain.model.llama import Transformer
    from scaletrain.plan.memory import block_bytes_per_token

    torch.manual_seed(0)
    for bf16 in (False, True):
        for shape in SHAPES:
            cfg = ModelConfig(vocab_size=512, max_seq_len=64, n_layers=1, **shape)
            model = Transformer(cfg)
            tokens = torch.randint(0, 512, (3, 64))
            eager = saved_per_token(model.layers["0"], model, tokens, bf16)
            torch._dynamo.reset()
            compiled = saved_per_token(torch.compile(model.layers["0"]), model, tokens, bf16)
            print(json.dumps({"dtype": "bf16" if bf16 else "float32", **shape, "eager": eager, "compiled": compiled,
                              "tally": block_bytes_per_token(cfg, bf16, "none"), "saved_by_compiling": eager - compiled}),
                  flush=True)


if __name__ == "__main__":
    main()
