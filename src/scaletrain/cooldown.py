"""A cooldown branch of a run: its learning rate decayed from one of its checkpoints, in a run
directory of its own, while the run goes on.

A warmup-stable-decay run holds its peak learning rate until its decay; the loss it has reached
at any step of that plateau is not what it would reach with the rate annealed, which is what a
scaling law predicts and what a release would ship. Branching a short decay off a plateau
checkpoint measures that (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
Fixed Training Durations": a cooldown of 10-20% of the steps matches a cosine run of that
length; MiniCPM, Hu et al. 2024, released such branches). The branch is the run's config with
the run's checkpoint as its `checkpoint.resume` (its weights, optimizer, data position and
random state: the branch continues the run's stream of batches, exactly) and a WSD schedule of
step + steps updates whose decay is the last `steps`: its losses are those of a run trained
from the start with that schedule. The sweep's cooldown branches (sweep.py) are the same thing.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from scaletrain.config import ConfigError, RunConfig, load_config, parse_override, run_config_file, validate_config
from scaletrain.data.shards import read_index
from scaletrain.train.checkpoint import check_complete, complete_checkpoints, step_of
from scaletrain.train.schedule import DECAY_SHAPES, SCHEDULE_KEYS, run_lr, wsd_decay_start

log = logging.getLogger("scaletrain")


def cooldown_config(run_dir: str | Path, step: int, steps: int, decay_shape: str | None = None,
                    name: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """The config of a branch of the run in `run_dir` that decays its learning rate over `steps`
    updates from its checkpoint of step `step` (along `decay_shape`, default the run's own, to
    its min_lr_ratio), as run `name` (default RUN-cooldown-STEP) beside it; `overrides` last.
    ConfigError, in one sentence, when the run, checkpoint or schedule cannot branch."""
    run_dir = Path(run_dir)
    cfg = load_config(run_config_file(run_dir))
    if steps < 1:
        raise ConfigError(f"--steps {steps}: a cooldown takes at least one step")
    checkpoint = run_dir / "checkpoints" / f"step_{step:07d}"
    # Beside the run directory as it is now (its config's run.dir is where it was trained: a run moved
    # or copied since would have its branch written beside the other, where its report would not look).
    begun = complete_checkpoints(run_dir.parent / (name or f"{cfg.run.name}-cooldown-{step}") / "checkpoints")
    if not begun and (not checkpoint.is_dir() or check_complete(checkpoint) is not None):
        # (A branch that has begun resumes its own checkpoints: the run may have pruned step's since.)
        kept = [step_of(p) for p in complete_checkpoints(run_dir / "checkpoints")]
        raise ConfigError(f"{str(run_dir)!r} has no complete checkpoint of step {step}; it has "
                          + (", ".join(map(str, sorted(kept))) if kept else "none") + " (checkpoint.keep_every keeps "
                          "more of them for branching)")
    train = cfg.train
    # The branch is exact when every update the run made up to its checkpoint was at the peak
    # rate, as the branch's own WSD schedule makes them (warmup aside).
    if step < train.warmup_steps:
        raise ConfigError(f"step {step} of {str(run_dir)!r} is in its warmup (train.warmup_steps = "
                          f"{train.warmup_steps}); a cooldown branches from the stable stretch after it")
    last = run_lr(cfg, step - 1) if step else train.lr  # the checkpoint's last update
    stable = math.isclose(last, train.lr, rel_tol=1e-9)  # (the warmup's last rate is lr * w / w)
    if not stable and train.schedule == "wsd":
        decay = wsd_decay_start(cfg.total_steps, train.warmup_steps, train.decay_fraction)
        raise ConfigError(f"step {step} of {str(run_dir)!r} is in its decay, which began after step {decay} (its "
                          f"learning rate before step {step} was {last:.6g}, below its peak train.lr = {train.lr:g}); "
                          f"branch from a checkpoint of step {decay} or earlier")
    if not stable:
        raise ConfigError(f"{str(run_dir)!r} trains a {train.schedule!r} schedule, whose learning rate decays from "
                          f"its warmup on ({last:.6g} before step {step}, of its peak train.lr = {train.lr:g}); a "
                          "cooldown branches from the stable stretch of a 'wsd' or 'constant' schedule")
    if decay_shape is not None and decay_shape not in DECAY_SHAPES:
        raise ConfigError(f"decay shape {decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}")
    data = cfg.model_dump()
    total = step + steps
    data["run"].update(name=name or f"{cfg.run.name}-cooldown-{step}", dir=str(run_dir.parent))
    data["train"].update(schedule="wsd", steps=total, tokens=None, decay_fraction=steps / total,
                         decay_shape=decay_shape or train.decay_shape)
    data["checkpoint"].update(resume=str(checkpoint.resolve()), init_from=None)
    branch = validate_config(data, source="the cooldown's config")
    if overrides:
        # What makes it the branch: its decay (--steps, --decay-shape) from the run's checkpoint.
        owned = {"train.schedule": "--steps", "train.steps": "--steps", "train.tokens": "--steps",
                 "train.decay_fraction": "--steps", "train.decay_shape": "--decay-shape",
                 "checkpoint.resume": "--step", "checkpoint.init_from": "--step", "run.name": "--name"}
        given = {".".join(parse_override(o)[0]) for o in overrides}
        taken = sorted((key, flag) for key, flag in owned.items() if key in given)
        if taken:
            raise ConfigError(f"a cooldown sets {', '.join(key for key, _ in taken)} itself (its decay from the run's "
                              f"checkpoint); drop the override{'s' if len(taken) > 1 else ''} and give "
                              f"{', '.join(sorted({flag for _, flag in taken}))} instead")
        branch = load_config(None, [*_as_overrides(branch), *overrides])
        if branch.model != cfg.model:
            changed = sorted(k for k, v in branch.model.model_dump().items() if cfg.model.model_dump()[k] != v)
            raise ConfigError(f"a cooldown resumes the run's checkpoint, so it keeps the run's model; drop the "
                              f"overrides of {', '.join(f'model.{k}' for k in changed)}")
        for path in branch.data.sources.values():  # (before the branch's config is written)
            read_index(path)
    _check_target(branch, run_dir, step, steps)
    if steps > step:  # (trained as asked: a long anneal is a choice, but rarely the intended one)
        log.warning("a cooldown of %d steps is longer than the %d steps it branches from: its decay is %.0f%% of the "
                    "branch's steps, where 10-20%% of a run's steps match a cosine schedule of that length (Hägele et "
                    "al. 2024); give --steps about %d for that", steps, step, 100 * steps / (step + steps),
                    max(1, round(step * 0.2 / 0.8)))
    if complete_checkpoints(branch.run_dir / "checkpoints"):  # a branch stopped and run again: from its own newest
        _check_same_schedule(branch)
        branch = branch.model_copy(update={"checkpoint": branch.checkpoint.model_copy(update={"resume": "auto"})})
    return branch


def _check_same_schedule(branch: RunConfig) -> None:
    """Refuse to resume a branch under another learning-rate schedule than it began with (another
    --decay-shape, or overrides of train.min_lr_ratio, say): its losses would be those of no single
    schedule, which a branch is for."""
    try:
        begun = load_config(branch.run_dir / "config.toml").train
    except (ConfigError, OSError):
        return  # (what the trainer's own resume check then says)
    changed = [key for key in SCHEDULE_KEYS if getattr(begun, key) != getattr(branch.train, key)]
    if changed:
        raise ConfigError(f"{str(branch.run_dir)!r} holds this branch begun with "
                          + ", ".join(f"train.{key} = {getattr(begun, key)!r}" for key in changed)
                          + f", not {', '.join(repr(getattr(branch.train, key)) for key in changed)}: resumed, it "
                          "would train no one schedule; give its --decay-shape and overrides to resume it, or --name "
                          "for a new branch")


def _check_target(branch: RunConfig, run_dir: Path, step: int, steps: int) -> None:
    """Refuse, before anything is written, a branch whose directory or config file holds what is
    not this branch's: the run itself, another run or branch, or a file of another run's config.
    The same branch run again (same run, step and steps) resumes."""
    target, name = branch.run_dir, branch.run.name
    if target.resolve() == run_dir.resolve():
        raise ConfigError(f"--name {name!r} is the run's own name: the branch would write into {str(run_dir)!r}; "
                          "give the branch a name of its own")
    mine = {"of": str(run_dir.resolve()), "step": step, "steps": steps}
    try:
        origin = json.loads((target / BRANCH_FILE).read_text())
    except (OSError, ValueError):
        origin = None
    if isinstance(origin, dict) and origin.get("of") == mine["of"] and origin.get("step") == step:
        if origin.get("steps") != steps:
            raise ConfigError(f"{str(target)!r} holds this run's branch from step {step} over {origin.get('steps')} "
                              f"steps; give --steps {origin.get('steps')} to resume it, or --name for a new branch")
        return
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        held = (f"a branch of {origin.get('of')!r} from step {origin.get('step')}" if isinstance(origin, dict)
                else "files of another run" if target.is_dir() else "a file")
        raise ConfigError(f"{str(target)!r} already holds {held}; give --name a new name for this branch")
    path = Path(branch.run.dir) / f"{name}.toml"
    if path.exists():
        try:
            same = load_config(path).run.name == name
        except (ConfigError, OSError, ValueError):
            same = False
        if not same:
            raise ConfigError(f"{str(path)!r} exists and is not a config of run {name!r}; give --name a new name for "
                              "this branch, or move that file")


def _as_overrides(cfg: RunConfig) -> list[str]:
    """cfg as dotted overrides (so that the user's own apply on top, validated together)."""
    from scaletrain.config import toml_value

    return [f"{section}.{key}={toml_value(value)}"
            for section, values in cfg.model_dump(exclude_none=True).items() for key, value in values.items()]


# In a branch's run directory: which run and step it branched from (for the run's report).
BRANCH_FILE = "branch.json"


def mark_branch(branch: RunConfig, run_dir: str | Path, step: int, steps: int) -> None:
    """Note in the branch's run directory where it came from."""
    branch.run_dir.mkdir(parents=True, exist_ok=True)
    (branch.run_dir / BRANCH_FILE).write_text(json.dumps(
        {"of": str(Path(run_dir).resolve()), "step": step, "steps": steps}) + "\n")


def branches_of(run_dir: str | Path) -> list[dict]:
    """The cooldown branches of the run in `run_dir` found beside it (run directories whose
    branch.json names it), by step: {"run_dir", "step", "steps"}."""
    run_dir = Path(run_dir).resolve()
    found = []
    for marker in sorted(run_dir.parent.glob(f"*/{BRANCH_FILE}")):
        try:
            origin = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if origin.get("of") == str(run_dir):
            found.append({"run_dir": marker.parent, "step": origin["step"], "steps": origin["steps"]})
    return sorted(found, key=lambda b: b["step"])

