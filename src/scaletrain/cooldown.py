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
from pathlib import Path

from scaletrain.config import ConfigError, RunConfig, load_config, run_config_file, validate_config
from scaletrain.data.shards import read_index
from scaletrain.train.checkpoint import check_complete, complete_checkpoints, step_of
from scaletrain.train.schedule import DECAY_SHAPES, lr_at


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
    begun = complete_checkpoints(Path(cfg.run.dir) / (name or f"{cfg.run.name}-cooldown-{step}") / "checkpoints")
    if not begun and (not checkpoint.is_dir() or check_complete(checkpoint) is not None):
        # (A branch that has begun resumes its own checkpoints: the run may have pruned step's since.)
        kept = [step_of(p) for p in complete_checkpoints(run_dir / "checkpoints")]
        raise ConfigError(f"{str(run_dir)!r} has no complete checkpoint of step {step}; it has "
                          + (", ".join(map(str, sorted(kept))) if kept else "none") + " (checkpoint.keep_every keeps "
                          "more of them for branching)")
    train = cfg.train
    schedule = dict(lr=train.lr, warmup_steps=train.warmup_steps, schedule=train.schedule,
                    min_lr_ratio=train.min_lr_ratio, decay_fraction=train.decay_fraction,
                    decay_shape=train.decay_shape)
    at = lr_at(step, cfg.total_steps, **schedule)  # the rate of the update after the checkpoint
    if step < train.warmup_steps or at != train.lr:
        raise ConfigError(f"the run's learning rate after step {step} is {at:.3g}, not its peak train.lr = "
                          f"{train.lr:g} ({train.schedule} schedule{', in its warmup' if step < train.warmup_steps else ''})"
                          "; a cooldown branches from the stable stretch of a 'wsd' or 'constant' schedule")
    if decay_shape is not None and decay_shape not in DECAY_SHAPES:
        raise ConfigError(f"decay shape {decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}")
    data = cfg.model_dump()
    total = step + steps
    data["run"]["name"] = name or f"{cfg.run.name}-cooldown-{step}"
    data["train"].update(schedule="wsd", steps=total, tokens=None, decay_fraction=steps / total,
                         decay_shape=decay_shape or train.decay_shape)
    data["checkpoint"].update(resume=str(checkpoint.resolve()), init_from=None)
    branch = validate_config(data, source="the cooldown's config")
    if overrides:
        branch = load_config(None, [*_as_overrides(branch), *overrides])
        if branch.model != cfg.model:
            changed = sorted(k for k, v in branch.model.model_dump().items() if cfg.model.model_dump()[k] != v)
            raise ConfigError(f"a cooldown resumes the run's checkpoint, so it keeps the run's model; drop the "
                              f"overrides of {', '.join(f'model.{k}' for k in changed)}")
        for path in branch.data.sources.values():  # (before the branch's config is written)
            read_index(path)
    if complete_checkpoints(branch.run_dir / "checkpoints"):  # a branch stopped and run again: from its own newest
        branch = branch.model_copy(update={"checkpoint": branch.checkpoint.model_copy(update={"resume": "auto"})})
    return branch


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

