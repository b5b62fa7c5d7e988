"""Several runs side by side: the ablation's question — which of these trained best, and at what
cost? `compare_runs` reads each run directory (config.toml, metrics.jsonl) and draws their train
and validation losses on one plot against tokens, training FLOPs or wall-clock, and returns a
row per run for a table: the final and best validation loss, the FLOPs it took, the median speed
and the goodput (report/goodput.py).

Against FLOPs the runs are compared at equal compute: what a change that costs compute per token
(multi-token prediction, a wider model) must win by. FLOPs are the run's FLOPs per token
(model/flops.py, as training counts them) times the tokens trained.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from scaletrain.config import ConfigError  # noqa: E402
from scaletrain.model.flops import param_counts, train_flops_per_token  # noqa: E402
from scaletrain.report.goodput import account, working_clock  # noqa: E402
from scaletrain.report.run import reached, read_run, steady_steps  # noqa: E402

AXES = {"tokens": "tokens", "flops": "training FLOPs", "hours": "wall-clock (hours)"}


def compare_runs(run_dirs: list[str | Path], out: str | Path, x: str = "tokens") -> list[dict]:
    """A row per run (name, parameters, step, tokens, flops, final train and validation loss, best
    validation loss, the final validation loss by source, median tokens/s, goodput), and their
    losses against `x` ("tokens", "flops" or "hours") drawn into the PNG `out`. (A run's
    validation loss weighs its sources by its own data.mix: runs on other mixtures compare by
    source.)"""
    if x not in AXES:
        raise ConfigError(f"cannot compare runs against {x!r}; choose one of {', '.join(AXES)}")
    if len(run_dirs) < 2:
        raise ConfigError("give two run directories or more to compare (`scaletrain report RUN_DIR` reports one)")
    runs = [_read(Path(run_dir)) for run_dir in run_dirs]
    names = _names([run["dir"] for run in runs])
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, run) in enumerate(zip(names, runs)):
        run["name"] = name
        position = _position(run, x)
        train_ax.plot([position(r) for r in run["train"]], [r["loss"] for r in run["train"]], color=f"C{i}", lw=1,
                      label=name)
        val_ax.plot([position(r) for r in run["evals"]], [r["loss"] for r in run["evals"]], "o-", ms=3,
                    color=f"C{i}", lw=1, label=name)
    for ax, title in ((train_ax, "train loss"), (val_ax, "validation loss")):
        ax.set(xlabel=AXES[x], ylabel="loss (nats per token)", title=title)
        if x != "hours":
            ax.set_xscale("log")
    val_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [{key: run[key] for key in ("name", "dir", "parameters", "step", "total_steps", "tokens", "flops",
                                       "train_loss", "val_loss", "best_val_loss", "val_loss_by_source",
                                       "tokens_per_s", "goodput")}
            for run in runs]


def _read(run_dir: Path) -> dict:
    cfg, records, every = read_run(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        raise ConfigError(f"{str(run_dir)!r} has no training steps recorded yet; compare runs that have trained")
    per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)  # (as training counts them)
    step, tokens = reached(records).values()
    time = account(every, records)
    return {"dir": str(run_dir), "parameters": param_counts(cfg.model)["total"], "step": step,
            "total_steps": cfg.total_steps, "tokens": tokens, "flops": per_token * tokens, "per_token": per_token,
            "train_loss": train[-1]["loss"], "val_loss": evals[-1]["loss"] if evals else None,
            "best_val_loss": min((r["loss"] for r in evals), default=None),
            "val_loss_by_source": evals[-1].get("loss_by_source") if evals else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady_steps(cfg, train)),
            "goodput": time["goodput"] if time else None, "train": train, "evals": evals,
            "clock": working_clock(every)}


def _position(run: dict, x: str):
    """Where a record of `run` lies on the x axis."""
    if x == "tokens":
        return lambda r: r["tokens"]
    if x == "flops":
        return lambda r: r["tokens"] * run["per_token"]
    return lambda r: run["clock"](r["time"]) / 3600  # (its pauses left out, as report's wall-clock)


def _names(dirs: list[str]) -> list[str]:
    """Each run's directory name, or its whole path where two share a name."""
    short = [Path(d).name for d in dirs]
    return [s if short.count(s) == 1 else d for s, d in zip(short, dirs)]
