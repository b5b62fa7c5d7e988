"""Measure the learning-rate and batch-size rule on the user's data: at each of a few small
budgets, train the budget's compute-optimal model once per (learning rate, batch) of a grid, find
the best of each budget and fit η_opt(C) and B_opt(C) as power laws (scaling/hparams.py; the
procedure of DeepSeek LLM, section 3.1). The law replaces DeepSeek's published one wherever a
rule is taken: `sweep --hparams`, `mixture --hparams`, `plan --hparams`.

At budget C the model is the prior law's compute-optimal shape (the sweep's family), trained for
the tokens C buys; the grid is the prior rule's learning rate and batch at C times the factors
(by default η × 1/4 … 4 and B × 1/2 … 2, both factor-2 steps), so it moves with the budget as the
optimum is expected to. A batch that would leave fewer than min_steps steps is left out. Every run
has the sweep's schedule — warmup of N tokens, constant, then a linear decay over the last fifth
(WSD; a sweep point is such a run) — so the law measured is the one the sweep needs.

The directory holds grid.json (the settings), runs/ (one run directory per grid point),
results.csv, and hparams.json and hparams.png once fitted; rerunning the same command continues
where it stopped, and rerunning it with a wider grid (more --lrs, --batches or --budgets) trains
only the runs it adds. `--check C` then trains the compute-optimal model at a larger budget C
with the measured law's values and with DeepSeek's (HparamCheck, in check/): whether the law
holds beyond where it was measured, which its intervals alone do not say.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from scaletrain.config import ConfigError, load_config
from scaletrain.data.shards import read_indexes
from scaletrain.model.flops import param_counts, train_flops_per_token
from scaletrain.outputs import read_own
from scaletrain.proxies import ProxyRuns, train_proxy
from scaletrain.scaling.fit import interval
from scaletrain.scaling.grid import Point, shapes_around, steps_for, warmup_steps
from scaletrain.scaling.hparams import (BAND, DEEPSEEK, NEAR, BudgetOptimum, HyperparameterLaw,
                                        bootstrap_hyperparameter_laws, fit_runs)
from scaletrain.scaling.laws import ChinchillaLaw, preset
from scaletrain.sweep import DECAY_FRACTION, run_overrides

log = logging.getLogger("scaletrain")

# Settings that may change between invocations: the grid. A run is named by its budget, batch and
# rate, so one trained before is kept when the grid widens (its best run was on an edge) and the
# fit takes the runs of the grid as it is now.
GRID = ("budgets", "lr_factors", "batch_factors")


@dataclass
class HparamSettings:
    data: str
    budgets: list[float]
    lr_factors: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])  # x the prior rule's rate
    batch_factors: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])  # x the prior rule's batch
    seq_len: int = 128
    prior: str = "epoch"
    eval_tokens: int = 16384
    micro_batch: int = 8
    min_steps: int = 100
    seed: int = 0
    device: str = "auto"
    optimizer: str = "adamw"
    mix: dict[str, float] | None = None  # data.mix of every run, as the sweep's


def load_law(path: str | Path) -> HyperparameterLaw:
    """The law of a hparams.json (or of a JSON file holding a law's numbers at its top level)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--hparams {str(path)!r} is not a file; give the hparams.json that `scaletrain hparams` "
                          "wrote")
    try:
        doc = json.loads(path.read_text())
        return HyperparameterLaw.from_dict(doc.get("law", doc))
    except (json.JSONDecodeError, AttributeError, ValueError) as e:
        raise ConfigError(f"--hparams {str(path)!r} is not a hyperparameter law ({e}); give the hparams.json that "
                          "`scaletrain hparams` wrote") from None


