"""Evaluate a run's checkpoints after (or while) it trains, or a Hugging Face model: `scaletrain eval`.

The validation loss (and bits per byte) and multiple-choice tasks that training measures at each
evaluation, of any checkpoint the run kept — or of the mean of several (latest weight
averaging) — on the run's own data or other data prepared with its tokenizer, and on tasks
chosen afterwards: a task added later gets its curve over the kept checkpoints, a stage's
checkpoints are measured on the first stage's data, a long-context stage at its new length, a
published model on your text as a baseline. The model is built and loaded as training builds it
(trainer.Trainer), in the layout of the processes this runs in (all FSDP unless `parallel.*` is
given), so a model too large for one device is evaluated across many, and the numbers are those
an eval record of training would hold.
"""

from __future__ import annotations

import logging
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

from scaletrain.config import ConfigError, config_from, run_config_file

log = logging.getLogger(__name__)

# What an evaluation starts from instead of the run's settings: these sections are the
# training's (its layout, trackers and checkpoints); it runs on whatever device is here (a run
# trained on GPUs may be evaluated on a CPU), and compiling or float8 pays only over many steps.
# `parallel.*` and these `train.*` may be given again.
DROPPED = ("parallel", "log", "checkpoint")
TRAIN = {"device": "auto", "compile": False, "float8": False}


def run_config_data(run_dir: Path) -> dict:
    """The TOML data of the config a run directory was trained with."""
    path = run_config_file(run_dir)
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def weights_to_evaluate(source: Path, steps: list[int] | None = None, every: bool = False,
                        average: int = 1, ema: bool = False) -> list[list[Path]]:
    """What to evaluate, a list of checkpoints to average each: the checkpoints of the run in
    `source` chosen as chosen_checkpoints chooses them, each with the average - 1 complete ones
    before it (with `every`, those that have so many before them), or the Hugging Face model
    directory `source` itself; ConfigError or CheckpointError, in a sentence, for a request that
    cannot be served."""
    from scaletrain.train.checkpoint import with_earlier

    if average < 1:
        raise ConfigError(f"--average {average}: average at least 1 checkpoint (1: each on its own)")
    if is_hf_model(source):
        if steps or every or average > 1 or ema:
            raise ConfigError(f"{str(source)!r} is a Hugging Face model, one set of weights: it has no checkpoints "
                              "to choose with --step or --all, to --average, or moving average (--ema)")
        return [[source]]
    run_config_data(source)  # (a clear message before the checkpoints are looked for)
    chosen = chosen_checkpoints(source, steps, every)
    if every and average > 1:
        if len(chosen) < average:
            raise ConfigError(f"--all --average {average}: {str(source)!r} keeps {len(chosen)} complete checkpoints, "
                              f"fewer than an average of {average} needs")
        chosen = chosen[average - 1:]
    return [with_earlier(path, average) for path in chosen]


def chosen_checkpoints(run_dir: Path, steps: list[int] | None = None, every: bool = False) -> list[Path]:
    """The complete checkpoints of `steps` (in that order), or every complete one (oldest
    first), or the newest complete one."""
    from scaletrain.train import checkpoint

    root = run_dir / "checkpoints"
    complete = checkpoint.complete_checkpoints(root, say_damaged=True)
    if not steps:
        if not complete:
            raise checkpoint.no_complete_checkpoint(run_dir)
        return complete[::-1] if every else complete[:1]
    have = {checkpoint.step_of(path): path for path in complete}
    missing = [step for step in steps if step not in have]
    if missing:
        listed = ", ".join(str(step) for step in sorted(have)) or "none"
        damaged = checkpoint.checkpoint_dir(root, missing[0])
        if (damaged / checkpoint.MARKER).is_file():  # (saved, and damaged since: say how)
            raise checkpoint.CheckpointError(f"checkpoint {str(damaged)!r} is damaged: {checkpoint.check_complete(damaged)}"
                                             f"; its run's complete checkpoints are of steps: {listed}")
        raise checkpoint.CheckpointError(f"run directory {str(run_dir)!r} has no complete checkpoint of step "
                                         f"{missing[0]}; its complete checkpoints are of steps: {listed}")
    return [have[step] for step in steps]


def is_hf_model(path: Path) -> bool:
    """A Hugging Face model directory (config.json and weights), not a run directory."""
    return (path / "config.json").is_file() and not (path / "config.toml").is_file()


