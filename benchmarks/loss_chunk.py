"""The output head and loss, whole against chunked (train.loss_chunk_tokens), on this machine's
CPU: forward + backward time and the process's peak resident memory, each variant in a fresh
process so that one's peak does not hide the other's. Prints JSON.

    python benchmarks/loss_chunk.py [--tokens 8192] [--dim 512] [--vocab 32768] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def run(tokens: int, dim: int, vocab: int, chunk: int, repeats: int) -> dict:
    import torch

    from scaletrain.model.loss import chunked_cross_entropy, cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, dim, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, dim)).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        if chunk:
            loss = chunked_cross_entropy(hidden, weight, targets, chunk)
        else:
            loss = cross_entropy(hidden @ weight.T, targets)
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"chunk": chunk, "loss": loss.item(), "median_s": round(statistics.median(times), 4),
            "peak_rss_mb_above_inputs": round((peak - base) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(run(args.tokens, args.dim, args.vocab, args.variant, args.repeats)))
        return
    shape = ["--tokens", str(args.tokens), "--dim", str(args.dim), "--vocab", str(args.vocab),
             "--repeats", str(args.repeats)]
    rows = [json.loads(subprocess.run([sys.executable, __file__, *shape, "--variant", str(chunk)], check=True,
                                      capture_output=True, text=True).stdout) for chunk in (0, args.chunk)]
    whole, chunked = rows
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(json.dumps({"tokens": args.tokens, "dim": args.dim, "vocab": args.vocab, "float32_logits_mb": logits_mb,
                      "whole": whole, "chunked": chunked,
                      "time_ratio_chunked_over_whole": round(chunked["median_s"] / whole["median_s"], 3),
                      "loss_difference": abs(whole["loss"] - chunked["loss"])}, indent=1))


if __name__ == "__main__":
    main()
