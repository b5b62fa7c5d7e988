"""One prepared pass on a GPU machine: scaletrain's training throughput on the configs of issue 6's
reference table, with real data through the real loader, metrics on and checkpoints (in the
background) at an interval; the table's references measured again in the same process as bare
loops (benchmarks/plain_loops.py: nanoGPT's GPT-2 recipe and a plain compiled Llama); whether
stop-and-resume is still exact on CUDA; then ablations of the means (compiled blocks, chunked
loss, background checkpoints, CUDA graphs, float8 where torchao and a Hopper-class GPU are
present, attention within documents, Muon) on the ~126M config. Prints one table and one JSON object
(also written to --out).

    PYTHONPATH=src python benchmarks/gpu_suite.py --out results.json [--only configs,baselines,resume,ablations]
    PYTHONPATH=src python benchmarks/gpu_suite.py --tiny      # the same code on a CPU, tiny shapes

Every figure comes from the trainer's own metrics.jsonl, logged every `--log-every` steps
(5: the host reads the loss only at the steps it logs, so logging every step would make the
GPU wait for the host after each one; the ablation "loss read every step" measures what that
costs): tokens/s is the global batch over the median step time of the timed logging windows
(after `--warmup` steps, which include compilation; `mean_tokens_per_s` is all their tokens
over all their time); MFU both ways (attention over the whole score matrix as nanoGPT and PaLM
count it, and causal: half of that term) with N the weights a token multiplies through
(model/flops.py: the embedding, a lookup, left out), and `mfu_6n` as issue 6's table counts it,
6 N + 12 L d T with N every parameter (an untied embedding included: 15% more FLOPs at
llama-126m, 5% at llama-1.1b, none at the tied gpt2-124m), which its goals are set in;
`cold_start_s`, the time from the call to train to the
host's end of its first step (config, model build, compilation, first batch; the ablations reuse
llama-126m's compiled blocks where their graphs are the same); peak memory; data wait as a
share of the step; the blocking time of the background checkpoints; and beside the peak, the
peak plan/memory.py predicts (parameters, gradients, optimizer, bf16 weight copies, activations,
loss) — CPUs report process RSS, not comparable.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from plain_loops import baselines
from scaletrain.config import load_config
from scaletrain.data import prepare
from scaletrain.model.flops import param_counts
from scaletrain.plan.hardware import device, peak_flops
from scaletrain.plan.memory import training_memory
from scaletrain.plan.timing import PlanLayout, step_time
from scaletrain.train.float8 import check_float8
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]

# name -> (model and batch overrides, the reference measured on one H200 with torch 2.11 + CUDA 13
# and bf16: tokens/s and MFU (6N + 12·L·d·T against 989 TFLOP/s), from issue 6).
CONFIGS = {
    "gpt2-124m": (["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.vocab_size=50304",
                   "model.tie_embeddings=true", "data.seq_len=1024", "train.micro_batch=16"],
                  {"what": "nanoGPT (torch.compile, fused AdamW)", "tokens_per_s": 489e3, "mfu": 0.423}),
    "llama-126m": (["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=4",
                    "model.vocab_size=32768", "data.seq_len=2048", "train.micro_batch=16"],
                   {"what": "plain Llama, SDPA, whole-model compile, fused AdamW", "tokens_per_s": 501e3,
                    "mfu": 0.497}),
    "llama-1.1b": (["model.dim=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=8",
                    "model.ffn_dim=8192", "model.vocab_size=32768", "data.seq_len=2048", "train.micro_batch=8"],
                   {"what": "plain Llama, SDPA, whole-model compile, fused AdamW", "tokens_per_s": 72.5e3,
                    "mfu": 0.546}),
}
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512",
        "data.seq_len=64", "train.micro_batch=4", "train.device=cpu", "train.compile=false"]
# What every timed run uses unless an ablation says otherwise: the means that should pay.
BEST = ["train.compile=true", "train.loss_chunk_tokens=8192", "checkpoint.async_save=true"]


def shape_of(name: str, tiny: bool) -> list[str]:
    """The named config's overrides; with --tiny, less its MLP width (TINY, given after the rest,
    sets the others)."""
    return [o for o in CONFIGS[name][0] if not (tiny and o.startswith("model.ffn_dim="))]


def sequence_and_batch(overrides: list[str]) -> tuple[int, int]:
    """The sequence length and micro-batch the overrides give (the last of each wins)."""
    given = dict(override.split("=", 1) for override in overrides)
    return int(given["data.seq_len"]), int(given["train.micro_batch"])


def issue_mfu(name: str, tokens_per_s: float, device_name: str) -> float | None:
    """MFU as issue 6's table counts it: tokens/s x (6 N + 12 L d T) over the device's dense bf16
    peak, N every parameter of the named config (None for a device of no known peak)."""
    peak = peak_flops(device_name, "bf16")
    if peak is None:
        return None
    seq, micro = sequence_and_batch(CONFIGS[name][0])
    model = load_config(None, [*CONFIGS[name][0], f"model.max_seq_len={seq}", "train.steps=1",
                               f"train.global_batch_tokens={seq * micro}"]).model
    return round(tokens_per_s * (6 * param_counts(model)["total"] + 12 * model.n_layers * model.dim * seq) / peak, 4)


def measure(data: Path, runs: Path, name: str, overrides: list[str], steps: int, warmup: int,
            checkpoint_every: int, log_every: int) -> dict:
    """Train `steps` steps of one global batch (= one micro-batch) and summarise the metrics."""
    base = [f"data.path={data}", f"run.dir={runs}", f"run.name={name}", f"train.steps={steps}",
            "train.warmup_steps=5", "train.lr=3e-4", f"log.interval={log_every}", "eval.interval=0",
            f"checkpoint.interval={checkpoint_every}", "checkpoint.keep=1"]
    # The sequence and micro-batch as the overrides give them (the last of each wins), so that the
    # one config loaded is whole: loaded without its max_seq_len and batch, a sequence of 2,048
    # would be refused (above the default max_seq_len) before anything was measured.
    seq, micro = sequence_and_batch(overrides)
    fresh()
    try:
        # (the evaluation at the end, which train runs whatever eval.interval: one batch)
        cfg = load_config(None, [*base, *overrides, f"train.global_batch_tokens={seq * micro}",
                                 f"model.max_seq_len={seq}", f"eval.tokens={seq * micro}"])
        called = time.time()
        train(cfg)
    except Exception as e:  # (one run's failure is a row of the table, not the end of the suite)
        what = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
        return {"error": f"{what}: {str(e)[:300]}"}
    finally:
        shutil.rmtree(runs / name / "checkpoints", ignore_errors=True)  # (1.1B: 13 GB each)
        fresh()
    predicted = training_memory(cfg.model, seq, micro, bf16=torch.cuda.is_available() and "train.device=cpu" not in overrides,
                                recompute=cfg.parallel.recompute, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                                optimizer=cfg.train.optimizer)
    predicted_speed = None  # the planner's step-time model for this GPU, beside what was measured
    if torch.cuda.is_available() and "train.device=cpu" not in overrides:
        try:
            spec = device(torch.cuda.get_device_name())
        except ValueError:
            spec = None
        if spec is not None:
            layout = PlanLayout(micro_batch=micro, recompute=cfg.parallel.recompute,
                                loss_chunk_tokens=cfg.train.loss_chunk_tokens)
            predicted_speed = round(step_time(cfg.model, seq, micro, layout, spec).tokens_per_s)
    records = read_metrics(runs / name)
    first = next(r for r in records if r["kind"] == "memory")  # written once the first step is done
    steps_done = [r for r in records if r["kind"] == "train"]
    # Each train record covers the steps since the one before it (its window); time those after warmup.
    windows = [(r, r["step"] - before) for r, before in zip(steps_done, [0] + [r["step"] for r in steps_done])]
    timed = [(r, size) for r, size in windows if r["step"] > warmup]
    if not timed:  # (stopped early: by a signal, or a run that ended before its warmup did)
        return {"error": f"no step after the {warmup} of warm-up was logged ({len(steps_done)} records)"}
    step_s = statistics.median(cfg.train.global_batch_tokens / r["tokens_per_s"] for r, _ in timed)
    tokens_per_s = cfg.train.global_batch_tokens / step_s
    blocking = [r["blocking_s"] for r in records if r["kind"] == "checkpoint"]
    last = timed[-1][0]
    mfu_scale = (last["mfu"] / last["tokens_per_s"]) if last["mfu"] is not None else None
    causal_scale = (last["mfu_causal"] / last["tokens_per_s"]) if last["mfu"] is not None else None
    timed_steps = sum(size for _, size in timed)
    return {
        "tokens_per_step": cfg.train.global_batch_tokens, "steps": steps, "timed_steps": timed_steps,
        "log_every": cfg.log.interval, "step_ms": round(1000 * step_s, 2), "tokens_per_s": round(tokens_per_s),
        "mean_tokens_per_s": round(timed_steps * cfg.train.global_batch_tokens
                                   / sum(size * cfg.train.global_batch_tokens / r["tokens_per_s"] for r, size in timed)),
        "mfu": None if mfu_scale is None else round(tokens_per_s * mfu_scale, 4),
        "mfu_causal": None if causal_scale is None else round(tokens_per_s * causal_scale, 4),
        "cold_start_s": round(first["time"] - called, 1),
        "peak_mem_gb": max(r["mem_gb"] for r in steps_done), "predicted_peak_gb": round(predicted.peak / 1e9, 3),
        "predicted_memory": predicted.as_dict(), "predicted_tokens_per_s": predicted_speed,
        "data_wait_share": round(statistics.median(r["data_wait_ms"] for r, _ in timed) / (1000 * step_s), 5),
        "checkpoint_blocking_s": blocking, "final_loss": last["loss"],
    }


def fresh() -> None:
    """Release the last trainer's memory before the next run is measured."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def static_compiles() -> None:
    """One compile cache serves every run of this process: each config's blocks compile for their
    own static shapes (by default the second config's would be taken for changed shapes and the
    rest compiled for dynamic ones, measured slower, in an order-dependent way), and the ablations
    of llama-126m reuse its compiled blocks where their graphs are the same, with room for every
    run's entries (by default 8 before falling back to eager)."""
    config = torch._dynamo.config
    config.automatic_dynamic_shapes = False
    for name in ("recompile_limit", "cache_size_limit"):  # (the older name, should this torch have only it)
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))


