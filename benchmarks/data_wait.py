"""How long a training step waits for its batch, with and without the prefetching thread, when
the step itself is a fixed time of device work (a sleep stands in for a GPU step that releases
the host). Prints JSON: median wait per micro-batch and its share of the step.

    python benchmarks/data_wait.py [--seq-len 1024] [--micro-batch 16] [--step-ms 33]

The default shape is nanoGPT's GPT-2 124M benchmark on one H200 (16 x 1024 tokens a step at
~489k tokens/s, i.e. ~33 ms a step, issue 6); data is the interpreter's standard library,
prepared once into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from scaletrain.data import prepare
from scaletrain.data.loader import Prefetcher, TokenLoader


def waits(loader, steps: int, step_s: float) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loader.next_batch()
        out.append(time.perf_counter() - t0)
        time.sleep(step_s)  # the device's step; the host is free meanwhile
    return out[3:]  # the first batches start the thread and warm the page cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=33.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-bytes", type=int, default=8_000_000)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp()) / "data"
    prepare(["builtin:python-stdlib"], data, vocab_size=4096, max_bytes=args.max_bytes)
    shape = (data, args.seq_len, args.micro_batch, args.micro_batch)
    report = {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "step_ms": args.step_ms}
    for name, loader in (("plain", TokenLoader(*shape)), ("prefetched", Prefetcher(TokenLoader(*shape)))):
        measured = waits(loader, args.steps, args.step_ms / 1000)
        report[name] = {"median_wait_ms": round(1000 * statistics.median(measured), 4),
                        "max_wait_ms": round(1000 * max(measured), 4),
                        "share_of_step": round(statistics.median(measured) / (args.step_ms / 1000), 6)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