def evaluation_config(source: Path, first: Path, data: str | None, tasks: list[str] | None,
                      overrides: list[str], world_size: int, scratch: Path):
    """The config that evaluates `source` — a run directory, from its checkpoint `first`, or a
    Hugging Face model directory (then `first` is it too) — on its own data or `data`: the
    run's model and data settings (a Hugging Face model's from its config.json, at sequences of
    its context up to 2,048 tokens), data.path replaced by `data`, eval.tasks by `tasks`, then
    the overrides; the layout of `world_size` processes; a run of one step in `scratch` that
    takes its weights from `first` (it writes nothing)."""
    from scaletrain.train.trainer import resolve

    if is_hf_model(source):
        from scaletrain.hf import model_settings

        if data is None:
            raise ConfigError(f"{str(source)!r} is a Hugging Face model, which has no data of its own; give --data "
                              "DIR, prepared with its tokenizer (`scaletrain data prepare ... --tokenizer "
                              f"{source / 'tokenizer.json'}`)")
        model = model_settings(source)
        saved = {"model": model, "data": {"path": data, "seq_len": min(model["max_seq_len"], 2048)},
                 "train": {"steps": 1}}
        where = f"the model in {source} with the overrides"
    else:
        saved = {section: values for section, values in run_config_data(source).items() if section not in DROPPED}
        where = f"{source}/config.toml with the overrides"
    saved["train"] = {**saved.get("train", {}), **TRAIN}
    if data is not None:
        saved["data"] = {key: value for key, value in saved.get("data", {}).items() if key != "mix"} | {"path": data}
    if tasks is not None:
        saved.setdefault("eval", {})["tasks"] = tasks
    cfg = config_from(saved, overrides, source=where)
    fixed = cfg.model_dump()
    fixed["run"].update(dir=str(scratch), name="eval")
    fixed["checkpoint"].update(init_from=str(first), init_optimizer=False, resume="auto")
    # One step of whole micro-batches on every data-parallel rank, as many on each as a pipeline
    # of any schedule needs (pp x stages per rank, a multiple of pp): no layout refuses it.
    fixed["train"].update(steps=1, tokens=None, warmup_steps=0, batch_ramp=[],
                          global_batch_tokens=cfg.train.micro_batch * cfg.data.seq_len * world_size
                          * cfg.parallel.stages_per_rank)
    cfg = config_from(fixed, source=where)
    _check_tokenizer(source, cfg, data)  # (first: eval.data's held-out sets are the run's, of its tokenizer)
    try:
        resolved = resolve(cfg)
    except ConfigError as e:
        if data is not None:
            raise
        raise ConfigError(f"{e} (the run's data, as its config.toml names it; give it with --data DIR)") from None
    return resolved


def _check_tokenizer(source: Path, cfg, data: str | None) -> None:
    """The data must be tokenized as the model's was (its token ids mean those tokens)."""
    from scaletrain.data.tokenizer import load_tokenizer

    trained = source / "tokenizer.json"
    given = next(iter(cfg.data.sources.values())) / "tokenizer.json"
    if (trained.is_file() and given.is_file()
            and load_tokenizer(trained).get_vocab() != load_tokenizer(given).get_vocab()):
        where = f"--data {data!r}" if data is not None else f"data.path = {cfg.data.path!r}"
        whose = "the model" if is_hf_model(source) else "the run"
        raise ConfigError(f"{where} was prepared with another tokenizer than {whose} in {str(source)!r} was trained "
                          f"with; prepare it with {whose}'s (`scaletrain data prepare ... --tokenizer "
                          f"{trained}`)")


def _vanished(paths: list[Path]) -> bool:
    """Whether any of the checkpoints is gone from the disk — on any rank, so that all agree."""
    from scaletrain.parallel.mesh import any_rank

    return any_rank(any(not path.is_dir() for path in paths))


def _check_shape(run_dir: Path, cfg, first: Path) -> None:
    """Refuse overrides of the shape of the model a run's checkpoints hold, and a config.toml
    edited since to another model than its checkpoint `first`'s, in those words (the weights'
    loading would blame a checkpoint.init_from nobody gave)."""
    from scaletrain.train.init_from import SHAPES, check_weights

    before = config_from(run_config_data(run_dir)).model
    changed = [key for key in SHAPES if getattr(before, key) != getattr(cfg.model, key)]
    if changed:
        raise ConfigError(f"{', '.join(f'model.{key} = {getattr(cfg.model, key)}' for key in changed)}: the "
                          f"checkpoints of {str(run_dir)!r} hold the model of its config "
                          f"({', '.join(f'model.{key} = {getattr(before, key)}' for key in changed)}); drop the "
                          "override")
    check_weights(first, cfg, None, f"checkpoint {str(first)!r}",
                  f"the model of {str(run_dir / 'config.toml')!r} must be the one its checkpoints hold")


