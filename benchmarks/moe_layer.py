"""What routing costs: a mixture-of-experts MLP (model/moe.py) against a dense SwiGLU MLP doing
the same matmul FLOPs per token, forward and backward, on one device. The reference is
measured in the same run; the ratio is the overhead of routing, sorting, gathering and running
the experts at this size — as model/moe.py runs them on this device (one grouped GEMM where it
can), and as one matmul per expert (its fallback), both in the same run. Prints JSON.

    python benchmarks/moe_layer.py [--tokens 4096] [--dim 256] [--experts 8] [--top-k 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from scaletrain.config import ModelConfig  # noqa: E402
from scaletrain.model.llama import FeedForward  # noqa: E402
from scaletrain.model import moe as moe_module  # noqa: E402
from scaletrain.model.moe import MoE  # noqa: E402


def timed(module: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of a forward and backward."""
    times = []
    for i in range(repeats + 2):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        module(x).sum().backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden = 4 * args.dim // args.top_k  # each expert; the dense MLP is top-k experts wide
    cfg = ModelConfig(vocab_size=64, dim=args.dim, n_heads=max(1, args.dim // 64), moe_experts=args.experts,
                      moe_top_k=args.top_k, moe_ffn_dim=hidden)
    moe = MoE(cfg).to(args.device)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    dense = FeedForward(args.dim, hidden * args.top_k).to(args.device)
    x = torch.randn(1, args.tokens, args.dim, device=args.device, requires_grad=True)
    grouped = moe_module._grouped(x, moe.experts.w1, x.dtype)
    moe_s, dense_s = timed(moe, x, args.repeats), timed(dense, x, args.repeats)
    chosen = moe_module._grouped
    moe_module._grouped = lambda *args: False  # the per-expert loop, for comparison
    try:
        loop_s = timed(moe, x, args.repeats)
    finally:
        moe_module._grouped = chosen
    print(json.dumps({"device": args.device, "torch": torch.__version__, "tokens": args.tokens, "dim": args.dim,
                      "experts": args.experts, "top_k": args.top_k, "expert_hidden": hidden, "grouped_gemm": grouped,
                      "moe_ms": round(1000 * moe_s, 2), "moe_loop_ms": round(1000 * loop_s, 2),
                      "dense_same_flops_ms": round(1000 * dense_s, 2), "overhead": round(moe_s / dense_s, 3),
                      "loop_overhead": round(loop_s / dense_s, 3)}))


if __name__ == "__main__":
    main()
