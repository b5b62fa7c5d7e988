"""Learning-rate schedules: a pure function of the step, so resuming needs no scheduler state."""

from __future__ import annotations

import math


def wsd_decay_start(total_steps: int, warmup_steps: int, decay_fraction: float) -> int:
    """The first update of a warmup-stable-decay run's decay: its last decay_fraction of updates
    (at least one), never inside the warmup."""
    return max(total_steps - max(round(decay_fraction * total_steps), 1), warmup_steps)


# How far the learning rate has fallen (0 to 1) at a fraction `progress` of a WSD decay.
DECAY_SHAPES = {
    "linear": lambda progress: progress,
    "1-sqrt": math.sqrt,  # Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"
    "cosine": lambda progress: 0.5 * (1.0 - math.cos(math.pi * progress)),
}


# The train.* settings a step's learning rate depends on, its number of steps given.
SCHEDULE_KEYS = ("lr", "min_lr_ratio", "schedule", "warmup_steps", "decay_fraction", "decay_shape", "steps")


def run_lr(cfg, step: int) -> float:
    """The learning rate of the update at `step` (0-based) of the run `cfg` (a RunConfig) describes."""
    train = cfg.train
    return lr_at(step, cfg.total_steps, lr=train.lr, warmup_steps=train.warmup_steps, schedule=train.schedule,
                 min_lr_ratio=train.min_lr_ratio, decay_fraction=train.decay_fraction, decay_shape=train.decay_shape)


def lr_at(step: int, total_steps: int, *, lr: float, warmup_steps: int, schedule: str,
          min_lr_ratio: float = 0.1, decay_fraction: float = 0.2, decay_shape: str = "linear") -> float:
    """Learning rate of the update made at `step` (0-based) of a run of `total_steps` updates.

    - warmup: linear from lr / warmup_steps to lr over the first warmup_steps updates;
    - "cosine": half a cosine from lr down to min_lr_ratio * lr at the last update;
    - "wsd": warmup-stable-decay (Hu et al. 2024, MiniCPM): lr until the last
      decay_fraction of updates, then down to min_lr_ratio * lr at the last, along
      decay_shape (DECAY_SHAPES: linear, 1-sqrt or cosine);
    - "constant": lr after warmup.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_ratio
    last = max(total_steps - 1, 1)
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        if step >= last:  # also when warmup leaves a single update after it
            return min_lr
        span = max(last - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_start = wsd_decay_start(total_steps, warmup_steps, decay_fraction)
        if step < decay_start:
            return lr
        progress = min((step - decay_start + 1) / max(total_steps - decay_start, 1), 1.0)
        return lr - (lr - min_lr) * DECAY_SHAPES[decay_shape](progress)
    raise ValueError(f"unknown schedule {schedule!r}; valid: cosine, wsd, constant")