def evaluate_run(source: str | Path, steps: list[int] | None = None, every: bool = False, data: str | None = None,
                 tasks: list[str] | None = None, overrides: list[str] = (), average: int = 1,
                 ema: bool = False) -> Iterator[dict]:
    """For each chosen checkpoint of the run in `source` (see weights_to_evaluate; with
    `average`, the mean of its weights and those of the average - 1 checkpoints before it), or
    for the Hugging Face model in `source` (step and tokens None), what training's eval record
    would hold (trainer.Trainer.evaluation) with its step, tokens and path (and with `average`,
    the steps averaged; with `ema`, each checkpoint's moving average of the weights instead of
    its weights, "ema" true). Under torchrun every process calls this and gets the same records."""
    from scaletrain.parallel.mesh import shutdown, world
    from scaletrain.train import checkpoint
    from scaletrain.train.trainer import Trainer

    source = Path(source)
    groups = weights_to_evaluate(source, steps, every, average, ema)
    hugging_face = is_hf_model(source)
    with tempfile.TemporaryDirectory(prefix="scaletrain-eval-") as scratch:
        cfg = evaluation_config(source, groups[0][-1], data, tasks, list(overrides), world()[2], Path(scratch))
        if not hugging_face:
            _check_shape(source, cfg, groups[0][-1])
        try:
            trainer = Trainer(cfg)  # (a Hugging Face model's weights load here)
            for paths in groups:
                path, step, tokens, averaged = paths[-1], None, None, {}
                if not hugging_face:
                    try:
                        trainer.load_average(paths, ema=ema)
                    except checkpoint.CheckpointError:
                        if not _vanished(paths):
                            raise
                        log.warning("checkpoint %s is gone (the run pruned it while it was read): skipped", path)
                        continue
                    marker = checkpoint.marker(path)
                    step, tokens = marker["step"], marker["tokens"]
                    if average > 1:
                        averaged = {"averaged_steps": [checkpoint.step_of(p) for p in paths]}
                yield {"step": step, "tokens": tokens, "checkpoint": str(path), **averaged,
                       **({"ema": True} if ema else {}), **trainer.evaluation()}
        except BaseException:
            shutdown(clean=False)
            raise
        shutdown()


def is_sweep(path: Path) -> bool:
    """A sweep directory (`scaletrain sweep`): results.csv and the points' run directories."""
    return (path / "results.csv").is_file() and (path / "points").is_dir()


def metric_of(record: dict, metric: str) -> float:
    """A record's number that `metric` names: loss, bits_per_byte or task_nll:TASK (the right
    choice's loss per token: smooth in scale where accuracy is not)."""
    if metric in ("loss", "bits_per_byte") and metric in record:
        return record[metric]
    kind, _, task = metric.partition(":")
    if kind == "task_nll" and task in record.get("task_nll", {}):
        return record["task_nll"][task]
    have = ["loss", *(["bits_per_byte"] if "bits_per_byte" in record else []),
            *(f"task_nll:{name}" for name in record.get("task_nll", {}))]
    raise ConfigError(f"--metric {metric!r} is not measured here; choose one of {', '.join(have)}")


def evaluate_sweep(sweep_dir: str | Path, out: str | Path, data: str | None = None, tasks: list[str] | None = None,
                   overrides: list[str] = (), metric: str = "loss") -> list[dict]:
    """Each point of a sweep (its final checkpoint) evaluated on `data` (and `tasks`), written to
    `out` as the sweep's results.csv is, but with `metric` in its loss column — the points that
    `scaletrain fit --points OUT` fits a scaling law of another validation set, or of a task's
    loss, to, without training again — and every number measured in columns of its own. A point
    the sweep recorded as diverged stays so. One process."""
    import csv
    import math

    sweep_dir = Path(sweep_dir)
    with (sweep_dir / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ConfigError(f"sweep {str(sweep_dir)!r} has no finished point yet (results.csv is empty)")
    measured = []
    for row in rows:
        if not math.isfinite(float(row["loss"])):
            measured.append({**row, "sweep_loss": row["loss"]})
            continue
        [record] = evaluate_run(sweep_dir / "points" / row["name"], data=data, tasks=tasks, overrides=overrides)
        numbers = {"val_loss": record["loss"], **({"bits_per_byte": record["bits_per_byte"]}
                                                  if "bits_per_byte" in record else {}),
                   **{f"task_{key}:{name}": value for key in ("accuracy", "accuracy_norm", "nll")
                      for name, value in record.get(f"task_{key}", {}).items()}}
        measured.append({**row, "sweep_loss": row["loss"], "loss": metric_of(record, metric), **numbers})
        log.info("%s: %s %.4f", row["name"], metric, measured[-1]["loss"])
    columns = list(dict.fromkeys(key for row in measured for key in row))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(measured)
    return measured
