"""One prepared pass on a GPU machine: training throughput and MFU of the ~125M config, eager and
compiled; of the ~1B config (configs/llama-1b.toml) with each activation-recomputation choice,
eager and compiled; and whether stop-and-resume is still exact on CUDA. Prints one JSON object.

    PYTHONPATH=src python benchmarks/gpu_suite.py --out results.json [--steps 30] [--only gpt125m,llama1b,resume]

The throughput comes from the trainer's own metrics.jsonl (tokens/s over the last logging
window, MFU against plan/hardware.py's peak), so it measures what users run, data loading,
bf16 autocast and fused AdamW included.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.data import prepare
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def throughput(data: Path, runs: Path, name: str, steps: int, *overrides: str) -> dict:
    cfg = load_config(ROOT / "configs" / "gpt-125m.toml", [
        f"data.path={data}", f"run.dir={runs}", f"run.name={name}", f"train.steps={steps}",
        "train.warmup_steps=10", "data.seq_len=1024", "model.max_seq_len=1024",
        "train.global_batch_tokens=131072", "train.micro_batch=32", "log.interval=10",
        "eval.interval=0", "checkpoint.interval=0", *overrides])
    start = time.perf_counter()
    result = train(cfg)
    records = read_metrics(runs / name, "train")
    last = records[-1]
    return {"steps": steps, "wall_s": round(time.perf_counter() - start, 1), "final_loss": result.train_loss,
            "tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"], "mem_gb": last["mem_gb"],
            "data_wait_ms": last["data_wait_ms"]}


def llama_1b(data: Path, runs: Path, steps: int, recompute: str, compile_blocks: bool) -> dict:
    """configs/llama-1b.toml on one device: 4 sequences of 4096 per micro-batch, 2 micro-batches a step."""
    name = f"llama1b-{recompute}-{'compiled' if compile_blocks else 'eager'}"
    cfg = load_config(ROOT / "configs" / "llama-1b.toml", [
        f"data.path={data}", f"run.dir={runs}", f"run.name={name}", f"train.steps={steps}",
        "train.warmup_steps=5", "train.global_batch_tokens=32768", "log.interval=5", "eval.interval=0",
        "checkpoint.interval=0", f"parallel.recompute={recompute}", f"train.compile={str(compile_blocks).lower()}"])
    start = time.perf_counter()
    try:
        train(cfg)
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"recompute": recompute, "compile": compile_blocks, "error": f"out of memory: {str(e)[:200]}"}
    last = read_metrics(runs / name, "train")[-1]
    torch.cuda.empty_cache()
    return {"recompute": recompute, "compile": compile_blocks, "steps": steps,
            "wall_s": round(time.perf_counter() - start, 1), "tokens_per_s": last["tokens_per_s"],
            "mfu": last["mfu"], "mem_gb": last["mem_gb"]}


def resume_exactness(data: Path, runs: Path) -> dict:
    common = [f"data.path={data}", f"run.dir={runs}", "train.steps=8", "eval.interval=4", "checkpoint.interval=0"]
    tiny = ROOT / "configs" / "tiny.toml"
    train(load_config(tiny, [*common, "run.name=whole"]))
    train(load_config(tiny, [*common, "run.name=split"]), stop_at_step=4)
    train(load_config(tiny, [*common, "run.name=split"]))
    whole = {r["step"]: r["loss"] for r in read_metrics(runs / "whole", "train")}
    split = {r["step"]: r["loss"] for r in read_metrics(runs / "split", "train")}
    diffs = [abs(whole[s] - split[s]) for s in range(5, 9)]
    return {"max_abs_loss_diff_after_resume": max(diffs), "bit_exact": max(diffs) == 0.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", default="gpt125m,llama1b,resume", help="comma-separated sections to run")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    work = Path(tempfile.mkdtemp())
    data = work / "data"
    t0 = time.perf_counter()
    prepare(["builtin:python-stdlib"], data, vocab_size=32768, max_bytes=40_000_000)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "prepare_s": round(time.perf_counter() - t0, 1)}
    if "gpt125m" in sections:
        report["gpt125m_eager"] = throughput(data, work / "runs", "eager", args.steps, "train.compile=false")
        report["gpt125m_compiled"] = throughput(data, work / "runs", "compiled", args.steps, "train.compile=true")
    if "llama1b" in sections:
        report["llama1b"] = [llama_1b(data, work / "runs", 20, recompute, compile_blocks)
                             for compile_blocks in (False, True) for recompute in ("none", "selective", "full")]
    if "resume" in sections:
        report["resume"] = resume_exactness(data, work / "runs")
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
