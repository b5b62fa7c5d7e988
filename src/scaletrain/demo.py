"""`scaletrain demo`: the whole loop on the built-in corpus — prepare data, sweep an IsoFLOP
grid, fit the law, predict the optimum at a budget several times the largest swept, train that
model, and compare the prediction with what training reached."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from scaletrain.config import ConfigError
from scaletrain.outputs import check_output_dir
from scaletrain.scaling.fit import Points, bootstrap_laws, fit_all, interval, law_of
from scaletrain.sweep import Speed, Sweep, SweepPlan, SweepSettings, measure_speed, peak_in_use, worker_pool

log = logging.getLogger("scaletrain")

# A final model this many times the parameters of the largest one approach 3 was fitted to is said
# to be extrapolated in N too (a demo scaled down to 3 minutes chose 5x and missed by +20%).
N_EXTRAPOLATION_WARNING = 4.0


@dataclass
class DemoSettings:
    """The CPU demo by default; `gpu()` gives the larger version of the same loop."""

    # Eight budgets over a decade (seven per decade): the trunks cost what the largest budget
    # costs, so the denser the budgets, the more profiles per FLOP (and the more saved: 47%
    # against 38% with six). The smallest ones keep only the 2-4 shapes that train >= 250 steps.
    budgets: tuple[float, ...] = (1e11, 1.4e11, 1.9e11, 2.7e11, 3.7e11, 5.2e11, 7.2e11, 1e12)
    shapes: int = 5
    extrapolate: float = 4.0  # the final run's budget, as a multiple of the largest swept
    seq_len: int = 128
    vocab_size: int = 512
    sources: tuple[str, ...] = ("builtin:python-stdlib",)
    max_bytes: int = 24_000_000
    val_fraction: float = 0.03
    eval_tokens: int = 65536
    bootstrap: int = 100
    device: str = "auto"
    concurrency: int = 2  # sweep points trained at once (tiny models leave cores idle one at a time)
    # Sequences per micro-batch (and the granularity of the points' batches, in sequences): on a
    # GPU, tiny models are bound by the launches of each micro-step, so fewer, larger ones.
    micro_batch: int = 8
    min_steps: int = 250  # no sweep point shorter (scaling.sweep.Sweep.fits)
    # Approach 3 is fitted to the points of at least this many steps (scaling.fit.fit_all; to
    # all of them when fewer than 6, in 2 budgets, are that long); the shorter ones still shape
    # the IsoFLOP profiles, the centring of each budget and approaches 1 and 2. Over six seeds
    # the miss went from -4.3% on average (fitted to every point) to -0.7%: BENCHMARKS.md.
    fit_min_steps: int = 500
    seed: int = 0  # of every sweep point and the final run (one demo's miss is one draw: BENCHMARKS.md)
    # A run that repeats its data more often than this gets a warning: up to about 4 epochs,
    # repeated tokens are worth nearly as much as unique ones (Muennighoff et al. 2023,
    # "Scaling Data-Constrained Language Models"); beyond, the law would be fitted to, and
    # predict, runs of repeated data.
    max_epochs: float = 4.0
    # Finish within this many seconds (None: no limit). After preparing the data, the demo times
    # the sweep's shapes on this machine (sweep.measure_speed), predicts the sweep's and the final
    # run's wall-clock, and scales every budget down by one factor (their ratios and the
    # extrapolation kept) until the prediction fits in what is left, less reserve_s for the
    # fit and the report; demo.json holds the prediction next to the times measured. (On the
    # 2-core VM, 2026-12-06: the sweep predicted 214 s, took 222 s; the final run predicted 71 s,
    # took 70 s; BENCHMARKS.md.)
    time_limit_s: float | None = 600.0
    reserve_s: float = 30.0
    # The share of the time left that the prediction must leave free: it came 7% short here once
    # (the speed alone is measured at one shape and taken at every other by the same ratio).
    headroom: float = 0.1
    min_scale: float = 0.05  # budgets are scaled down at most this far

    @classmethod
    def gpu(cls) -> DemoSettings:
        # Sized (not yet measured) from the ~125M config's H200 throughput: sweep 3e14-3e15 FLOPs,
        # the final run at 10x the largest budget, 3e16 FLOPs. A 4,096-token vocabulary: with
        # 8,192 the narrowest shapes at 3e14 would be 98% embedding and head. The final run is
        # about 14M parameters on 340M tokens, and the smallest shapes at 3e15 train on up to
        # 500M: the standard library alone (~30 MB, ~8M tokens) would be repeated 40-60 times,
        # so the installed packages' code comes too, up to 400 MB (~125M tokens at 3.2 bytes a
        # token, as measured on this project's own environment, whose 190 MB gave 50M tokens
        # in 2 minutes on 2 cores), and demo.json reports the epochs each run saw.
        return cls(budgets=(3e14, 4.8e14, 7.5e14, 1.2e15, 1.9e15, 3e15), shapes=5, extrapolate=10.0,
                   seq_len=512, vocab_size=4096, sources=("builtin:python-stdlib", "builtin:python-packages"),
                   max_bytes=400_000_000, val_fraction=0.01, eval_tokens=262144, device="cuda", concurrency=4,
                   micro_batch=32, time_limit_s=480.0)


def run_demo(out: Path, settings: DemoSettings, progress: Callable[[str, dict], None] | None = None) -> dict:
    """Run the loop into out/ (data/, sweep/, final/); returns (and writes to out/demo.json) the
    prediction next to the result."""
    from scaletrain.data import prepare
    from scaletrain.data.shards import read_index
    from scaletrain.report.run import run_report
    from scaletrain.train.trainer import train

    def say(stage: str, **info) -> None:
        if progress:
            progress(stage, info)

    if settings.device == "cuda":  # (before minutes of preparing its data)
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is visible here; run the GPU demo on a machine with "
                              "one, or leave --device out for the CPU demo")
    out = Path(out)
    check_output_dir(out, "demo directory")
    data = out / "data"
    started = mark = time.perf_counter()
    seconds: dict[str, float] = {}  # of each stage, in demo.json

    def lap(stage: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        seconds[stage], mark = now - mark, now

    say("prepare", data=str(data))
    prepare(list(settings.sources), data, vocab_size=settings.vocab_size, max_bytes=settings.max_bytes,
            val_fraction=settings.val_fraction, overwrite=True)  # (the demo's own: other versions prepare anew)
    data_tokens = read_index(data)["splits"]["train"]["tokens"]
    lap("prepare_s")
    sweep_settings = SweepSettings(data=str(data), budgets=list(settings.budgets), shapes=settings.shapes,
                                   seq_len=settings.seq_len, eval_tokens=settings.eval_tokens,
                                   min_steps=settings.min_steps, seed=settings.seed, device=settings.device,
                                   micro_batch=settings.micro_batch)
    pool = worker_pool(settings.concurrency, settings.device) if settings.concurrency > 1 else None
    try:
        timing = None
        saved, timed = out / "sweep" / "grid.json", out / "timing.json"
        if saved.is_file():  # a demo run again: its sweep goes on at the budgets it began with
            sweep_settings = replace(sweep_settings, budgets=json.loads(saved.read_text())["settings"]["budgets"])
            log.warning("the sweep in %s began with the budgets %s FLOPs; it goes on at those (no time limit is "
                        "fitted to a sweep begun; another --out starts afresh)", saved.parent,
                        ", ".join(f"{b:.3g}" for b in sweep_settings.budgets))
            if timed.is_file():  # (what was measured and predicted when it began, for demo.json)
                timing = json.loads(timed.read_text())
        elif settings.time_limit_s is not None:
            say("calibrate")
            left = settings.time_limit_s - (time.perf_counter() - started)
            sweep_settings, timing = fit_to_time(settings, sweep_settings, out / "calibration", left, pool)
            timed.write_text(json.dumps(timing, indent=1) + "\n")
            lap("calibrate_s")
            say("time", **timing)
        sweep = Sweep(out / "sweep", sweep_settings)
        rows = sweep.run(progress=lambda p: say("sweep", **p), concurrency=settings.concurrency, pool=pool,
                         speed=None if timing is None else Speed(**timing["speed"]["together"]))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    lap("sweep_s")
    budgets = sweep_settings.budgets
    finite = [r for r in rows if math.isfinite(r["loss"])]  # diverged points are recorded, not fitted
    if len(finite) < len(rows):
        log.warning("%d of the sweep's %d points diverged; they are left out of the fit", len(rows) - len(finite),
                    len(rows))
    rows = finite
    points = Points.from_rows(rows)
    say("fit", points=len(points))
    fit_min_steps = settings.fit_min_steps
    try:
        doc = fit_all(points, samples=settings.bootstrap, law_min_steps=fit_min_steps)
    except ValueError as e:  # too few points that long
        log.warning("%s; approach 3 is fitted to all %d points instead", e, len(points))
        fit_min_steps = 0
        doc = fit_all(points, samples=settings.bootstrap)
    (sweep.out / "law.json").write_text(json.dumps(doc, indent=1) + "\n")
    law, boot = law_of(doc), bootstrap_laws(doc)
    lap("fit_s")

    # The model the law asks for at the target budget, in the sweep's shape family, trained as
    # the sweep's points are: warmup-stable-decay with the learning rate, batch and warmup the
    # sweep gives that shape, so that only N and D differ from what the law was fitted on.
    target = settings.extrapolate * max(budgets)
    n_opt, _ = law.optimum(target)
    # Of the shapes that train at least min_steps there, as every sweep point does (a law fitted
    # on few points can ask for a model so large that the budget buys it a step or two), the one
    # the law predicts lowest.
    point, cfg = sweep.best_run(law, target, [f"run.dir={out}", "run.name=final", "checkpoint.interval=0"])
    predicted = law.loss(point.n, point.tokens)
    low, high = interval([sample.loss(point.n, point.tokens) for sample in boot])
    beyond = point.n / doc["approach3"]["range"]["n"][1]  # (in N as well as in C: the law saw no model so large)
    if beyond > N_EXTRAPOLATION_WARNING:
        log.warning("the law chose %s, %.1fx the parameters of the largest model it was fitted to (%s points of at "
                    "least %d steps): its loss is extrapolated in N as well as in compute, and is less sure than its "
                    "interval says; more budgets, or a longer time limit, fit it on larger models", point.name,
                    beyond, doc["approach3"]["points"], fit_min_steps)
    say("train", name=point.name, n=point.n, tokens=point.tokens)
    epochs = {"train_tokens": data_tokens, "sweep_max_epochs": max(r["d"] for r in rows) / data_tokens,
              "final_epochs": point.tokens / data_tokens}
    if max(epochs["sweep_max_epochs"], epochs["final_epochs"]) > settings.max_epochs:
        log.warning("the data (%d training tokens) is repeated up to %.1f times in the sweep and %.1f times in the "
                    "final run: beyond about %g epochs the law describes repeated data; prepare more text",
                    data_tokens, epochs["sweep_max_epochs"], epochs["final_epochs"], settings.max_epochs)
    result = train(cfg)
    lap("final_s")
    report = {
        "budgets": list(budgets), "points": len(rows), "law_points": doc["approach3"]["points"],
        "law_min_steps": fit_min_steps, "target_flops": point.compute,
        "extrapolation": point.compute / max(budgets), "n_extrapolation": beyond,
        "n_opt": n_opt, "final": {"name": point.name, "n": point.n, "tokens": point.tokens},
        "predicted_loss": predicted, "predicted_interval": [low, high], "actual_loss": result.val_loss,
        "error": (result.val_loss - predicted) / predicted,
        "a": doc["approach3"]["a"], "b": doc["approach3"]["b"],
        "approach2_a": doc["approach2"].get("a"), "backtest": doc["backtest"], "sweep_savings": sweep.savings(rows),
        "throughput": _throughput(settings, sweep, point.compute, seconds["final_s"]), "data": epochs,
    }
    # The final run's own report (loss and speed plots, events), against the law it was chosen by.
    report["report"] = run_report(out / "final", doc)["files"][-1]
    lap("report_s")
    report["time"] = {"limit_s": settings.time_limit_s, **(timing or {}),
                      "actual": {**seconds, "total_s": time.perf_counter() - started}}
    (out / "demo.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def fit_to_time(settings: DemoSettings, sweep: SweepSettings, scratch: Path, seconds: float,
                pool=None) -> tuple[SweepSettings, dict]:
    """`sweep` with its budgets scaled to end within `seconds`, less what measuring takes and
    settings.reserve_s (scale_to_time), at the speeds measured here: three of the sweep's shapes
    (its smallest, middle and largest around the prior's optima) `concurrency` at once, as the
    sweep runs them, and the final run's shape alone (sweep.measure_speed). Returns the settings
    and what was measured and predicted."""
    started = time.perf_counter()
    plan = SweepPlan.on_data(sweep)
    shapes = sorted({point.shape for budget in sweep.budgets for point in plan.prior_points(budget)}, key=plan.n_of)
    together = measure_speed(plan, [shapes[0], shapes[len(shapes) // 2], shapes[-1]], scratch, settings.concurrency,
                             pool)
    if settings.concurrency > 1:
        final, _ = plan.best_point(plan.prior, settings.extrapolate * max(sweep.budgets))
        alone_at = measure_speed(plan, [final.shape], scratch, check=False)
        alone = together.scaled(alone_at.rate(final.n) / together.rate(final.n), alone_at.overhead(final.n))
    else:
        alone = together
    available = seconds - (time.perf_counter() - started) - settings.reserve_s
    scale, predicted = scale_to_time(plan, settings, together, alone, available)
    budgets = [b * scale for b in sweep.budgets]
    return replace(sweep, budgets=budgets), {
        "scale": scale, "budgets": budgets, "available_s": available, "predicted": predicted,
        "speed": {"together": together.to_dict(), "alone": alone.to_dict(), "workers": settings.concurrency}}


def scale_to_time(plan: SweepPlan, settings: DemoSettings, together: Speed, alone: Speed,
                  available: float) -> tuple[float, dict]:
    """(scale, predicted seconds of the sweep and the final run there): the largest of 1, 0.9,
    0.81, ... (down to settings.min_scale) by which scaling every budget of `plan` (and so the
    final run's, settings.extrapolate times the largest) brings the sweep at speed `together`
    (settings.concurrency runs at once, `alone` for a budget's last points) and the final run
    at speed `alone` within `available` seconds less settings.headroom of them; the smallest
    scale, with a warning, where none does, and ConfigError where it would take over twice
    that. The final run is timed at the shape the prior law
    would choose; the fitted law's may differ."""
    target = settings.extrapolate * max(plan.settings.budgets)

    def predicted(scale: float) -> dict | None:
        """None where the budgets are too small for the sweep's min_steps."""
        # (the plan's rule as it is: a measured law in its settings, read again, would warn again)
        scaled = SweepPlan(replace(plan.settings, budgets=[b * scale for b in plan.settings.budgets], hparams=None),
                           plan.vocab_size, plan.hyperparameters)
        try:
            final, _ = scaled.best_point(scaled.prior, target * scale)
            return {"sweep_s": scaled.predicted_seconds(together, settings.concurrency, alone),
                    "final_s": alone.seconds(final, final.steps)}
        except ConfigError:
            return None

    scales = [0.9 ** k for k in range(math.floor(math.log(settings.min_scale) / math.log(0.9)) + 1)]
    feasible = [(scale, times) for scale in scales if (times := predicted(scale)) is not None]
    if not feasible:
        raise ConfigError(f"the demo's budgets scaled by {settings.min_scale:g} or more leave no shape "
                          f"{plan.settings.min_steps} steps long; lower min_steps or raise the budgets")
    usable = (1 - settings.headroom) * available
    scale, times = next(((scale, times) for scale, times in feasible if sum(times.values()) <= usable),
                        feasible[-1])
    if sum(times.values()) > 2 * usable:  # (over twice the limit: a typo, or a machine far slower than the budgets)
        limit = (settings.time_limit_s or available) - available + sum(times.values()) / (1 - settings.headroom)
        left = (f"over twice the {usable:.0f} s the time limit leaves them (less {settings.headroom:.0%} kept free)"
                if usable > 0 else "and the time limit has passed already")
        raise ConfigError(f"at the speed measured here the sweep and the final run would take {sum(times.values()):.0f} "
                          f"s even with every budget scaled by {scale:.2f} (the least allowed, {settings.min_scale:g}, "
                          f"or the least at which each budget still has a shape of {plan.settings.min_steps} steps), "
                          f"{left}; give --minutes {math.ceil(limit / 60)} or more (0: no limit)")
    if sum(times.values()) > usable:
        log.warning("the time limit cannot be kept: at the speed measured here the sweep and the final run would "
                    "take %.0f s even with every budget scaled by %.2f, the least at which each budget still has a "
                    "shape of %d steps (down to %g allowed), and %.0f s are left for them", sum(times.values()), scale,
                    plan.settings.min_steps, settings.min_scale, available)
    elif scale < 1:
        log.warning("at the speed measured here the sweep and the final run would take %.0f s, and %.0f s are left "
                    "for them: every budget is scaled by %.2f (predicted %.0f s)", sum(feasible[0][1].values()),
                    available, scale, sum(times.values()))
    return scale, times


def _throughput(settings: DemoSettings, sweep: Sweep, final_flops: float, final_s: float) -> dict:
    """Training FLOPs per second of the sweep (this invocation's points, `concurrency` at once,
    evaluation and checkpoints included) and of the final run, and their share of the bf16 peak
    of the GPUs in use: what tiny models make of a device (the sweep's `--concurrency` exists
    because one at a time they leave most of it idle)."""
    device, sweep_peak = peak_in_use(settings.device, settings.concurrency)
    _, final_peak = peak_in_use(settings.device)

    def part(flops: float, seconds: float, peak: float | None) -> dict:
        rate = flops / seconds if flops and seconds else None
        return {"flops": flops, "seconds": seconds, "flops_per_s": rate,
                "utilisation": rate / peak if rate is not None and peak is not None else None}

    return {"device": device, "sweep": part(sweep.spent_here, sweep.elapsed_s if sweep.spent_here else 0.0, sweep_peak),
            "final": part(final_flops, final_s, final_peak)}
