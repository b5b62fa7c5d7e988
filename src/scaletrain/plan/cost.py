"""What a run costs beyond its step time: failures and the checkpoints that bound what they
lose, wall-clock, device-hours, energy and money — arithmetic, no torch.

Failures. Devices fail independently at `Reliability.failures_per_device_hour`; the default is
what Meta reported for Llama 3 405B: 419 unexpected interruptions in a 54-day snapshot of
training on 16,384 H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4),
one per ~50,700 device-hours. A job of n devices then fails every M = 1 / (rate x n) hours.

Checkpoints. Saving blocks training for δ seconds: with asynchronous saving, the copy of each
device's parameters and optimizer state to host memory (`host_copy_bandwidth`); otherwise
the write of the whole checkpoint (each replicated tensor once) to storage, at
`storage_per_node` bytes/s from each node up to `storage_total` for the filesystem. The
interval that loses least is Young's (1974, "A first order approximation to the optimum
checkpoint interval"), τ = sqrt(2 δ M), but never shorter than the write itself (an
asynchronous save waits for the previous one). Each failure then costs the restart
(`restart_s`: rescheduling, loading the checkpoint, compiling) and on average half an interval of recomputed steps, so the fraction of
wall-clock that trains — the goodput — is 1 - δ/τ - (R + τ/2)/M to first order (Daly 2006,
"A higher order estimate of the optimum checkpoint interval for restart dumps", whose
higher-order terms matter only when τ approaches M).

Energy is the devices' board power (at its maximum, an upper bound for the devices; hosts,
network and cooling enter only through the PUE, power usage effectiveness) over the
wall-clock. Cost is device-hours at the price given; there is no default price.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LLAMA3_FAILURES_PER_DEVICE_HOUR = 419 / (16384 * 54 * 24)


@dataclass(frozen=True)
class Reliability:
    failures_per_device_hour: float = LLAMA3_FAILURES_PER_DEVICE_HOUR
    restart_s: float = 600.0
    host_copy_bandwidth: float = 20e9  # bytes/s per device into pinned host memory
    storage_per_node: float = 5e9  # bytes/s a node writes to storage
    storage_total: float = 100e9  # bytes/s the filesystem takes from all nodes together
    async_save: bool = True


@dataclass(frozen=True)
class Prices:
    per_device_hour: float | None = None  # in the user's currency
    pue: float = 1.2
    watts: float | None = None  # per device; None: the device's maximum board power


@dataclass
class RunCost:
    steps: int
    step_s: float
    train_hours: float  # steps x step time: the run with nothing going wrong
    checkpoint_block_s: float
    checkpoint_write_s: float
    checkpoint_interval_s: float
    checkpoint_interval_steps: int
    mtbf_hours: float | None  # of the whole job; None when nothing fails
    expected_failures: float
    goodput: float
    wall_hours: float
    device_hours: float
    energy_kwh: float
    cost: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def checkpoint_interval(block_s: float, mtbf_s: float) -> float:
    """Young's optimum interval between checkpoints, in seconds."""
    return math.sqrt(2 * block_s * mtbf_s)


def goodput(block_s: float, interval_s: float, mtbf_s: float, restart_s: float) -> float:
    """Fraction of wall-clock that trains, to first order (see the module's docstring)."""
    return max(0.0, 1 - block_s / interval_s - (restart_s + interval_s / 2) / mtbf_s)  # mtbf inf: no failures


def run_cost(steps: int, step_s: float, devices: int, nodes: int, state_bytes_per_device: float,
             checkpoint_bytes: float, device_watts: float, reliability: Reliability = Reliability(),
             prices: Prices = Prices()) -> RunCost:
    """Wall-clock, failures, checkpoints, energy and cost of `steps` steps of `step_s` seconds
    on `devices` devices in `nodes` nodes, each holding `state_bytes_per_device` of
    checkpointed state, `checkpoint_bytes` in all (replicas counted once)."""
    rel = reliability
    write = checkpoint_bytes / min(rel.storage_per_node * nodes, rel.storage_total)
    block = state_bytes_per_device / rel.host_copy_bandwidth if rel.async_save else write
    if rel.failures_per_device_hour > 0:
        mtbf = 3600 / (rel.failures_per_device_hour * devices)
        interval = max(step_s, write, checkpoint_interval(block, mtbf))
    else:  # nothing fails: checkpoint hourly (for the run's own sake: evaluation, extension)
        mtbf = math.inf
        interval = max(step_s, write, 3600.0)
    interval_steps = max(1, math.ceil(interval / step_s))
    interval = interval_steps * step_s
    fraction = goodput(block, interval, mtbf, rel.restart_s)
    train_s = steps * step_s
    if fraction <= 0:
        wall_s = math.inf
    else:
        wall_s = train_s / fraction
    wall_hours = wall_s / 3600
    device_hours = wall_hours * devices
    watts = prices.watts if prices.watts is not None else device_watts
    energy = device_hours * watts * prices.pue / 1000
    cost = device_hours * prices.per_device_hour if prices.per_device_hour is not None else None
    return RunCost(steps=steps, step_s=step_s, train_hours=train_s / 3600, checkpoint_block_s=block,
                   checkpoint_write_s=write,
                   checkpoint_interval_s=interval, checkpoint_interval_steps=interval_steps,
                   mtbf_hours=mtbf / 3600 if math.isfinite(mtbf) else None,
                   expected_failures=wall_s / mtbf, goodput=fraction, wall_hours=wall_hours,
                   device_hours=device_hours, energy_kwh=energy, cost=cost)
