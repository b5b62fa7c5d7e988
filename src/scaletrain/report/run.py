"""A run's report: what it reached, how fast, what happened on the way, and — given a scaling law
— how the loss it reached compares with the law's prediction; given the plan the run was
written from, how its speed and memory compare with the planner's. `run_report` reads a run
directory (config.toml, metrics.jsonl) and writes loss.png, speed.png and a self-contained
report.html (the plots inlined) into it; it returns the summary the CLI prints.

The law's prediction is L(N, D) of approach 3 for this model's N (all parameters, as the sweep
counts them; not multi-token prediction's modules, which the model leaves behind) at the tokens the run trains for, with the 95% interval of the law's bootstrap
refits. It predicts the final loss of a run whose learning rate has decayed, so the curve drawn
along the run (L(N, D) at each D reached) bounds the loss of a finished run of that length, not
the loss mid-way through a longer one.
"""

from __future__ import annotations

import base64
import html
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from scaletrain.config import ConfigError, load_config  # noqa: E402
from scaletrain.cooldown import branches_of  # noqa: E402
from scaletrain.model.flops import param_counts  # noqa: E402
from scaletrain.plan.planner import PLANNED, against_plan  # noqa: E402
from scaletrain.report.goodput import PARTS, account, wall_line  # noqa: E402
from scaletrain.scaling.fit import bootstrap_laws, interval, law_of  # noqa: E402
from scaletrain.scaling.laws import ChinchillaLaw  # noqa: E402
from scaletrain.scaling.optimal import expected_loss  # noqa: E402
from scaletrain.train.metrics import read_metrics  # noqa: E402

# Events worth a line in the report, with what each record says beyond its step.
EVENTS = {"start": (), "resume": (), "checkpoint": ("blocking_s",), "rewind": ("cause", "diverged_at", "skipped_steps"),
          "spike": ("loss", "mean", "std"), "hang": ("seconds", "rank"), "diverged": ("message",),
          "end": ("complete", "stopped_by")}


