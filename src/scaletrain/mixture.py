"""Choose a data mixture by measurement: train one small proxy model per sampled mixture, fit a
data mixing law to their validation losses (scaling/mixing.py), and take the mixture the law
predicts best for a target.

The proxies are one shape — the prior law's compute-optimal model at the search's budget —
trained for the tokens the budget buys with the sweep's hyperparameter rule and a cosine
schedule, so the mixture is the only thing that differs between them. The first mixture is
the sources' natural one (in proportion to their training tokens), the second the uniform
one, then one "corner" per source (that source with every other at the floor), so that the
mixture chosen lies among measured ones rather than beyond them, and the rest are drawn
uniformly from the simplex (Dirichlet(1)) from the seed; every share is at least MIN_SHARE.
Each proxy's loss is measured on every source's validation split and, with target_data, on
that of a domain none of them trains on.

The directory holds mixtures.json (settings and the planned mixtures), runs/ (one run
directory per mixture), results.csv, and mixture.json and mixture.png once fitted; rerunning
the same command continues where it stopped: finished runs are kept, an unfinished one
resumes from its checkpoint. The target and the planned run's tokens only change the fit, so
they may change between invocations.

The best mixture has been found to carry from proxies of about 1M parameters to models 1000×
larger (RegMix, Liu et al. 2024, who fit a regression to the losses of many tiny proxies;
Shukor et al. 2025 and Ye et al. 2024 fit laws of the mixture, size and steps together). The
search measures at the size it trains; benchmarks/mixture.py checks the choice at 10× that.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from scaletrain.config import ConfigError, load_config, mix_toml
from scaletrain.data.shards import DataError, read_index, read_indexes
from scaletrain.outputs import read_own
from scaletrain.scaling.grid import Point, deepseek_hyperparameters, plan_points, shapes_around, warmup_steps
from scaletrain.scaling.hparams import HyperparameterLaw
from scaletrain.scaling.laws import ChinchillaLaw, preset
from scaletrain.scaling.mixing import (MixingLaw, best_mixture, bootstrap_mixing_laws, fit_mixing_law, leave_one_out,
                                       share_bounds)
from scaletrain.proxies import ProxyRuns, train_proxy
from scaletrain.sweep import run_overrides

log = logging.getLogger("scaletrain")

MIN_SHARE = 0.02  # the least share of any source in a proxy's mixture and in the one chosen
MAX_EPOCHS = 4.0  # Muennighoff et al. 2023: repeating data past ~4 epochs is worth much less


@dataclass
class MixtureSettings:
    data: str  # the directory that holds the sources' data directories
    sources: list[str]
    budget: float  # training FLOPs of each proxy run
    runs: int = 0  # proxies; 0: default_runs(len(sources))
    seq_len: int = 128
    prior: str = "epoch"
    eval_tokens: int = 16384  # validation tokens of each source
    micro_batch: int = 8
    min_steps: int = 100
    seed: int = 0
    device: str = "auto"
    optimizer: str = "adamw"
    # A data directory (one tokenizer with the sources) whose validation split every proxy is also
    # evaluated on: a target domain trained on by none of them (Ye et al.'s implicit target).
    target_data: str | None = None
    hparams: dict | None = None  # a measured learning-rate and batch rule (as the sweep's); None: DeepSeek's

    def __post_init__(self):
        if self.runs == 0:
            self.runs = default_runs(len(self.sources))


def sources_under(root: str | Path, target_data: str | None = None) -> list[str]:
    """The prepared data directories under root, by name (a search's default sources), but for
    the target data's if it is one of them: no proxy trains on the target."""
    root = Path(root)
    if not root.is_dir():
        return []
    target = Path(target_data).resolve() if target_data else None
    return sorted(p.name for p in root.iterdir() if (p / "index.json").is_file() and p.resolve() != target)


def default_runs(sources: int) -> int:
    """Proxies for a mixture of `sources`: the law has 2 x sources + 1 numbers per validation
    source; about twice that (4 per source, at least 8) leaves enough over to check it on runs it
    was not fitted to. They hold the natural, uniform and corner mixtures and the rest drawn."""
    return max(8, 4 * sources)


@dataclass
class Choice:
    """What the law recommends for a target: the shares, the target loss predicted there (with
    the bootstrap's 95% interval) and at the natural and uniform mixtures, and each share's
    interval over the bootstrap refits' own optima (both None when the proxies are too few for
    resamples of them to refit the law otherwise: the law has as many numbers as they are, or
    nearly, and only resamples of every proxy fit)."""

    shares: dict[str, float]
    target: dict[str, float]  # validation source -> weight in the target loss
    predicted: float
    interval: tuple[float, float] | None
    shares_interval: dict[str, tuple[float, float]] | None
    natural: float
    uniform: float
    best_run: dict  # the proxy with the lowest measured target loss: name, shares, target loss
    # mean |leave-one-out prediction / measured - 1| of the proxies' target losses; None when no
    # proxy can be left out (as many proxies as the law has numbers)
    loo_error: float | None
    tokens: float | None  # the planned run's tokens the epoch caps were set for
    caps: dict[str, float] = field(default_factory=dict)

    @property
    def mix(self) -> str:
        """The shares as data.mix's TOML value."""
        return mix_toml({name: round(share, 3) for name, share in self.shares.items()})


class MixtureSearch(ProxyRuns):
    """The mixture search in directory `out` (see the module's docstring)."""

    kind = "mixture search"

    def __init__(self, out: Path, settings: MixtureSettings, target: dict[str, float] | None = None):
        """`target`, when given, is checked (target_weights) before the directory is written."""
        super().__init__(out, settings)
        root = Path(settings.data)
        if not root.is_dir():
            raise ConfigError(f"--data {settings.data!r} is not a directory; give the directory that holds the "
                              "sources' data directories (each written by `scaletrain data prepare`)")
        if (root / "index.json").is_file():
            raise ConfigError(f"--data {settings.data!r} is itself a prepared data directory; give the directory "
                              "that holds one prepared directory per source (e.g. data/ holding data/code, data/web)")
        if len(settings.sources) < 2:
            raise ConfigError(f"a mixture search needs at least two sources, got {settings.sources}; name them with "
                              "--sources a,b,... (data directories under --data)")
        self.validation = list(settings.sources)
        self._fits: dict[tuple, object] = {}  # (choose's fits, which no target or run length changes)
        checked = {name: root / name for name in settings.sources}
        if settings.target_data is not None:
            name = Path(settings.target_data).name
            if name in settings.sources:
                raise ConfigError(f"--target-data {settings.target_data!r} has the name of a source; a target domain "
                                  "is data none of the proxies trains on (rename its directory if it is another)")
            self.validation.append(name)
            checked = {**checked, name: Path(settings.target_data)}
        if settings.target_data is not None:
            try:
                read_index(settings.target_data)
            except DataError as e:
                raise ConfigError(f"--target-data {settings.target_data!r}: {e}") from None
        try:
            indexes = read_indexes(checked)
        except DataError as e:
            present = sorted(p.name for p in root.iterdir() if (p / "index.json").is_file())
            raise ConfigError(f"--sources {','.join(settings.sources)}: {e} (data directories under {str(root)!r}: "
                              f"{', '.join(present) or 'none'})") from None
        self.unique_tokens = {name: indexes[name]["splits"]["train"]["tokens"] for name in settings.sources}
        for name, tokens in self.unique_tokens.items():  # (a proxy would fail on it only once the search is written)
            if tokens <= settings.seq_len:
                raise ConfigError(f"--sources: the training split of {name!r} holds {tokens} tokens, fewer than one "
                                  f"sequence of --seq-len {settings.seq_len} + 1; prepare more of it, or leave it out")
        self.vocab_size = -(-max(index["vocab_size"] for index in indexes.values()) // 64) * 64
        if settings.runs < 2 * len(settings.sources) + 1:
            raise ConfigError(f"--runs {settings.runs}: a law of {len(settings.sources)} sources needs at least "
                              f"{2 * len(settings.sources) + 1} runs (default {default_runs(len(settings.sources))})")
        prior = preset(settings.prior)
        if not isinstance(prior, ChinchillaLaw):
            raise ConfigError(f"--prior {settings.prior!r} has no compute-optimal size; use epoch or hoffmann")
        shape = shapes_around(prior.optimum(settings.budget)[0], 1, self.vocab_size)[0]
        rule = HyperparameterLaw.from_dict(settings.hparams) if settings.hparams else deepseek_hyperparameters
        self.point = plan_points(settings.budget, [shape], self.vocab_size, settings.seq_len, rule,
                                 min_steps=settings.min_steps, micro_batch=settings.micro_batch)[0]
        if self.point.steps < settings.min_steps:
            raise ConfigError(f"--budget {settings.budget:.3g} trains the proxy ({shape.name}) for only "
                              f"{self.point.steps} steps, fewer than {settings.min_steps}: a loss after so few updates "
                              "says little about the data; raise the budget or lower --seq-len")
        self.target_weights(target)  # (before mixtures.json: a refused command writes nothing)
        self.mixtures = self._planned()

    def _planned(self) -> list[dict[str, float]]:
        """The proxies' mixtures, as written in mixtures.json (or planned now and written there);
        a directory started with other settings is refused."""
        s, saved = self.settings, self.out / "mixtures.json"
        if saved.is_file():
            doc = read_own(saved, "settings")
            if doc["settings"] != asdict(s):
                changed = [f"{k}: {doc['settings'].get(k)} then, {v} now" for k, v in asdict(s).items()
                           if doc["settings"].get(k) != v]
                raise ConfigError(f"mixture directory {str(self.out)!r} was started with other settings "
                                  f"({'; '.join(changed)}); rerun it with the same ones or choose a new --out")
            return doc["mixtures"]
        names = s.sources
        tokens = np.array([self.unique_tokens[name] for name in names], dtype=float)
        rng = np.random.default_rng(s.seed)
        corners = np.eye(len(names))
        drawn = [tokens / tokens.sum(), np.full(len(names), 1 / len(names)), *corners,
                 *rng.dirichlet(np.ones(len(names)), size=max(0, s.runs - 2 - len(names)))][:s.runs]
        mixtures = []
        for shares in drawn:
            shares = MIN_SHARE + (1 - MIN_SHARE * len(names)) * shares
            mixtures.append(dict(zip(names, np.round(shares, 4).tolist())))
        self.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"settings": asdict(s), "mixtures": mixtures}, indent=1) + "\n"
        temporary = saved.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(text)
        temporary.replace(saved)
        return mixtures

    @staticmethod
    def name_of(index: int) -> str:
        return f"mix-{index:02d}"

    # -- the runs ----------------------------------------------------------------------------------

    def keys(self) -> list[int]:
        return list(range(len(self.mixtures)))

    def columns(self) -> list[str]:
        return ["name", *(f"share_{n}" for n in self.settings.sources), *(f"loss_{n}" for n in self.validation),
                "loss", "train_loss", "steps", "tokens", "c"]

    def point_of(self, index: int) -> Point:
        return self.point

    def mix_of(self, index: int) -> dict[str, float]:
        return self.mixtures[index]

    def run_config(self, index: int):
        return proxy_config(self.settings, self.vocab_size, self.point, self.mixtures[index],
                            self.out / "runs" / self.name_of(index))

    def _run_one(self, index: int, train) -> dict:
        """Train (or finish) proxy `index`; its row of results.csv. A run that diverges is recorded
        with losses of nan, left out of the fit."""
        cfg = self.run_config(index)
        by_source, loss, train_loss = train_proxy(cfg, train)
        by_source = self._with_target(cfg.run_dir, by_source)
        point = self.point
        tokens = point.steps * point.batch_seqs * self.settings.seq_len
        return {"name": self.name_of(index), **{f"share_{n}": self.mixtures[index][n] for n in self.settings.sources},
                **{f"loss_{n}": by_source.get(n, math.nan) for n in self.validation}, "loss": loss,
                "train_loss": train_loss,
                "steps": point.steps, "tokens": tokens, "c": float(tokens * point.flops_per_token)}

    def check(self, choice: Choice) -> dict:
        """Train one more proxy, on the chosen mixture (runs/chosen-SHARES; resumed if it was
        begun), and set its measured target loss against the law's prediction."""
        from scaletrain.train.trainer import train

        name = "chosen-" + "-".join(f"{share:.3f}" for share in choice.shares.values())
        cfg = proxy_config(self.settings, self.vocab_size, self.point, choice.shares, self.out / "runs" / name)
        by_source, _, _ = train_proxy(cfg, train)
        by_source = self._with_target(cfg.run_dir, by_source)
        measured = sum(w * by_source.get(n, math.nan) for n, w in choice.target.items() if w > 0)
        return {"run": name, "measured": measured, "predicted": choice.predicted,
                "interval": list(choice.interval) if choice.interval else None,
                "error": measured / choice.predicted - 1, "loss_by_source": by_source}

    def _with_target(self, run_dir: Path, by_source: dict[str, float]) -> dict[str, float]:
        """by_source and, with target_data, the trained proxy's loss on its validation split."""
        if self.settings.target_data is None or not by_source:
            return by_source
        from scaletrain.evaluate import evaluate_run

        record = next(evaluate_run(run_dir, data=self.settings.target_data))
        return {**by_source, self.validation[-1]: record["loss"]}

    # -- the fit -----------------------------------------------------------------------------------

    def arrays(self, rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(shares (R, n), validation losses (R, m)) of the rows, shares normalised."""
        shares = np.array([[row[f"share_{n}"] for n in self.settings.sources] for row in rows], dtype=float)
        losses = np.array([[row[f"loss_{n}"] for n in self.validation] for row in rows], dtype=float)
        return shares / shares.sum(axis=1, keepdims=True), losses

    def target_weights(self, target: dict[str, float] | None = None) -> np.ndarray:
        """The weights (summing to one) of the validation losses that `target` names (default the
        target data's loss if there is one, else every source's alike): checked before any proxy
        trains, as the choice uses them after."""
        names, validation = self.settings.sources, self.validation
        if not target:
            target = {validation[-1]: 1.0} if self.settings.target_data else {name: 1.0 for name in names}
        unknown = sorted(set(target) - set(validation))
        if unknown or any(not (w >= 0 and math.isfinite(w)) for w in target.values()) or sum(target.values()) <= 0:
            named = f" ({', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not one)" if unknown else ""
            raise ConfigError(f"--target {target}: give non-negative weights, not all zero, of the validation losses "
                              f"of {', '.join(validation)}{named} (e.g. {validation[-1]}=1)")
        weights = np.array([target.get(n, 0.0) for n in validation])
        return weights / weights.sum()

    def _law(self, shares: np.ndarray, losses: np.ndarray) -> MixingLaw:
        """The law fitted to these runs. It, and _spread's fits, depend on the runs alone, not on
        the target or the run's length: choose() asked again for another (a user weighing
        targets) fits them once."""
        key = (shares.tobytes(), losses.tobytes())
        if key not in self._fits:
            try:
                self._fits[key] = fit_mixing_law(self.settings.sources, self.validation, shares, losses)
            except ValueError as e:
                raise ConfigError(f"{e}; run the search to the end (rerun the same command)") from None
        return self._fits[key]

    def _spread(self, law: MixingLaw, shares: np.ndarray, losses: np.ndarray,
                samples: int) -> tuple[list[MixingLaw], np.ndarray]:
        """The law (`_law`'s for these runs) refitted to `samples` bootstrap resamples of them, and
        each run's losses as the law fitted to the others predicts them (leave_one_out; nan where
        a run's loss is not finite)."""
        key = (shares.tobytes(), losses.tobytes(), samples)
        if key not in self._fits:
            boot = bootstrap_mixing_laws(law, shares, losses, samples=samples, seed=self.settings.seed)
            finite = np.all(np.isfinite(losses), axis=1)
            unseen = np.full(losses.shape, np.nan)
            unseen[finite] = leave_one_out(law, shares[finite], losses[finite])
            self._fits[key] = boot, unseen
        return self._fits[key]

    def choose(self, rows: list[dict], target: dict[str, float] | None = None, tokens: float | None = None,
               samples: int = 100) -> tuple[MixingLaw, Choice]:
        """Fit the law to the finished proxies and choose the mixture for `target` (validation
        source -> weight; default the target data's loss if there is one, else every source's
        alike) and a planned run of `tokens` tokens (each source then capped at MAX_EPOCHS repeats;
        default no cap)."""
        names = self.settings.sources
        weights = self.target_weights(target)
        shares, losses = self.arrays(rows)
        law = self._law(shares, losses)
        lower, upper = share_bounds(np.array([self.unique_tokens[n] for n in names]), tokens, MAX_EPOCHS, MIN_SHARE)
        try:
            best = best_mixture(law, weights, lower, upper)
        except ValueError as e:
            raise ConfigError(f"--tokens {tokens:.3g}: {e}") from None
        boot, unseen = self._spread(law, shares, losses, samples)
        predicted = np.array([b.target(best, weights) for b in boot])
        optima = np.array([best_mixture(b, weights, lower, upper) for b in boot])
        measured = losses @ weights
        finite = np.isfinite(measured)
        missed = np.abs(unseen[finite] @ weights / measured[finite] - 1)
        missed = missed[np.isfinite(missed)]  # (nan where the others were too few to fit)
        k = int(np.nanargmin(np.where(finite, measured, np.nan)))
        # (too few proxies: no resample but of all of them fits, and those refit the law itself)
        spread = len(boot) >= max(10, samples // 4)
        natural = np.array([self.unique_tokens[n] for n in names], dtype=float)
        choice = Choice(shares=dict(zip(names, best.round(4).tolist())),
                        target=dict(zip(self.validation, weights.tolist())),
                        predicted=float(law.target(best, weights)),
                        interval=tuple(np.percentile(predicted, [2.5, 97.5]).tolist()) if spread else None,
                        shares_interval={n: tuple(np.percentile(optima[:, j], [2.5, 97.5]).round(4).tolist())
                                         for j, n in enumerate(names)} if spread else None,
                        natural=float(law.target(natural / natural.sum(), weights)),
                        uniform=float(law.target(np.full(len(names), 1 / len(names)), weights)),
                        best_run={"name": rows[k]["name"], "shares": dict(zip(names, shares[k].round(4).tolist())),
                                  "loss": float(measured[k])},
                        loo_error=float(missed.mean()) if len(missed) else None,
                        tokens=tokens, caps={n: float(u) for n, u in zip(names, upper) if u < 1})
        return law, choice

    def write(self, law: MixingLaw, choice: Choice, check: dict | None = None) -> Path:
        """mixture.json (the law, the choice, the proxies' shape and budget, the check if run) and
        mixture.png."""
        from scaletrain.report.scaling import plot_mixture

        point = self.point
        doc = {"law": law.to_dict(), "choice": {**asdict(choice), "mix": choice.mix},
               "proxy": {"shape": point.shape.name, "n": point.n, "tokens": point.tokens, "budget": point.budget,
                         "steps": point.steps, "lr": point.lr, "batch_seqs": point.batch_seqs},
               "settings": asdict(self.settings), "check": check}
        path = self.out / "mixture.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        shares, losses = self.arrays(self.results())
        plot_mixture(law, choice, shares, losses, self.out / "mixture.png")
        return path


def proxy_config(settings: MixtureSettings, vocab_size: int, point: Point, shares: dict[str, float], run_dir: Path):
    """The config of a run of `point` (a shape, its steps, batch and learning rate) on the mixture
    `shares`, in run_dir: the search's rule, a cosine schedule, a checkpoint half-way to resume."""
    warmup = warmup_steps(point.n, point.batch_seqs * settings.seq_len, max(1, point.steps // 5))
    return load_config(None, [*run_overrides(settings, vocab_size, point.shape, point.lr, point.batch_seqs, warmup,
                                             shares),
                              f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", "train.schedule=cosine",
                              f"train.steps={point.steps}", f"checkpoint.interval={max(1, point.steps // 2)}"])

