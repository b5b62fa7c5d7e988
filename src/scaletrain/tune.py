"""The learning rate, tuned where it is cheap: under muP (model.mup_base_dim, model.mup_base_layers)
the best rate of a model at the base width and depth is the best rate of the wide, deep one (Yang
et al. 2022, "Tensor Programs V": muTransfer; Dey et al. 2025 across depth), so `tune` trains
the config's model narrowed to that width and depth — its proxy — once per learning rate of a
grid, and the config takes the rate whose proxy reached the lowest validation loss.

The proxy is the config's run with the width (and the MLP's, and the number of heads, each
head as wide) scaled to mup_base_dim, the depth to mup_base_layers, and everything else —
vocabulary, data, batch, steps, schedule, seed — the same: muP transfers across width and depth,
not training length, so a proxy trained shorter than the run finds the best rate of a shorter
run (shorten it anyway when the run is long, with `steps`: the best rate moves slowly with
length). Each proxy is a run of its own in the tuning directory, one row of its results.csv when
done (proxies.ProxyRuns, as the other searches by small runs): an interrupted tuning resumes
(finished rates kept, the ones in progress from their checkpoints), several rates train at once
with `concurrency` (worker processes, GPUs taken in turn), and a diverged one counts as the worst.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import ConfigError, RunConfig, validate_config
from scaletrain.outputs import read_own
from scaletrain.proxies import ProxyRuns, train_proxy


# A factor-2 grid around the rates small Llama-style models train at (AdamW).
DEFAULT_LRS = tuple(2.0 ** k for k in range(-11, -4))


def proxy_data(cfg: RunConfig) -> dict:
    """The config's TOML data with its model narrowed to model.mup_base_dim and made as shallow as
    model.mup_base_layers (whichever are set), in one process (the proxy is small), without the
    plan (which is the wide run's)."""
    m = cfg.model
    if m.mup_base_dim is None and m.mup_base_layers is None:
        raise ConfigError("tune transfers the learning rate under muP: set model.mup_base_dim to the width to tune "
                          f"at (e.g. {max(m.head_dim, m.dim // 4)}, a multiple of the head width {m.head_dim}), "
                          f"model.mup_base_layers to the depth (e.g. {max(1, m.n_layers // 4)}), or both")
    width, depth = m.mup_base_dim or m.dim, m.mup_base_layers or m.n_layers
    if width > m.dim or depth > m.n_layers or (width, depth) == (m.dim, m.n_layers):
        given = " and ".join(f"model.{key} = {value}" for key, value in (("mup_base_dim", m.mup_base_dim),
                                                                         ("mup_base_layers", m.mup_base_layers))
                             if value is not None)
        raise ConfigError(f"{given}: a proxy of width {width} and {depth} blocks, not smaller than the model (width "
                          f"{m.dim}, {m.n_layers} blocks) in every way and smaller in one; tune trains a small proxy: "
                          "set them below the model's")
    data = cfg.model_dump(exclude_none=True)
    model = data["model"]
    if m.mup_base_dim is not None:
        model.update(narrowed(m))
    if m.mup_base_layers is not None:
        if m.moe and m.moe_dense_layers >= m.mup_base_layers:
            raise ConfigError(f"model.mup_base_layers = {m.mup_base_layers} leaves the proxy only the "
                              f"model.moe_dense_layers = {m.moe_dense_layers} dense blocks and no mixture of "
                              f"experts; use more than {m.moe_dense_layers} base layers")
        model["n_layers"] = m.mup_base_layers
        if m.full_attention_layers is not None:  # (the proxy's blocks as the model's first ones attend)
            kept = [i for i in m.full_attention_layers if i < m.mup_base_layers]
            if not kept:
                raise ConfigError(f"model.mup_base_layers = {m.mup_base_layers} leaves the proxy none of the blocks "
                                  f"model.full_attention_layers = {m.full_attention_layers} take out of the window; "
                                  f"use more than {m.full_attention_layers[0]} base layers")
            model["full_attention_layers"] = kept
    data["parallel"] = {}
    data["log"].pop("plan", None)
    return data


def narrowed(m) -> dict:
    """The model's width fields at model.mup_base_dim: heads as wide and fewer of them, the MLPs'
    widths in proportion; ConfigError where that width cannot hold whole heads."""
    base = m.mup_base_dim
    if base % m.head_dim:
        raise ConfigError(f"model.mup_base_dim = {base} is not a multiple of the head width dim / n_heads = "
                          f"{m.head_dim}: the proxy keeps heads as wide and has fewer of them; use a multiple of "
                          f"{m.head_dim}")
    heads = base // m.head_dim
    group = m.n_heads // m.kv_heads  # query heads per key/value head, kept
    if heads % group:
        raise ConfigError(f"model.mup_base_dim = {base} leaves {heads} heads, which do not share key/value heads "
                          f"{group} to one as model.n_heads / n_kv_heads = {m.n_heads} / {m.kv_heads} do; use a "
                          f"multiple of {m.head_dim * group}")
    fields = {"dim": base, "n_heads": heads, "n_kv_heads": heads // group}
    for key in ("ffn_dim", "moe_ffn_dim"):  # (unset: derived from the width, as the wide model's)
        if getattr(m, key) is not None:
            fields[key] = max(1, round(getattr(m, key) * base / m.dim))
    return fields


@dataclass(frozen=True)
class TuneSettings:
    proxy: dict  # the proxy's config data, its run directory the tuning's
    lrs: tuple[float, ...]
    device: str = "auto"  # train.device: where worker processes train (GPUs taken in turn)

    def __post_init__(self):
        names = {}
        for lr in sorted(set(self.lrs)):
            if run_name(lr) in names:  # (one proxy would train, and both rows report its loss)
                raise ConfigError(f"--lrs {names[run_name(lr)]!r} and {lr!r} are one run, {run_name(lr)}: give rates "
                                  "that differ in their first 6 significant digits")
            names[run_name(lr)] = lr


def run_name(lr: float) -> str:
    """The proxy run of a learning rate."""
    return f"lr_{lr:.6g}"


class Tuning(ProxyRuns):
    """One proxy run per learning rate (proxies.ProxyRuns: results.csv, resume, worker processes)."""

    kind = "tuning directory"

    def keys(self) -> list[float]:
        return sorted(set(self.settings.lrs))

    def name_of(self, lr: float) -> str:
        return run_name(lr)

    def columns(self) -> list[str]:
        return ["name", "lr", "val_loss", "c"]

    def _run_one(self, lr: float, train) -> dict:
        from scaletrain.train.metrics import read_metrics

        proxy = self.settings.proxy
        cfg = validate_config({**proxy, "run": {**proxy["run"], "name": self.name_of(lr)},
                               "train": {**proxy["train"], "lr": lr}}, source="the proxy")
        _, loss, _ = train_proxy(cfg, train)  # (nan if it diverged)
        return {"name": self.name_of(lr), "lr": lr, "val_loss": loss,
                "c": read_metrics(cfg.run_dir, "start")[-1]["flops_per_token"] * cfg.total_tokens}


class Tune:
    """A tuning of the learning rate of `cfg`'s proxy in directory `out` (resuming what is there)
    at each rate of `lrs`, each proxy trained for `steps` optimizer steps if given (else the run's
    length). Checked when made, before anything is written or trained: the proxy against the one
    the directory tuned, its data, its rates."""

    def __init__(self, cfg: RunConfig, out: str | Path, lrs=DEFAULT_LRS, steps: int | None = None) -> None:
        self.cfg, self.out = cfg, Path(out)
        proxy = proxy_data(cfg)
        proxy.setdefault("run", {}).update(dir=str(self.out), name="proxy")
        if steps is not None:  # the proxies' length, not the run's: a shorter run of the same schedule,
            proxy["train"].pop("tokens", None)  # its warmup the same share of its steps
            proxy["train"]["steps"] = steps
            warmup = cfg.train.warmup_steps
            proxy["train"]["warmup_steps"] = max(1, round(warmup * steps / cfg.total_steps)) if warmup else 0
        # What makes two tunings the same: the proxy's every setting but the rate.
        from scaletrain.data.shards import read_indexes

        checked = validate_config(proxy, source="the proxy")
        read_indexes(checked.data.sources)  # (data that is not there is refused before tune.json is written)
        self.identity = checked.model_dump(mode="json", exclude_none=True)  # (as JSON reads back)
        self.identity["train"].pop("lr")
        self.identity["run"].pop("dir")  # (where the directory is: a tuning moved or copied is the same tuning)
        self.record = self.out / "tune.json"
        saved = read_own(self.record, "proxy")["proxy"] if self.record.is_file() else None
        if isinstance(saved, dict) and isinstance(saved.get("run"), dict):
            saved["run"].pop("dir", None)  # (written with it before)
        if saved is not None and saved != self.identity:
            raise ConfigError(f"{self.out} holds a tuning of another config (its proxy differs); give another --out, "
                              "or the config and overrides it was tuned with")
        self.settings = TuneSettings(proxy, tuple(lrs), cfg.train.device)  # (its rates checked here too)

    def run(self, progress=None, concurrency: int = 1) -> dict:
        """Train the rates left, `concurrency` at a time in worker processes; returns {"proxy": ...,
        "results": [{"lr", "val_loss" or None, "diverged"}...] (every rate the directory has
        trained), "best_lr", "fitted_lr", "edge"}, also written to out/tune.json. progress gets
        ProxyRuns.run's dict after each rate."""
        self.out.mkdir(parents=True, exist_ok=True)
        tuning = Tuning(self.out, self.settings)
        # (the identity first: a resumed tuning is checked against it)
        _write(self.record, self.identity, self.cfg, tuning.results())
        tuning.run(progress, concurrency)
        return _write(self.record, self.identity, self.cfg, tuning.results())


def tuned_rates(out: str | Path) -> set[float]:
    """The learning rates a tuning directory has trained (those its results.csv records)."""
    return {row["lr"] for row in Tuning(Path(out), None).results()}


def _write(record: Path, identity: dict, cfg: RunConfig, trained: list[dict]) -> dict:
    rows = [{"lr": row["lr"], "val_loss": row["val_loss"] if math.isfinite(row["val_loss"]) else None,
             "diverged": not math.isfinite(row["val_loss"])} for row in sorted(trained, key=lambda r: r["lr"])]
    doc = {"proxy": identity, "width": cfg.model.dim, "base_width": cfg.model.mup_base_dim,
           "depth": cfg.model.n_layers, "base_depth": cfg.model.mup_base_layers, "results": rows, **best_rate(rows)}
    record.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def best_rate(rows: list[dict]) -> dict:
    """The rate of the lowest validation loss; the vertex of the parabola in log2(rate) through
    it and its neighbours, when it has one on each side (and the parabola opens upwards); and
    whether it lies at an edge of the grid (then the best may lie beyond)."""
    trained = [r for r in rows if r["val_loss"] is not None]
    if not trained:
        return {"best_lr": None, "fitted_lr": None, "edge": None}
    i = min(range(len(trained)), key=lambda j: trained[j]["val_loss"])
    best = trained[i]["lr"]
    edge = "smallest" if best == rows[0]["lr"] else "largest" if best == rows[-1]["lr"] else None
    fitted = None
    if 0 < i < len(trained) - 1:
        (x0, y0), (x1, y1), (x2, y2) = ((math.log2(r["lr"]), r["val_loss"]) for r in trained[i - 1:i + 2])
        # The parabola through three points: its vertex.
        d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        curvature = (d12 - d01) / (x2 - x0)
        if curvature > 0:
            fitted = 2 ** ((x0 + x1) / 2 - d01 / (2 * curvature))
    return {"best_lr": best, "fitted_lr": fitted, "edge": edge}