def run_report(run_dir: str | Path, law_doc: dict | None = None, plan_doc: dict | None = None) -> dict:
    """Summarise the run in `run_dir` (against `law_doc`, a law.json document, and `plan_doc`, the
    plan `scaletrain plan` wrote for it, if given), write loss.png, speed.png and report.html
    there; returns the summary."""
    run_dir = Path(run_dir)
    cfg, records, every = read_run(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    counts = param_counts(cfg.model)
    n = counts["total"]
    # The law's N: the model's parameters, as the sweep counts them — without the modules of
    # multi-token prediction, which training runs and the model leaves behind.
    n_law = n - counts["mtp"]
    planned_tokens = cfg.total_tokens
    later = train[1:] or train  # the first step includes start-up
    steady = steady_steps(cfg, train)
    summary = {
        "run": str(run_dir), "parameters": n, **reached(records), "total_steps": cfg.total_steps,
        "planned_tokens": planned_tokens,
        "train_loss": train[-1]["loss"] if train else None, "val_loss": evals[-1]["loss"] if evals else None,
        "val_bits_per_byte": evals[-1].get("bits_per_byte") if evals else None,
        # data.mix: each source's validation loss, comparable between runs on other mixtures
        "val_loss_by_source": evals[-1].get("loss_by_source") if evals and len(evals[-1].get("loss_by_source") or {}) > 1
        else None,
        "val_ema_loss": evals[-1].get("ema_loss") if evals else None,  # (train.ema_decay's average)
        "heldout_loss": evals[-1].get("heldout_loss") if evals else None,  # (eval.data's sets)
        "tokens_per_s": _median(r["tokens_per_s"] for r in steady),
        "mfu": _median(r.get("mfu") for r in steady),
        "data_wait_share": _median(r["data_wait_ms"] * r["tokens_per_s"] / cfg.step_batch_tokens(r["step"] - 1) / 1000
                                   for r in later if r.get("data_wait_ms") is not None),
        "peak_memory_gb": max((r.get("mem_gb") or 0 for r in train), default=None),
        "noise": _noise(cfg, train),
        # eval.tasks at the last evaluation: task -> accuracy, accuracy_norm, nll.
        "tasks": {name: {key: evals[-1][f"task_{key}"][name] for key in ("accuracy", "accuracy_norm", "nll")}
                  for name in (evals[-1].get("task_accuracy") or {})} if evals else {},
        "checkpoint_blocking_s": _median(r.get("blocking_s") for r in every if r["kind"] == "checkpoint"),
        # Where the wall-clock went, over every invocation (report/goodput.py).
        "time": account(every, records),
        # Every event that happened, also those of steps a resume or rewind went back over.
        "events": _events(every),
    }
    law = prediction = None
    if plan_doc is not None:
        # (On a CPU the peak is the process's resident memory, torch's runtime with it: not the tensors
        # the plan predicts, so not set against them.)
        on_cpu = any(r["kind"] == "start" and str(r.get("device", "")).startswith("cpu") for r in every)
        summary["plan"] = against_plan(plan_doc, n, {**summary, "peak_memory_gb": None} if on_cpu else summary)
    if law_doc is not None or (plan_doc or {}).get("predicted_loss"):
        if law_doc is not None:
            law, boot = law_of(law_doc), bootstrap_laws(law_doc)
        else:  # the law the plan sized with; its interval when the run trains the plan's tokens
            law, boot = ChinchillaLaw(**plan_doc["sizing"]["law"]), []
        # (as the plan predicted: with its repeated epochs where it was sized for --unique-tokens)
        unique = ((plan_doc or {}).get("sizing") or {}).get("unique_tokens")
        predicted = expected_loss(law, n_law, planned_tokens, unique)
        prediction = {"loss": predicted, "n": n_law, "tokens": planned_tokens,
                      **({"unique_tokens": unique} if unique else {})}
        if boot:
            prediction["interval"] = list(interval([expected_loss(sample, n_law, planned_tokens, unique)
                                                    for sample in boot]))
        elif law_doc is None and plan_doc["tokens"] == planned_tokens and "interval" in plan_doc["predicted_loss"]:
            prediction["interval"] = plan_doc["predicted_loss"]["interval"]
        if summary["val_loss"] is not None and summary["step"] == cfg.total_steps:
            prediction["error"] = (summary["val_loss"] - predicted) / predicted
        prediction["other_data"] = other_data((law_doc or {}).get("data"), cfg.data.path, cfg.data.mix)
        summary["prediction"] = prediction
    # The annealed losses of the run's cooldown branches (scaletrain cooldown), against the law's
    # L(N, D) at their tokens: the law predicts annealed losses, which the plateau is not.
    summary["branches"] = _branches(run_dir, law, n_law, (prediction or {}).get("unique_tokens"))
    planned_speed = plan_doc["step"]["tokens_per_s"] if plan_doc is not None else None
    plots = [_loss_plot(run_dir / "loss.png", train, evals, law, prediction, summary["branches"]),
             _speed_plot(run_dir / "speed.png", train, planned_speed),
             _tasks_plot(run_dir / "tasks.png", evals),
             _noise_plot(run_dir / "batch.png", cfg, train),
             _progress_plot(run_dir / "progress.png", summary["time"], cfg.total_steps, plan_doc),
             _norms_plot(run_dir / "norms.png", train)]
    (run_dir / "report.html").write_text(_html(cfg, summary, [p for p in plots if p is not None]))
    summary["files"] = [str(p) for p in plots if p is not None] + [str(run_dir / "report.html")]
    return summary


def other_data(law_data: dict | None, path: str, mix: dict[str, float] | None) -> str | None:
    """What is said when a law (law.json's "data": the path and mix of the sweep it was fitted
    to) was measured on other data than the run trains on — another corpus or another mixture
    of it has another law — else None (also when the law does not say)."""
    if not law_data:
        return None
    swept_mix, mix = law_data.get("mix") or None, mix or None
    same_mix = (swept_mix is None) == (mix is None) and (mix is None or (
        set(mix) == set(swept_mix) and all(abs(mix[k] / sum(mix.values()) - swept_mix[k] / sum(swept_mix.values()))
                                           < 1e-3 for k in mix)))
    if Path(law_data["path"]).resolve() == Path(path).resolve() and same_mix:
        return None

    def said(where, shares):
        return f"{where}" + (f" (mix {', '.join(f'{k} {v:g}' for k, v in shares.items())})" if shares else "")

    return (f"the law was measured on {said(law_data['path'], swept_mix)}, this run trains on "
            f"{said(path, mix)}: its prediction is of other data")


def _events(every: list[dict]) -> list[dict]:
    """The records of EVENTS, in order, with what each says beyond its step. Each rank whose
    watchdog fired records a hang: those of one invocation and step are one event, the longest
    silence, with `ranks` (sorted; None where the records name none, as those before ranks did)."""
    events, hangs, invocation = [], {}, 0
    for r in every:
        invocation += r["kind"] in ("start", "resume")  # (each invocation after the first resumes)
        if r["kind"] not in EVENTS:
            continue
        event = {"kind": r["kind"], "step": r["step"], **{k: r.get(k) for k in EVENTS[r["kind"]]}}
        if r["kind"] == "hang":
            rank = event.pop("rank")
            first = hangs.setdefault((invocation, r["step"]), event)
            first["ranks"] = sorted(set(first.get("ranks") or ()) | ({rank} if rank is not None else set())) or None
            if first is not event:
                first["seconds"] = max(first["seconds"] or 0, event["seconds"] or 0)
                continue
        events.append(event)
    return events


def read_run(run_dir: Path):
    """A run directory's config, its records (read_metrics) and all of them, superseded ones too
    (what a resume or rewind went back over); ConfigError when it is not a run that has trained."""
    if not (run_dir / "config.toml").is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory that has trained (no config.toml and "
                          "metrics.jsonl); give the directory `scaletrain train` wrote, e.g. runs/demo")
    return load_config(run_dir / "config.toml"), read_metrics(run_dir), read_metrics(run_dir, superseded=True)


def reached(records: list[dict]) -> dict:
    """The step and tokens a run's records reach: of its updates, not of the one a divergence
    stopped (the diverged record's step, which was never applied)."""
    applied = [r for r in records if r["kind"] != "diverged"]
    return {"step": max((r["step"] for r in applied), default=0), "tokens": max((r["tokens"] for r in applied), default=0)}


def steady_steps(cfg, train: list[dict]) -> list[dict]:
    """The train records whose speed counts: past the first (which includes start-up), of the
    global batch (past train.batch_ramp's), which the plan's step predicts."""
    later = train[1:] or train
    return [r for r in later if cfg.step_batch_tokens(r["step"] - 1) == cfg.train.global_batch_tokens] or later


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _measured_noise(train: list[dict]) -> list[dict]:
    """The train records that carry a gradient noise scale (train/noise.py)."""
    return [r for r in train if (r.get("noise_scale") or 0) > 0]


def _noise(cfg, train: list[dict]) -> dict | None:
    """The gradient noise scale of the last record that has one, against the batch of its step:
    how many times the fewest steps and the fewest tokens that batch costs if the noise scale is
    the critical batch (McCandlish et al. 2018, eq. 2.11)."""
    measured = _measured_noise(train)
    if not measured:
        return None
    last = measured[-1]
    scale, batch = last["noise_scale"], cfg.step_batch_tokens(last["step"] - 1)
    return {"noise_scale": scale, "step": last["step"], "batch_tokens": batch,
            "steps_factor": 1 + scale / batch, "tokens_factor": 1 + batch / scale}


def _noise_plot(path: Path, cfg, train: list[dict]) -> Path | None:
    measured = _measured_noise(train)
    if len(measured) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    tokens = [r["tokens"] for r in measured]
    ax.plot(tokens, [r["noise_scale"] for r in measured], color="C0", lw=1, label="gradient noise scale B_simple")
    ax.step(tokens, [cfg.step_batch_tokens(r["step"] - 1) for r in measured], where="post", color="C2", lw=1,
            ls="--", label="batch")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="tokens", title="batch against the noise scale")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _branches(run_dir: Path, law, n: int, unique_tokens: float | None = None) -> list[dict]:
    """Each cooldown branch of the run: its step and length, and once it has finished its final
    validation loss and tokens, with the law's prediction there (of repeated epochs under a limit
    of `unique_tokens`) and the error against it."""
    rows = []
    for branch in branches_of(run_dir):
        records = read_metrics(branch["run_dir"]) if (branch["run_dir"] / "metrics.jsonl").is_file() else []
        end = branch["step"] + branch["steps"]
        final = next((r for r in reversed(records) if r["kind"] == "eval" and r["step"] == end), None)
        row = {"run": branch["run_dir"].name, "step": branch["step"], "steps": branch["steps"],
               "tokens": final["tokens"] if final else None, "val_loss": final["loss"] if final else None}
        if law is not None and final is not None:
            row["predicted"] = expected_loss(law, n, final["tokens"], unique_tokens)
            row["error"] = (final["loss"] - row["predicted"]) / row["predicted"]
        rows.append(row)
    return rows


