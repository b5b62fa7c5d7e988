"""Does a learning-rate and batch rule measured on the user's data (`scaletrain hparams`) choose
better than DeepSeek LLM's published one where it was not measured? The search trains its grid
(5 learning rates x 3 batches around DeepSeek's rule) at --budgets on the standard library's
Python (2048-token BPE) and fits the law; then the prior law's compute-optimal model at --scale x
the largest budget trains with the measured law's (lr, batch), with DeepSeek's, and with the
measured batch at half and twice the measured rate, so that the measured rate is seen against
its neighbours. Prints JSON: the law with its intervals, each budget's optimum, and each check
run's final validation loss.

    python benchmarks/hparams.py [--budgets 3e10,1e11,3e11] [--scale 10] [--work DIR] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch

from scaletrain.data import prepare
from scaletrain.hparams import HparamSearch, HparamSettings, run_config
from scaletrain.model.flops import param_counts, train_flops_per_token
from scaletrain.proxies import train_proxy
from scaletrain.scaling.grid import Point, shapes_around, steps_for
from scaletrain.scaling.hparams import DEEPSEEK
from scaletrain.scaling.laws import preset
from scaletrain.train.trainer import train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", default="3e10,1e11,3e11")
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--work", default="/tmp/hparams_bench")
    parser.add_argument("--max-bytes", type=int, default=6_000_000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.work)
    started = time.perf_counter()
    data = work / "data" / "stdlib"
    if not (data / "index.json").is_file():
        prepare(["builtin:python-stdlib"], data, vocab_size=2048, max_bytes=args.max_bytes, val_fraction=0.05,
                workers=2)
    settings = HparamSettings(data=str(data), budgets=[float(b) for b in args.budgets.split(",")], seed=args.seed,
                              device="cpu")
    search = HparamSearch(work / f"search-{args.seed}", settings)
    rows = search.run(concurrency=args.concurrency)
    law, optima, boot = search.fit(rows)
    target = max(settings.budgets) * args.scale
    _, doc = search.write(law, optima, boot, [target])
    searched = time.perf_counter() - started

    shape = shapes_around(preset(settings.prior).optimum(target)[0], 1, search.vocab_size)[0]
    model = shape.model(search.vocab_size, settings.seq_len)
    per_token, n = train_flops_per_token(model, settings.seq_len), param_counts(model)["total"]
    measured_lr, measured_batch = law(target)
    candidates = {"measured": (measured_lr, measured_batch), "deepseek": DEEPSEEK(target),
                  "measured_half_lr": (measured_lr / 2, measured_batch),
                  "measured_double_lr": (measured_lr * 2, measured_batch)}
    checks = {}
    for label, (lr, batch_tokens) in candidates.items():
        seqs = search.batch_seqs(batch_tokens)
        steps = max(1, round(steps_for(target, per_token, seqs, settings.seq_len)))
        point = Point(shape, target, n, per_token, settings.seq_len, seqs, steps, lr)
        cfg = run_config(settings, search.vocab_size, point, work / f"check-{args.seed}" / label)
        _, loss, _ = train_proxy(cfg, train)
        checks[label] = {"lr": lr, "batch_seqs": seqs, "batch_tokens": seqs * settings.seq_len, "steps": steps,
                         "loss": loss}
    print(json.dumps({
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
        "budgets": settings.budgets, "runs": len(rows), "search_s": round(searched, 1),
        "law": doc["law"], "interval": doc["interval"], "optima": doc["budgets"],
        "check": {"budget": target, "shape": shape.name, "n": n, "runs": checks},
        "total_s": round(time.perf_counter() - started, 1)}, indent=1))


if __name__ == "__main__":
    main()
