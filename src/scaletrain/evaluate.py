"""Evaluate a run's checkpoints after (or while) it trains: `scaletrain eval`.

The validation loss and multiple-choice tasks that training measures at each evaluation, of any
checkpoint the run kept, on the run's own data or other data prepared with its tokenizer, and
on tasks chosen afterwards: a task added later gets its curve over the kept checkpoints, a
stage's checkpoints are measured on the first stage's data, a long-context stage at its new
length. The model is built and loaded as training builds it (trainer.Trainer), in the layout of
the processes this runs in (all FSDP unless `parallel.*` is given), so a model too large for one
device is evaluated across many, and the numbers are those an eval record of training would
hold.
"""

from __future__ import annotations

import logging
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

from scaletrain.config import ConfigError, config_from

log = logging.getLogger(__name__)

# What an evaluation starts from instead of the run's settings: these sections are the
# training's (its layout, trackers and checkpoints); it runs on whatever device is here (a run
# trained on GPUs may be evaluated on a CPU), and compiling or float8 pays only over many steps.
# `parallel.*` and these `train.*` may be given again.
DROPPED = ("parallel", "log", "checkpoint")
TRAIN = {"device": "auto", "compile": False, "float8": False}


def run_config_data(run_dir: Path) -> dict:
    """The TOML data of the config a run directory was trained with."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory (no config.toml); give the directory "
                          "`scaletrain train` wrote, e.g. runs/demo")
    return tomllib.loads(path.read_text())


def chosen_checkpoints(run_dir: Path, steps: list[int] | None = None, every: bool = False) -> list[Path]:
    """The complete checkpoints of `steps` (in that order), or every complete one (oldest
    first), or the newest complete one."""
    from scaletrain.train import checkpoint

    root = run_dir / "checkpoints"
    complete = checkpoint.complete_checkpoints(root)
    if not steps:
        if not complete:
            raise checkpoint.CheckpointError(f"run directory {str(run_dir)!r} has no complete checkpoint yet")
        return complete[::-1] if every else complete[:1]
    have = {checkpoint.step_of(path): path for path in complete}
    missing = [step for step in steps if step not in have]
    if missing:
        listed = ", ".join(str(step) for step in sorted(have)) or "none"
        raise checkpoint.CheckpointError(f"run directory {str(run_dir)!r} has no complete checkpoint of step "
                                         f"{missing[0]}; its complete checkpoints are of steps: {listed}")
    return [have[step] for step in steps]


def evaluation_config(run_dir: Path, first: Path, data: str | None, tasks: list[str] | None,
                      overrides: list[str], world_size: int, scratch: Path):
    """The config that evaluates the run in `run_dir` from its checkpoint `first`: the run's
    model and data settings (data.path replaced by `data`, eval.tasks by `tasks`, then the
    overrides), the layout of `world_size` processes, and a run of one step in `scratch` that
    takes its weights from the checkpoint (it writes nothing)."""
    from scaletrain.train.trainer import resolve

    saved = {section: values for section, values in run_config_data(run_dir).items() if section not in DROPPED}
    saved["train"] = {**saved.get("train", {}), **TRAIN}
    if data is not None:
        saved["data"] = {key: value for key, value in saved.get("data", {}).items() if key != "mix"} | {"path": data}
    if tasks is not None:
        saved.setdefault("eval", {})["tasks"] = tasks
    cfg = config_from(saved, overrides, source=f"{run_dir}/config.toml with the overrides")
    fixed = cfg.model_dump()
    fixed["run"].update(dir=str(scratch), name="eval")
    fixed["checkpoint"].update(init_from=str(first), init_optimizer=False, resume="auto")
    # One step of whole micro-batches on every data-parallel rank: no layout refuses it.
    fixed["train"].update(steps=1, tokens=None, warmup_steps=0, batch_ramp=[],
                          global_batch_tokens=cfg.train.micro_batch * cfg.data.seq_len * world_size)
    cfg = config_from(fixed, source=f"{run_dir}/config.toml with the overrides")
    try:
        resolved = resolve(cfg)
    except ConfigError as e:
        if data is not None:
            raise
        raise ConfigError(f"{e} (the run's data, as its config.toml names it; give it with --data DIR)") from None
    _check_tokenizer(run_dir, resolved, data)
    return resolved


def _check_tokenizer(run_dir: Path, cfg, data: str | None) -> None:
    """The data must be tokenized as the run's was (the checkpoint's token ids mean its tokens)."""
    trained = run_dir / "tokenizer.json"
    given = next(iter(cfg.data.sources.values())) / "tokenizer.json"
    if trained.is_file() and given.is_file() and trained.read_bytes() != given.read_bytes():
        where = f"--data {data!r}" if data is not None else f"data.path = {cfg.data.path!r}"
        raise ConfigError(f"{where} was prepared with another tokenizer than the run in {str(run_dir)!r} was trained "
                          f"with; prepare it with the run's (`scaletrain data prepare ... --tokenizer "
                          f"{trained}`)")


def evaluate_run(run_dir: str | Path, steps: list[int] | None = None, every: bool = False, data: str | None = None,
                 tasks: list[str] | None = None, overrides: list[str] = ()) -> Iterator[dict]:
    """For each chosen checkpoint of the run in `run_dir` (see chosen_checkpoints), what training's
    eval record would hold (trainer.Trainer.evaluation) with its step, tokens and path. Under
    torchrun every process calls this and gets the same records."""
    from scaletrain.parallel.mesh import shutdown, world
    from scaletrain.train import checkpoint
    from scaletrain.train.trainer import Trainer

    run_dir = Path(run_dir)
    run_config_data(run_dir)  # (a clear message before the checkpoints are looked for)
    paths = chosen_checkpoints(run_dir, steps, every)
    with tempfile.TemporaryDirectory(prefix="scaletrain-eval-") as scratch:
        cfg = evaluation_config(run_dir, paths[0], data, tasks, list(overrides), world()[2], Path(scratch))
        try:
            trainer = Trainer(cfg)
            for path in paths:
                trainer.load_weights(path)
                marker = checkpoint.marker(path)
                yield {"step": marker["step"], "tokens": marker["tokens"], "checkpoint": str(path),
                       **trainer.evaluation()}
        except BaseException:
            shutdown(clean=False)
            raise
        shutdown()