def branch_line(branch: dict) -> str:
    """The report's line on a cooldown branch."""
    if branch["val_loss"] is None:
        return f"{branch['steps']:,} steps, not finished"
    law = (f" (law {branch['predicted']:.4f}, {branch['error']:+.2%})" if "predicted" in branch else "")
    return f"{branch['val_loss']:.4f} at {branch['tokens']:,} tokens{law}"


def _loss_plot(path: Path, train: list[dict], evals: list[dict], law, prediction: dict | None,
               branches: list[dict] = ()) -> Path | None:
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], lw=1, color="C0", label="train loss")
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["loss"] for r in evals], "o-", ms=4, color="C1",
                label="validation loss")
        averaged = [r for r in evals if "ema_loss" in r]
        if averaged:
            ax.plot([r["tokens"] for r in averaged], [r["ema_loss"] for r in averaged], "s--", ms=3, color="C4",
                    label="validation loss of the moving average")
    annealed = [b for b in branches if b["val_loss"] is not None]
    if annealed:
        ax.plot([b["tokens"] for b in annealed], [b["val_loss"] for b in annealed], "D", ms=5, color="C3",
                label="annealed: cooldown branches' validation loss")
    if prediction is not None:
        first = min((r["tokens"] for r in train + evals), default=prediction["tokens"] / 100)
        d = np.geomspace(max(first, prediction["tokens"] / 100, 1), prediction["tokens"], 60)
        ax.plot(d, [expected_loss(law, prediction["n"], x, prediction.get("unique_tokens")) for x in d], "--",
                color="C2", lw=1,
                label="law: L(N, D) of a finished run of D tokens")
        if "interval" in prediction:  # a line, not error bars: the fit may lie outside its resamples' interval
            ax.vlines(prediction["tokens"], *prediction["interval"], color="C2", lw=2, alpha=0.5,
                      label="95% bootstrap interval")
        ax.plot([prediction["tokens"]], [prediction["loss"]], "s", color="C2",
                label=f"predicted final loss {prediction['loss']:.4f}")
    ax.set(xscale="log", xlabel="tokens", ylabel="loss", title="loss")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _speed_plot(path: Path, train: list[dict], planned: float | None = None) -> Path | None:
    if len(train) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], color="C0", lw=1)
    if planned is not None:
        ax.axhline(planned, ls="--", color="C2", lw=1, label=f"planned {planned:,.0f} tokens/s")
        ax.legend(fontsize=8, loc="lower right")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    mfu = [r.get("mfu") for r in train]
    if all(m is not None for m in mfu):
        twin = ax.twinx()
        twin.plot([r["step"] for r in train], [100 * m for m in mfu], color="C3", lw=1)
        twin.set_ylabel("MFU (%)", color="C3")
    return _save(fig, path)


