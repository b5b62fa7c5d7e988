"""Pipeline schedules measured against the planner's bubble: the same model and batch trained over
two pipeline ranks (gloo, one CPU core each) under each schedule train runs, at two micro-batch
counts m a step, each run's median step time beside plan/timing.py's model of it.

The model: a step takes (m + bubble) micro-batch times t of a rank (bubble_microbatches:
pp - 1 for GPipe and 1F1B, (pp - 1)/v interleaved, a third of that under interleaved zero
bubble, (pp - 1)/6 under ZB-V, (pp - 1)/3 under DualPipeV) plus a part c that does not depend
on the schedule (the optimizer step, the gradient norm, the loader). t and c are fitted to all
the runs by least squares; each run then gets its measured bubble, (step - c)/t - m, beside
the model's. What the model leaves out shows in the difference: the split backward's extra
autograd calls, more stages a rank (more sends, smaller matmuls), the runtime's own work per
action, how each schedule waits on its sends.

    python benchmarks/pipeline_schedules.py [--data DIR] [--steps 10] [--dim 256] [--layers 8]

Prints one JSON object. Each run is `scaletrain train ... --nproc 2` on real text (prepared
here from the built-in corpus unless --data is given), so the whole training step is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from scaletrain.plan.timing import bubble_microbatches  # noqa: E402

SCHEDULES = {"1f1b": 1, "gpipe": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zero_bubble": 2,
             "zbv_zero_bubble": 2, "dualpipev": 2}  # -> stages a rank


def run(schedule: str, microbatches: int, args: argparse.Namespace, data: Path, work: Path) -> list[float]:
    """Step seconds of each step after the first two (compilation-free, but the first steps warm up)."""
    name = f"{schedule}-{microbatches}"
    micro = 2
    command = [sys.executable, "-m", "scaletrain.cli", "train", str(ROOT / "configs" / "tiny.toml"),
               f"data.path={data}", f"run.dir={work}", f"run.name={name}", f"train.steps={args.steps}",
               f"model.n_layers={args.layers}", f"model.dim={args.dim}", "model.n_heads=4", "model.n_kv_heads=4",
               f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}", f"train.micro_batch={micro}",
               f"train.global_batch_tokens={microbatches * micro * args.seq_len}", "parallel.pp=2",
               f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={SCHEDULES[schedule]}",
               "eval.interval=0", "checkpoint.interval=0", "train.warmup_steps=1", "--nproc=2"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    return [r["step_s"] for r in records if r.get("kind") == "train" and r["step"] > 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None, help="a prepared data directory (vocabulary 512)")
    parser.add_argument("--steps", type=int, default=10, help="steps a run (the first two not timed)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--microbatches", default="4,8", help="two micro-batch counts a step (per pipeline)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args()
    counts = [int(m) for m in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    if len(counts) != 2 or counts[0] == counts[1]:
        raise SystemExit("--microbatches: give two different counts, e.g. 4,8")
    if not set(schedules) <= set(SCHEDULES):
        raise SystemExit(f"--schedules: name some of {', '.join(SCHEDULES)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = args.data
        if data is None:
            from scaletrain.data import prepare

            data = work / "data"
            prepare(["builtin:python-stdlib"], data, vocab_size=512, max_bytes=400_000, val_fraction=0.05, workers=1)
        measured = {(s, m): statistics.median(run(s, m, args, data, work)) for s in schedules for m in counts}
    # step = (m + bubble) x t + c, fitted over every run.
    pp = 2
    runs = [(s, m) for s in schedules for m in counts]
    t, c = np.polyfit([m + bubble_microbatches(s, pp, SCHEDULES[s]) for s, m in runs], [measured[r] for r in runs], 1)
    rows = {}
    for s in schedules:
        for m in counts:
            model = bubble_microbatches(s, pp, SCHEDULES[s])
            rows[f"{s} m={m}"] = {"step_s": round(measured[s, m], 4),
                                  "predicted_s": round(float((m + model) * t + c), 4),
                                  "bubble": round(float((measured[s, m] - c) / t - m), 3),
                                  "predicted_bubble": round(model, 3),
                                  **({"over_1f1b": round(measured[s, m] / measured["1f1b", m], 3)}
                                     if "1f1b" in schedules else {})}
    import torch

    print(json.dumps({"pp": pp, "microbatch_s": round(float(t), 4), "fixed_s": round(float(c), 4), "dim": args.dim,
                      "layers": args.layers, "seq_len": args.seq_len, "timed_steps": args.steps - 2,
                      "torch": torch.__version__, "schedules": rows}, indent=1))


if __name__ == "__main__":
    main()
