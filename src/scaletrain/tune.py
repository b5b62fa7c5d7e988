"""The learning rate, tuned where it is cheap: under muP (model.mup_base_dim) the best rate of a
model at the base width is the best rate of the wide one (Yang et al. 2022, "Tensor Programs
V": muTransfer), so `tune` trains the config's model narrowed to that width — its proxy — once
per learning rate of a grid, and the config takes the rate whose proxy reached the lowest
validation loss.

The proxy is the config's run with the width (and the MLP's, and the number of heads, each
head as wide) scaled to mup_base_dim and everything else — depth, vocabulary, data, batch,
steps, schedule, seed — the same: muP transfers across width, not depth or training length, so
a proxy trained shorter than the run finds the best rate of a shorter run (shorten it anyway
when the run is long, with `steps`: the best rate moves slowly with length). Each proxy is a run of its own
in the tuning directory: an interrupted tuning resumes (finished rates kept, the one in
progress from its checkpoint), and a diverged one counts as the worst.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from scaletrain.config import ConfigError, RunConfig, validate_config

log = logging.getLogger("scaletrain")

# A factor-2 grid around the rates small Llama-style models train at (AdamW).
DEFAULT_LRS = tuple(2.0 ** k for k in range(-11, -4))


def proxy_data(cfg: RunConfig) -> dict:
    """The config's TOML data with its model narrowed to model.mup_base_dim, in one process
    (the proxy is small), without the plan (which is the wide run's)."""
    m = cfg.model
    if m.mup_base_dim is None:
        raise ConfigError("tune transfers the learning rate under muP: set model.mup_base_dim to the width to tune "
                          f"at (e.g. {max(m.head_dim, m.dim // 4)}, a multiple of the head width {m.head_dim})")
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
    data = cfg.model_dump(exclude_none=True)
    model = data["model"]
    model.update(dim=base, n_heads=heads, n_kv_heads=heads // group)
    for key in ("ffn_dim", "moe_ffn_dim"):  # (unset: derived from the width, as the wide model's)
        if key in model:
            model[key] = max(1, round(model[key] * base / m.dim))
    data["parallel"] = {}
    data["log"].pop("plan", None)
    return data


def tune(cfg: RunConfig, out: str | Path, lrs=DEFAULT_LRS, progress=None, steps: int | None = None) -> dict:
    """Train the proxy of `cfg` at each learning rate of `lrs` in directory `out` (resuming what
    is there), each for `steps` optimizer steps if given (else the run's length); returns {"proxy": ..., "results": [{"lr", "val_loss" or None, "diverged"}...],
    "best_lr", "fitted_lr", "edge"}, also written to out/tune.json. progress(lr) is called
    before each rate is trained."""
    from scaletrain.train.metrics import read_metrics
    from scaletrain.train.trainer import TrainingDiverged, train

    out = Path(out)
    proxy = proxy_data(cfg)
    proxy.setdefault("run", {}).update(dir=str(out), name="proxy")
    if steps is not None:  # the proxies' length, not the run's
        proxy["train"].pop("tokens", None)
        proxy["train"]["steps"] = steps
    # What makes two tunings the same: the proxy's every setting but the rate.
    identity = validate_config(proxy, source="the proxy").model_dump(mode="json", exclude_none=True)  # (as JSON reads back)
    identity["train"].pop("lr")
    record = out / "tune.json"
    results: dict[float, dict] = {}
    if record.is_file():
        previous = json.loads(record.read_text())
        if previous["proxy"] != identity:
            raise ConfigError(f"{out} holds a tuning of another config (its proxy differs); give another --out, or "
                              "the config and overrides it was tuned with")
        results = {entry["lr"]: entry for entry in previous["results"]}
    out.mkdir(parents=True, exist_ok=True)
    for lr in sorted(set(lrs)):
        if lr in results:
            continue
        if progress is not None:
            progress(lr)
        run_cfg = validate_config({**proxy, "run": {**proxy["run"], "name": f"lr_{lr:.6g}"},
                                   "train": {**proxy["train"], "lr": lr}}, source="the proxy")
        try:
            train(run_cfg)
            evals = read_metrics(out / f"lr_{lr:.6g}", "eval")
            loss = evals[-1]["loss"] if evals else None
            results[lr] = {"lr": lr, "val_loss": loss if loss is not None and math.isfinite(loss) else None,
                           "diverged": loss is None or not math.isfinite(loss)}
        except TrainingDiverged as e:
            log.warning("learning rate %g diverged: %s", lr, e)
            results[lr] = {"lr": lr, "val_loss": None, "diverged": True}
        _write(record, identity, cfg, results)
    return _write(record, identity, cfg, results)


def _write(record: Path, identity: dict, cfg: RunConfig, results: dict[float, dict]) -> dict:
    rows = [results[lr] for lr in sorted(results)]
    doc = {"proxy": identity, "width": cfg.model.dim, "base_width": cfg.model.mup_base_dim, "results": rows,
           **best_rate(rows)}
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