def _progress_plot(path: Path, time: dict | None, total_steps: int, plan: dict | None) -> Path | None:
    """Step against wall-clock, each invocation a line of its own (a rewind drops back), the time
    between invocations shaded; with a plan, the planned pace from the first launch."""
    if time is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    planned = (plan or {}).get("run", {}).get("wall_hours")
    longest = max(time["wall_s"], 3600 * (planned or 0))
    unit, scale = next((u, s) for u, s in (("s", 1), ("min", 60), ("h", 3600), ("days", 86400))
                       if longest / s < 200 or u == "days")
    for i, run in enumerate(time["timeline"]):
        ax.plot([t / scale for t, _ in run], [step for _, step in run], color="C0", lw=1,
                label="this run" if i == 0 else None)
        if i:
            ax.axvspan(time["timeline"][i - 1][-1][0] / scale, run[0][0] / scale, color="0.85",
                       label="between invocations" if i == 1 else None)
    if planned:
        ax.plot([0, 3600 * planned / scale], [0, total_steps], "--", color="C2", lw=1,
                label=f"planned, at {plan['run']['goodput']:.1%} goodput")
    ax.set(xlabel=f"wall-clock ({unit})", ylabel="step", title=f"progress: goodput {time['goodput']:.1%}")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _norms_plot(path: Path, train: list[dict]) -> Path | None:
    """log.norms: each part's gradient norm (before clipping) and weight norm against the step,
    the blocks shaded from the first (dark) to the last (light)."""
    measured = [r for r in train if r.get("grad_norm_by_part")]
    if not measured:
        return None
    parts = list(measured[-1]["grad_norm_by_part"])
    blocks = [p for p in parts if p.startswith("layers.")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in measured]
    for ax, key, title in ((axes[0], "grad_norm_by_part", "gradient norm by part"),
                           (axes[1], "weight_norm_by_part", "weight norm by part")):
        for part in parts:
            color = (plt.cm.viridis(blocks.index(part) / max(len(blocks) - 1, 1)) if part in blocks
                     else {"embedding": "C3", "head": "C1"}.get(part, "C7"))
            label = part if part not in blocks or part in (blocks[0], blocks[-1]) else None
            ax.plot(steps, [r[key].get(part) for r in measured], color=color, lw=1, label=label)
        ax.set(xlabel="step", yscale="log", title=title)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def _tasks_plot(path: Path, evals: list[dict]) -> Path | None:
    """Each task's accuracy and its right choice's loss per token against tokens (eval.tasks)."""
    names = sorted(evals[-1].get("task_accuracy") or {}) if evals else []
    if not names:
        return None
    scored = [r for r in evals if r.get("task_accuracy")]
    tokens = [r["tokens"] for r in scored]
    fig, (accuracy, nll) = plt.subplots(1, 2, figsize=(9, 3.5))
    for i, name in enumerate(names):
        accuracy.plot(tokens, [r["task_accuracy"].get(name) for r in scored], "o-", ms=3, color=f"C{i}", label=name)
        nll.plot(tokens, [r["task_nll"].get(name) for r in scored], "o-", ms=3, color=f"C{i}", label=name)
    accuracy.set(xscale="log", xlabel="tokens", ylabel="accuracy", title="multiple-choice accuracy")
    nll.set(xscale="log", xlabel="tokens", ylabel="loss per token", title="loss of the right choice")
    accuracy.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def by_source_line(losses: dict[str, float]) -> str:
    """'code 3.1234, prose 4.0021': a mixture's validation loss by source."""
    return ", ".join(f"{name} {loss:.4f}" for name, loss in losses.items())