class HparamSearch(ProxyRuns):
    """The hyperparameter search in directory `out` (see the module's docstring)."""

    kind = "hyperparameter search"
    text_columns = ("name", "shape")

    def __init__(self, out: Path, settings: HparamSettings):
        super().__init__(out, settings)
        s = settings
        if len(set(s.budgets)) < 2:
            raise ConfigError(f"--budgets {','.join(f'{b:.3g}' for b in s.budgets)}: a law of the compute needs at least "
                              "two budgets (e.g. 1e10,3e10,1e11)")
        for name, factors, least in (("--lrs", s.lr_factors, 3), ("--batches", s.batch_factors, 1)):
            if len(set(factors)) < least or any(not (0 < f < math.inf) for f in factors):
                raise ConfigError(f"{name} {','.join(map(str, factors))}: give at least {least} distinct positive "
                                  "factors of the prior rule's value (e.g. 0.25,0.5,1,2,4)")
        sources = {name: Path(s.data) / name for name in s.mix} if s.mix else {Path(s.data).name: Path(s.data)}
        try:
            indexes = read_indexes(sources)
        except Exception as e:
            raise ConfigError(f"--data {s.data!r}{' with --mix' if s.mix else ''}: {e}") from None
        self.vocab_size = -(-max(index["vocab_size"] for index in indexes.values()) // 64) * 64
        self.prior = preset(s.prior)
        if not isinstance(self.prior, ChinchillaLaw):
            raise ConfigError(f"--prior {s.prior!r} has no compute-optimal size; use epoch or hoffmann")
        self.points = self._plan()
        saved = self.out / "grid.json"
        text = json.dumps({"settings": asdict(s)}, indent=1) + "\n"
        if saved.is_file():
            before = read_own(saved, "settings")["settings"]
            changed = [f"{k}: {before.get(k)} then, {v} now" for k, v in asdict(s).items()
                       if before.get(k) != v and k not in GRID]
            if changed:
                raise ConfigError(f"hyperparameter search directory {str(self.out)!r} was started with other settings "
                                  f"({'; '.join(changed)}); rerun it with the same ones or choose a new --out (the "
                                  "grid, --budgets, --lrs and --batches, may change)")
        else:
            self.out.mkdir(parents=True, exist_ok=True)
        if not saved.is_file() or saved.read_text() != text:  # (workers open it too)
            temporary = saved.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(text)
            temporary.replace(saved)

    def batch_seqs(self, tokens: float) -> int:
        """Sequences a step for a batch of about `tokens`: above one micro-batch, whole half
        micro-batches (a step of 12 sequences runs micro-batches of 4), so that the grid's batches
        keep near their factors at small budgets."""
        s = self.settings
        seqs = max(1, round(tokens / s.seq_len))
        half = max(1, s.micro_batch // 2)
        return seqs if seqs <= s.micro_batch else max(s.micro_batch, round(seqs / half) * half)

    def _plan(self) -> dict[str, Point]:
        """The grid's runs by name, budget by budget, batch by batch, rate by rate."""
        s = self.settings
        points = {}
        for budget in sorted(set(s.budgets)):
            shape = shapes_around(self.prior.optimum(budget)[0], 1, self.vocab_size)[0]
            model = shape.model(self.vocab_size, s.seq_len)
            per_token = train_flops_per_token(model, s.seq_len)
            n = param_counts(model)["total"]
            lr, batch_tokens = DEEPSEEK(budget, shape.dim)
            batches = sorted({self.batch_seqs(batch_tokens * f) for f in s.batch_factors})
            kept = [b for b in batches if steps_for(budget, per_token, b, s.seq_len) >= s.min_steps]
            if not kept:
                raise ConfigError(f"budget {budget:.3g} trains {shape.name} for fewer than {s.min_steps} steps at every "
                                  f"batch of the grid ({', '.join(map(str, batches))} sequences); raise the budget, "
                                  "lower --seq-len or --min-steps")
            if len(kept) < len(batches):
                log.info("budget %.3g: batches of %s sequences left out (fewer than %d steps)", budget,
                         ", ".join(str(b) for b in batches if b not in kept), s.min_steps)
            for seqs in kept:
                steps = max(1, round(steps_for(budget, per_token, seqs, s.seq_len)))
                for factor in sorted(s.lr_factors):
                    point = Point(shape, budget, n, per_token, s.seq_len, seqs, steps, lr * factor)
                    name = f"C{budget:.4g}-b{seqs}-lr{lr * factor:.4g}".replace("+", "")
                    if name in points:  # (one run would train, and both rows report its loss)
                        raise ConfigError(f"--lrs factors whose rates at budget {budget:.3g} round alike make one run, "
                                          f"{name}: give factors that differ in their first 4 significant digits")
                    points[name] = point
        return points

    # -- the runs ----------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self.points)

    def name_of(self, key: str) -> str:
        return key

    def columns(self) -> list[str]:
        return ["name", "budget", "shape", "n", "lr", "batch_seqs", "batch_tokens", "steps", "tokens", "c", "loss",
                "train_loss"]

    def cost_of(self, name: str) -> float:
        return self.points[name].compute

    def point_of(self, name: str) -> Point:
        return self.points[name]

    def mix_of(self, name: str) -> dict[str, float] | None:
        return self.settings.mix

    def run_config(self, name: str):
        return run_config(self.settings, self.vocab_size, self.points[name], self.out / "runs" / name)

    def _run_one(self, name: str, train) -> dict:
        """Train (or finish) one grid point; its row of results.csv (a diverged run's losses nan)."""
        point = self.points[name]
        _, loss, train_loss = train_proxy(self.run_config(name), train)
        return {"name": name, "budget": point.budget, "shape": point.shape.name, "n": point.n, "lr": point.lr,
                "batch_seqs": point.batch_seqs, "batch_tokens": point.batch_seqs * self.settings.seq_len,
                "steps": point.steps, "tokens": point.tokens, "c": point.compute, "loss": loss,
                "train_loss": train_loss}

    def planned_results(self) -> list[dict]:
        """The finished runs of the grid as it is now (a narrowed grid leaves others on disk)."""
        return self._planned(self.results())

    def _planned(self, rows: list[dict]) -> list[dict]:
        """Those of `rows` in the grid as it is now, in the grid's order: the order fit's optima
        count their near-optimal runs in (results.csv's is the order they finished in, a widened
        grid's new runs last)."""
        position = {name: i for i, name in enumerate(self.points)}
        return sorted((row for row in rows if row["name"] in position), key=lambda row: position[row["name"]])

    # -- the fit -----------------------------------------------------------------------------------

    def fit(self, rows: list[dict], samples: int = 200, band: float = BAND,
            near: float = NEAR) -> tuple[HyperparameterLaw, list[BudgetOptimum], list[HyperparameterLaw]]:
        """The law fitted to the finished runs of the grid, each budget's optimum and the bootstrap's laws."""
        rows = self._planned(rows)
        budgets = {row["budget"] for row in rows}
        missing = sorted(set(self.settings.budgets) - budgets)
        if missing:
            raise ConfigError(f"no finished runs at budget {', '.join(f'{b:.3g}' for b in missing)}; run the search "
                              "to the end (rerun the same command)")
        columns = [np.array([row[k] for row in rows], dtype=float) for k in ("budget", "lr", "batch_tokens", "loss")]
        source = f"scaletrain hparams on {self.settings.data}" + (f" (mix {self.settings.mix})" if self.settings.mix
                                                                  else "")
        try:
            law, optima = fit_runs(*columns, band=band, near=near, source=source)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        boot = bootstrap_hyperparameter_laws(*columns, samples=samples, seed=self.settings.seed, band=band, near=near)
        return law, optima, boot

    def summary(self, law: HyperparameterLaw, optima: list[BudgetOptimum], boot: list[HyperparameterLaw],
                predict: list[float] = ()) -> dict:
        """hparams.json's content: the law with 95% intervals, each budget's optimum beside the prior
        rule's values and the grid's best run, and predictions at the budgets in `predict`."""
        rows = self.planned_results()
        budgets = []
        for optimum in optima:
            at = [row for row in rows if row["budget"] == optimum.budget]
            best = min((row for row in at if math.isfinite(row["loss"])), key=lambda row: row["loss"])
            lr, batch = DEEPSEEK(optimum.budget)
            budgets.append({**optimum.to_dict(), "shape": at[0]["shape"], "n": at[0]["n"],
                            "near": [at[i]["name"] for i in optimum.near],
                            "best_run": {k: best[k] for k in ("name", "lr", "batch_tokens", "loss")},
                            "prior_rule": {"lr": lr, "batch_tokens": batch}})
        keys = ("lr_coefficient", "lr_exponent", "batch_coefficient", "batch_exponent")
        return {"law": law.to_dict(),
                "interval": {k: list(interval([getattr(b, k) for b in boot])) for k in keys},
                "budgets": budgets,
                "predictions": [self.predict(law, boot, c) for c in predict],
                "prior_rule": DEEPSEEK.to_dict(), "settings": asdict(self.settings)}

    @staticmethod
    def predict(law: HyperparameterLaw, boot: list[HyperparameterLaw], compute: float) -> dict:
        return {"compute": compute, "lr": law.lr(compute), "lr_interval": list(interval([b.lr(compute) for b in boot])),
                "batch_tokens": law.batch_tokens(compute),
                "batch_interval": list(interval([b.batch_tokens(compute) for b in boot])),
                "prior_rule": dict(zip(("lr", "batch_tokens"), DEEPSEEK(compute))),
                "extrapolation": law.extrapolation(compute)}

    def write(self, law: HyperparameterLaw, optima: list[BudgetOptimum], boot: list[HyperparameterLaw],
              predict: list[float] = ()) -> tuple[Path, dict]:
        """hparams.json and hparams.png."""
        from scaletrain.report.scaling import plot_hparams

        doc = self.summary(law, optima, boot, predict)
        path = self.out / "hparams.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        plot_hparams(self.planned_results(), law, optima, boot, DEEPSEEK, self.out / "hparams.png")
        return path, doc


@dataclass(frozen=True)
class CheckSettings:
    search: HparamSettings
    law: dict  # the measured law (HyperparameterLaw.to_dict())
    budget: float

    @property
    def device(self) -> str:  # (where worker processes train: ProxyRuns)
        return self.search.device


class HparamCheck(ProxyRuns):
    """`hparams --check C`: the measured law put to the test at a budget beyond those it was
    measured at — the prior law's compute-optimal model at C trained twice, with the law's learning
    rate and batch and with the prior rule's (DeepSeek LLM's), the sweep's schedule for both. In
    the search directory's check/ (results.csv, runs/): resumable, the two runs at once with
    concurrency 2."""

    text_columns = ("name", "rule", "shape")
    RULES = ("measured", "prior")

    def __init__(self, out: Path, settings: CheckSettings):
        super().__init__(out, settings)
        self.search = HparamSearch(out.parent, settings.search)
        self.law = HyperparameterLaw.from_dict(settings.law)

    def keys(self) -> list[str]:
        return list(self.RULES)

    def name_of(self, rule: str) -> str:
        """The run of a rule at the check's budget, named by the rate and batch it trains: a law
        fitted again (the grid widened since) trains its check anew, not reports the old one's."""
        point = self.point(rule)
        return f"C{self.settings.budget:.4g}-{rule}-lr{point.lr:.4g}-b{point.batch_seqs}".replace("+", "")

    def columns(self) -> list[str]:
        return ["name", "rule", "budget", "shape", "n", "lr", "batch_seqs", "batch_tokens", "steps", "c", "loss"]

    def point(self, rule: str) -> Point:
        s, budget = self.search.settings, self.settings.budget
        shape = shapes_around(self.search.prior.optimum(budget)[0], 1, self.search.vocab_size)[0]
        model = shape.model(self.search.vocab_size, s.seq_len)
        per_token = train_flops_per_token(model, s.seq_len)
        lr, batch_tokens = (self.law if rule == "measured" else DEEPSEEK)(budget, shape.dim)
        seqs = self.search.batch_seqs(batch_tokens)
        steps = max(1, round(steps_for(budget, per_token, seqs, s.seq_len)))
        return Point(shape, budget, param_counts(model)["total"], per_token, s.seq_len, seqs, steps, lr)

    def _run_one(self, rule: str, train) -> dict:
        point, name = self.point(rule), self.name_of(rule)
        _, loss, _ = train_proxy(run_config(self.search.settings, self.search.vocab_size, point,
                                            self.out / "runs" / name), train)
        return {"name": name, "rule": rule, "budget": point.budget, "shape": point.shape.name, "n": point.n,
                "lr": point.lr, "batch_seqs": point.batch_seqs, "batch_tokens": point.batch_seqs * point.seq_len,
                "steps": point.steps, "c": point.compute, "loss": loss}

    def record(self, rows: list[dict]) -> dict:
        """The check's entry of hparams.json (added to it): each rule's run and the measured law's
        loss against the prior rule's (negative: the measured law trained the better model)."""
        by_rule = {row["rule"]: row for row in rows}
        measured, prior = by_rule["measured"]["loss"], by_rule["prior"]["loss"]
        entry = {"budget": self.settings.budget, "extrapolation": self.law.extrapolation(self.settings.budget),
                 "runs": by_rule, "loss_difference": measured - prior,
                 "relative_difference": (measured - prior) / prior if math.isfinite(measured - prior) else None}
        path = self.search.out / "hparams.json"
        doc = json.loads(path.read_text())
        doc["checks"] = [c for c in doc.get("checks", []) if c["budget"] != entry["budget"]] + [entry]
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return entry


def run_config(settings: HparamSettings, vocab_size: int, point: Point, run_dir: Path):
    """The config of a run of `point` (a shape, its steps, batch and learning rate) in run_dir:
    the sweep's schedule (warmup of N tokens, at most min_steps / 2 steps; the last fifth a linear
    decay), a checkpoint half-way to resume from."""
    s = settings
    warmup = warmup_steps(point.n, point.batch_seqs * s.seq_len, max(1, s.min_steps // 2))
    return load_config(None, [*run_overrides(s, vocab_size, point.shape, point.lr, point.batch_seqs, warmup, s.mix),
                              f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", "train.schedule=wsd",
                              f"train.decay_fraction={DECAY_FRACTION}", f"train.steps={point.steps}",
                              f"checkpoint.interval={max(1, point.steps // 2)}"])