def resume_exactness(data: Path, runs: Path, device: list[str]) -> dict:
    """Steps 5-8 of a run stopped at step 4 and resumed, against the same run never stopped — and
    that run trained twice: on a GPU, kernels that add in a varying order (attention's backward,
    atomics) can make two identical runs differ, and then a resumed one can differ as much."""
    common = [f"data.path={data}", f"run.dir={runs}", "train.steps=8", "eval.interval=4", "checkpoint.interval=0",
              *device]
    tiny = ROOT / "configs" / "tiny.toml"
    train(load_config(tiny, [*common, "run.name=whole"]))
    train(load_config(tiny, [*common, "run.name=again"]))
    train(load_config(tiny, [*common, "run.name=split"]), stop_at_step=4)
    train(load_config(tiny, [*common, "run.name=split"]))
    whole, again, split = ({r["step"]: r["loss"] for r in read_metrics(runs / name, "train")}
                           for name in ("whole", "again", "split"))
    diffs = [abs(whole[s] - split[s]) for s in range(5, 9)]
    repeat = [abs(whole[s] - again[s]) for s in range(1, 9)]
    return {"max_abs_loss_diff_after_resume": max(diffs), "bit_exact": max(diffs) == 0.0,
            "max_abs_loss_diff_run_twice": max(repeat), "repeatable": max(repeat) == 0.0}