def noise_line(noise: dict) -> str:
    """The report's line on the noise scale (its summary's "noise")."""
    return (f"{noise['noise_scale']:,.0f} at step {noise['step']:,}, batch {noise['batch_tokens']:,}: "
            f"{noise['steps_factor']:.2f}x the fewest steps, {noise['tokens_factor']:.2f}x the fewest tokens")


def _html(cfg, summary: dict, plots: list[Path]) -> str:
    def number(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    rows = [("parameters", f"{summary['parameters']:,}"),
            ("steps", f"{summary['step']:,} of {summary['total_steps']:,}"),
            ("tokens", f"{summary['tokens']:,} of {summary['planned_tokens']:,}"),
            ("final train loss", number(summary["train_loss"], ".4f")),
            ("final validation loss", number(summary["val_loss"], ".4f")),
            ("final validation bits per byte", number(summary["val_bits_per_byte"], ".4f")),
            *([("final validation loss by source", by_source_line(summary["val_loss_by_source"]))]
              if summary["val_loss_by_source"] else []),
            *([("final held-out losses (eval.data)", by_source_line(summary["heldout_loss"]))]
              if summary["heldout_loss"] else []),
            *([("final validation loss of the moving average of the weights",
                number(summary["val_ema_loss"], ".4f"))] if summary["val_ema_loss"] is not None else []),
            ("tokens/s (median)", number(summary["tokens_per_s"], ",.0f")),
            ("MFU (median)", number(summary["mfu"], ".1%")),
            ("data wait, share of a step (median)", number(summary["data_wait_share"], ".2%")),
            ("peak memory (GB)", number(summary["peak_memory_gb"], ".2f")),
            *([("gradient noise scale (tokens), and the batch's cost in steps and tokens over the fewest",
                noise_line(summary["noise"]))] if summary["noise"] else []),
            *((f"{name}: accuracy, per character, right choice's loss per token",
               f"{task['accuracy']:.1%}, {task['accuracy_norm']:.1%}, {task['nll']:.4f}")
              for name, task in summary["tasks"].items())]
    rows += [(f"cooldown from step {b['step']:,} ({b['run']}): final validation loss", branch_line(b))
             for b in summary["branches"]]
    time = summary["time"]
    if time is not None:
        rows.append((f"goodput: the share of the wall-clock that trained kept steps ({time['invocations']} "
                     f"invocations, {time['rewinds']} rewinds)", wall_line(time)))
        rows += [(f"  {label}", f"{time['parts'][key]:,.1f} s ({time['parts'][key] / time['wall_s']:.1%})")
                 for key, (_, label) in PARTS.items()]
    plan = summary.get("plan")
    if plan is not None:
        for key, label, form in PLANNED:
            entry = plan[key]
            rows.append((f"planned {label} ({plan['devices']} x {plan['device']}, {plan['layout']})",
                         number(entry["planned"], form)
                         + (f"; measured {entry['ratio']:.3g}x of it" if entry["ratio"] is not None else "")))
    prediction = summary.get("prediction")
    if prediction is not None:
        low, high = prediction.get("interval", (None, None))
        rows.append(("law's prediction of the final validation loss",
                     f"{prediction['loss']:.4f}" + (f" [{low:.4f}, {high:.4f}]" if low is not None else "")))
        if "error" in prediction:
            rows.append(("reached against predicted", f"{prediction['error']:+.2%}"))
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    events = "".join(
        f"<tr><td>{e['step']:,}</td><td>{html.escape(e['kind'])}</td><td>"
        + html.escape(", ".join(f"{k} {v}" for k, v in e.items() if k not in ("kind", "step") and v is not None))
        + "</td></tr>" for e in summary["events"])
    images = "".join(f'<p><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
                     "</p>" for p in plots)
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(cfg.run.name)}</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
            "th,td{text-align:left;padding:.2em .8em;border-bottom:1px solid #ddd}</style>"
            f"<h1>{html.escape(cfg.run.name)}</h1><table>{table}</table>{images}"
            f"<h2>events</h2><table><tr><th>step</th><th>event</th><th></th></tr>{events}</table>"
            f"<h2>config</h2><pre>{html.escape(cfg.to_toml())}</pre>")
