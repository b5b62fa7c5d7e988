"""Does the mixture a search chooses (`scaletrain mixture`) beat the natural and the uniform one
on a larger model? Three real sources on this machine, one tokenizer: the standard library's
Python ("stdlib"), the installed packages' Python ("packages") and prose ("prose": the
installed packages' METADATA, .md and .rst files — their READMEs — and /usr/share/doc). The search trains its proxies
at --budget and chooses for a target of every source's validation loss alike; then the prior
law's compute-optimal model at --scale x the budget trains on the chosen, the natural (by
tokens) and the uniform mixtures. Prints JSON: the search (proxy, law's prediction, the check
run, leave-one-out error) and each larger run's validation loss by source and target loss.

    python benchmarks/mixture.py [--budget 3e11] [--scale 10] [--work DIR] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from scaletrain.data import prepare
from scaletrain.mixture import MixtureSearch, MixtureSettings, proxy_config
from scaletrain.proxies import train_proxy
from scaletrain.scaling.grid import deepseek_hyperparameters, plan_points, shapes_around
from scaletrain.scaling.laws import preset
from scaletrain.train.trainer import train

SOURCES = {"stdlib": ["builtin:python-stdlib"], "packages": ["builtin:python-packages"]}


def prepare_sources(root: Path, max_bytes: int) -> None:
    """root/stdlib, root/packages and root/prose, one 2048-token BPE trained on all three."""
    site = sysconfig.get_paths()["purelib"]
    sources = {**SOURCES, "prose": [f"{site}/**/METADATA", f"{site}/**/*.md", f"{site}/**/*.rst", "/usr/share/doc/**"]}
    if all((root / name / "index.json").is_file() for name in sources):
        return
    everything = [s for listed in sources.values() for s in listed]
    prepare(everything, root / "_tokenizer", vocab_size=2048, max_bytes=3_000_000, val_fraction=0.01, workers=2)
    for name, listed in sources.items():
        prepare(listed, root / name, vocab_size=2048, max_bytes=max_bytes, val_fraction=0.05, workers=2,
                tokenizer=root / "_tokenizer" / "tokenizer.json")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=3e11)
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--work", default="/tmp/mixture_bench")
    parser.add_argument("--max-bytes", type=int, default=6_000_000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.work)
    started = time.perf_counter()
    prepare_sources(work / "data", args.max_bytes)
    settings = MixtureSettings(data=str(work / "data"), sources=["packages", "prose", "stdlib"], budget=args.budget,
                               seq_len=128, eval_tokens=16384, seed=args.seed, device="cpu")
    search = MixtureSearch(work / f"search-{args.seed}", settings)
    rows = search.run(concurrency=args.concurrency)
    law, choice = search.choose(rows)
    check = search.check(choice)
    search.write(law, choice, check)
    searched = time.perf_counter() - started

    big_budget = args.budget * args.scale
    shape = shapes_around(preset("epoch").optimum(big_budget)[0], 1, search.vocab_size)[0]
    point = plan_points(big_budget, [shape], search.vocab_size, settings.seq_len, deepseek_hyperparameters,
                        micro_batch=settings.micro_batch)[0]
    names = settings.sources
    natural = np.array([search.unique_tokens[n] for n in names], dtype=float)
    candidates = {"chosen": choice.shares, "natural": dict(zip(names, (natural / natural.sum()).round(4).tolist())),
                  "uniform": {n: round(1 / len(names), 4) for n in names}}
    large = {}
    for label, shares in candidates.items():
        cfg = proxy_config(settings, search.vocab_size, point, shares, work / f"large-{args.seed}" / label)
        by_source, _, _ = train_proxy(cfg, train)
        large[label] = {"shares": shares, "loss_by_source": by_source,
                        "target": sum(choice.target[n] * by_source[n] for n in names)}
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
                                                      f"{torch.get_num_threads()} threads",
        "torch": torch.__version__, "seed": args.seed,
        "unique_tokens": search.unique_tokens,
        "proxy": {"shape": search.point.shape.name, "n": search.point.n, "steps": search.point.steps,
                  "budget": args.budget, "runs": settings.runs},
        "law": {"predicted": choice.predicted, "interval": choice.interval, "natural": choice.natural,
                "uniform": choice.uniform, "loo_error": choice.loo_error, "best_proxy": choice.best_run},
        "check": {k: check[k] for k in ("measured", "predicted", "error")},
        "large": {"shape": point.shape.name, "n": point.n, "steps": point.steps, "budget": big_budget, "runs": large},
        "search_s": round(searched), "total_s": round(time.perf_counter() - started)}, indent=1))


if __name__ == "__main__":
    main()