def _float8_unavailable() -> str | None:
    """Why train.float8 cannot run here (the trainer's own check: GPU, layout, torchao), or None."""
    if not torch.cuda.is_available():
        return "no GPU"
    try:
        check_float8(torch.device("cuda"), tp=1)
    except Exception as e:  # (a refusal, or a torchao built for another torch that fails to import)
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


class Budget:
    """The suite's seconds (issue 6: within 8 minutes, compilation included): a row starts only
    while the time left is more than the longest row of its section took so far (and than the
    section's expected row), and a row not started says so; the report ends with the table either
    way, rather than at a timeout."""

    def __init__(self, seconds: float, clock=time.perf_counter, expected: dict[str, float] | None = None):
        """expected: the least a row of a section is taken to need (its longest on a GPU, compilation
        included), so that none starts with seconds left, before the longest has been timed too."""
        self.seconds, self.clock = seconds, clock
        self.end = clock() + seconds
        self.expected = dict(expected or {})
        self.longest: dict[str, float] = {}
        self.running: str | None = None  # the section of the row running now

    def refusal(self, section: str) -> str | None:
        """Why a row of `section` is not started now, or None if it is."""
        left = self.end - self.clock()
        took, expected = self.longest.get(section, 0.0), self.expected.get(section, 0.0)
        if left > max(took, expected):
            return None
        if left <= 0:
            return f"not run: the suite's {self.seconds:.0f} s were spent (--budget-s)"
        if took < expected:
            return (f"not run: {left:.0f} s of the suite's {self.seconds:.0f} left, less than one {section} row is "
                    f"expected to take ({expected:.0f} s)")
        return (f"not run: {left:.0f} s of the suite's {self.seconds:.0f} left, less than the longest {section} row "
                f"took ({took:.0f} s)")

    def row(self, section: str, run):
        """run() timed as a row of `section`."""
        started, self.running = self.clock(), section
        try:
            return run()
        finally:
            self.longest[section] = max(self.longest.get(section, 0.0), self.clock() - started)
            self.running = None


def table(report: dict) -> str:
    lines = [f"{'run':<38} {'tokens/s':>10} {'step ms':>9} {'MFU':>7} {'MFU causal':>10} {'MFU 6N':>7} {'peak GB':>8} "
             f"{'planned':>8} {'data wait':>9} {'ckpt block s':>13} {'cold start s':>12}  against the same-run plain "
             "loop; issue 6's reference"]
    plain = report.get("baselines", {})
    rows = {**report.get("configs", {}), **{f"plain loop: {name}": row for name, row in plain.items()},
            **report.get("ablations", {})}

    def figure(value, form: str, width: int) -> str:
        return f"{'-' if value is None else format(value, form):>{width}}"

    for name, row in rows.items():
        if "error" in row:
            lines.append(f"{name:<38} {row['error']}")
            continue
        ref, same = row.get("reference"), plain.get(name, {})
        # (means both: the loop's clock spans its timed steps; a config's median window leaves out the checkpoint's)
        against = (f"x{row['mean_tokens_per_s'] / same['mean_tokens_per_s']:.2f}; " if "mean_tokens_per_s" in same
                   else "") + (
            f"{ref['tokens_per_s']:,.0f} tok/s, {ref['mfu']:.1%}: x{row['tokens_per_s'] / ref['tokens_per_s']:.2f}"
            if ref else "")
        block = ",".join(f"{b:.2f}" for b in row.get("checkpoint_blocking_s", [])) or "-"
        lines.append(f"{name:<38} {row['tokens_per_s']:>10,} {row['step_ms']:>9.1f} {figure(row['mfu'], '.1%', 7)} "
                     f"{figure(row['mfu_causal'], '.1%', 10)} {figure(row.get('mfu_6n'), '.1%', 7)} "
                     f"{figure(row['peak_mem_gb'], '.1f', 8)} "
                     f"{figure(row.get('predicted_peak_gb'), '.1f', 8)} {figure(row.get('data_wait_share'), '.2%', 9)} "
                     f"{block:>13} {row['cold_start_s']:>12.1f}  {against}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default="configs,baselines,resume,ablations",
                        help="comma-separated sections to run, in this order")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of the configs to run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed (compilation happens in them)")
    parser.add_argument("--log-every", type=int, default=5, help="steps per metrics record: the host reads the "
                        "loss only then (a divisor of --warmup and --steps, so that the timed windows are whole)")
    parser.add_argument("--work", default=None, help="directory for the data and the runs (default: a new temporary one)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the suite, measures nothing")
    parser.add_argument("--budget-s", type=float, default=450, help="seconds for the whole suite, data included: rows "
                        "that would not end in time are left out, said so in their place (450: within the 480 s "
                        "gpu_session.sh gives it)")
    args = parser.parse_args()
    if args.warmup % args.log_every or args.steps % args.log_every or args.steps <= args.warmup:
        parser.error(f"--log-every {args.log_every} must divide --warmup {args.warmup} and --steps {args.steps}, "
                     "and --steps exceed --warmup, so that the timed steps are whole logging windows")
    sections = set(args.only.split(","))
    static_compiles()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp())
    data = work / "data"
    # The least a section's row is taken to need on a GPU, compilation included: the 1.1B config's
    # (the longest, after two small ones), its plain loop's whole-model compile, the resume check's
    # three short runs, an ablation of the 126M config.
    budget = Budget(args.budget_s, expected=None if args.tiny else {"config": 90, "baseline": 60, "resume": 45,
                                                                      "ablation": 30})
    t0 = time.perf_counter()
    prepare(["builtin:python-stdlib"], data, vocab_size=512 if args.tiny else 32768,
            max_bytes=2_000_000 if args.tiny else 40_000_000)
    report: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
                    "torch": torch.__version__, "python": platform.python_version(),
                    "prepare_s": round(time.perf_counter() - t0, 1)}
    runs = work / "runs"
    # A checkpoint two thirds of the way: realistic runs save every ~30 min, this measures one save.
    every = max(1, (2 * args.steps) // 3)

    def keep() -> None:  # what is measured so far, should the device's time run out before the end
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    def with_issue_mfu(row: dict, name: str) -> dict:
        return row if "error" in row else {**row, "mfu_6n": issue_mfu(name, row["tokens_per_s"], report["device"])}

    try:  # (a SIGINT, gpu_session.sh's timeout, ends the sections: the table is printed all the same)
        if "configs" in sections:
            report["configs"] = {}
            for name in args.configs.split(","):
                overrides = [*shape_of(name, args.tiny), *BEST, *(TINY if args.tiny else [])]
                if (late := budget.refusal("config")) is not None:
                    report["configs"][name] = {"error": late}
                    continue
                row = budget.row("config", lambda: measure(data, runs, name, overrides, args.steps, args.warmup, every,
                                                           args.log_every))
                report["configs"][name] = {**with_issue_mfu(row, name), "settings": BEST,
                                           "reference": None if args.tiny else CONFIGS[name][1]}
                keep()
        if "baselines" in sections:  # the references, measured here: the same device, torch and day
            report["baselines"] = {}
            for name in args.configs.split(","):  # (each kept as it ends, should the device's time run out)
                if (late := budget.refusal("baseline")) is not None:
                    report["baselines"][name] = {"error": late}
                    continue
                rows = budget.row("baseline", lambda: baselines([name], args.steps, args.warmup, args.tiny))
                report["baselines"].update({name: with_issue_mfu(row, name) for name, row in rows.items()})
                keep()
        if "resume" in sections:
            try:
                report["resume"] = ({"error": late} if (late := budget.refusal("resume")) is not None else
                                    resume_exactness(data, runs, ["train.device=cpu"] if args.tiny else []))
            except Exception as e:
                report["resume"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            keep()
        if "ablations" in sections:
            shape = shape_of("llama-126m", args.tiny)
            # float8 first, should the device's time run out; then those that reuse llama-126m's
            # compiled blocks, then CUDA graphs (which drop every compiled graph after them), then those
            # that compile their own or none.
            report["ablations"] = {}
            float8 = None if args.tiny else _float8_unavailable()
            if float8 is None and not args.tiny:
                variants = {"float8": ["train.float8=true"]}
            else:
                variants = {}
                if not args.tiny:
                    report["ablations"]["llama-126m, float8"] = {"error": f"not run: {float8}"}
            variants.update({"synchronous checkpoint": ["checkpoint.async_save=false"],
                             "loss read every step": ["log.interval=1"], "whole-batch loss": ["train.loss_chunk_tokens=0"],
                             "Muon": ["train.optimizer=muon"]})
            if not args.tiny:  # (tiny runs are not compiled: inductor on a CPU takes minutes)
                variants["CUDA graphs"] = ["train.compile_mode=reduce-overhead"]
            variants.update({"attention within documents": ["model.document_mask=true"],
                             "attention within documents, FlexAttention": ["model.document_mask=true",
                                                                           "model.attention_kernel=flex"],
                             "eager": ["train.compile=false"]})
            for what, change in variants.items():
                overrides = [*shape, *BEST, *change, *(TINY if args.tiny else [])]
                if (late := budget.refusal("ablation")) is not None:
                    report["ablations"][f"llama-126m, {what}"] = {"error": late}
                    continue
                row = budget.row("ablation", lambda: measure(data, runs, f"ablation-{what.replace(' ', '-')}", overrides,
                                                             args.steps, args.warmup, every, args.log_every))
                report["ablations"][f"llama-126m, {what}"] = {**with_issue_mfu(row, "llama-126m"),
                                                              "settings": [*BEST, *change]}
                if what == "CUDA graphs":
                    torch._dynamo.reset()  # (and its graphs' memory pool, which the next run's peak would count)
                keep()
    except KeyboardInterrupt:
        report["interrupted"] = (f"SIGINT after {time.perf_counter() - t0:.0f} s, in a {budget.running or 'suite'} row: "
                                 "it and the rows after it were not run")
        print(report["interrupted"])
    report["suite_s"] = round(time.perf_counter() - t0, 1)
    print(table(report))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
