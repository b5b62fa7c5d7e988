"""What a run costs beyond its step time: failures and the checkpoints that bound what they
lose, wall-clock, device-hours, energy and money — arithmetic, no torch.

Failures. Devices fail independently at `Reliability.failures_per_device_hour`; the default is
what Meta reported for Llama 3 405B: 419 unexpected interruptions in a 54-day snapshot of
training on 16,384 H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4),
one per ~50,700 device-hours. A job of n devices then fails every M = 1 / (rate x n) hours.

Checkpoints. Saving blocks training for δ seconds: with asynchronous saving, the copy of each
device's parameters and optimizer state to host memory (`host_copy_bandwidth`); otherwise
the write of the whole checkpoint (each replicated tensor once) to storage, at
`storage_per_node` bytes/s from each node up to `storage_total` for the filesystem. A run is
then segments of τ seconds of steps, each ended by a save; a failure costs the restart R
(`restart_s`: rescheduling, loading the checkpoint, compiling) and the segment it struck.
With failures a Poisson process at the job's rate 1/M, during restarts too, a segment that
needs s seconds without a failure takes M e^(R/M) (e^(s/M) - 1) seconds on average (Daly 2006,
"A higher order estimate of the optimum checkpoint interval for restart dumps"), so the
whole run, its last segment shorter and ended by the final save written out, is a sum of such
terms. An asynchronous save is safe only once its write, W seconds behind the copy, has ended:
a failure in the first W seconds of the next segment restarts from the save before, and both
segments are lost. Counted from the moment the save before it is safe, a segment then needs s
seconds without a failure on its first try (W of its own already behind it, W past its end
until its save is safe) and, after a failure, the restart, all of s and W: on average
M (1 - e^(-s/M)) e^((R + W + s)/M), Daly's term with a restart of R + W. The sum is exact
under these assumptions at any ratio of τ, R, W or the run to M (each write ends before the
next save blocks, as the shortest interval ensures; the final save waits for the write before
it, and a restart from that save, once safe, has nothing to wait for). To first order it is
the familiar goodput 1 - δ/τ - (R + τ/2)/M, which over-counts the failures of a run shorter
than an interval (14.5 s on 131,072 devices: 26 s to first order, 23 s here) and goes below
zero where restarts outlast M. The interval that loses least is Daly's perturbation solution,
τ = sqrt(2δM) [1 + sqrt(δ/2M)/3 + (δ/2M)/9] - δ (Young 1974's sqrt(2δM) to first order;
τ = M once δ ≥ 2M; his figures' 117, 57 and 9.1 minutes for δ = 5 min at M = 24 h, 6 h and
15 min), as whole steps (the nearer of the two around it by the expected
wall-clock), but never shorter than the write itself (an asynchronous save waits for the
previous one).

Energy is the devices' board power (at its maximum, an upper bound for the devices; hosts,
network and cooling enter only through the PUE, power usage effectiveness) over the
wall-clock. Cost is device-hours at the price given; there is no default price.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    lost_to_failures: float  # the share of the wall-clock restarts and redone steps take
    goodput: float
    wall_hours: float
    device_hours: float
    energy_kwh: float
    cost: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def checkpoint_interval(block_s: float, mtbf_s: float) -> float:
    """Daly's optimum seconds of steps between checkpoints that each block for `block_s`."""
    if block_s >= 2 * mtbf_s:
        return mtbf_s
    x = block_s / (2 * mtbf_s)
    return math.sqrt(2 * block_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - block_s


def whole_steps(seconds: float, step_s: float, wall: Callable[[int], float], shortest: int = 1) -> int:
    """An interval of `seconds` as steps of `step_s`: the fewer or the more steps around it,
    whichever `wall` (steps -> expected wall-clock) finds shorter, and never under `shortest`."""
    return min({max(shortest, math.floor(seconds / step_s)), max(shortest, math.ceil(seconds / step_s))}, key=wall)


def _segment_s(first_s: float, retry_s: float, mtbf_s: float, restart_s: float) -> float:
    """Expected seconds to get through a segment that needs `first_s` seconds without a failure
    on its first try and, after a failure, the restart and `retry_s` (see the module's docstring)."""
    if not math.isfinite(mtbf_s):
        return first_s
    if (retry_s + restart_s) / mtbf_s > 700:  # beyond a float's exponent: never, in practice
        return math.inf
    return -mtbf_s * math.expm1(-first_s / mtbf_s) * math.exp((restart_s + retry_s) / mtbf_s)


def expected_wall_s(train_s: float, interval_s: float, block_s: float, final_s: float, mtbf_s: float,
                    restart_s: float, write_s: float = 0.0) -> float:
    """Expected wall-clock of `train_s` seconds of steps saved every `interval_s` seconds of them
    (each save blocking `block_s`, then written in the background for `write_s`, no longer than
    an interval; the last, written out before the run ends, `final_s`) under failures every
    `mtbf_s` on average (math.inf: none) that each cost `restart_s`."""
    full, last = divmod(train_s, interval_s)
    if last <= 1e-9 * interval_s and full:  # the run ends at a save: the last segment is a whole one
        full, last = full - 1, interval_s
    segment = interval_s + block_s
    if not full:
        return _segment_s(last + final_s, last + final_s, mtbf_s, restart_s)
    # The last: from the save before it safe, the rest of its steps (or the wait for that save's
    # write, which the final save needs ended) and the final save; after a failure, restarted
    # from that save with nothing left to wait for, all of its steps and the final save.
    return (_segment_s(segment + write_s, segment + write_s, mtbf_s, restart_s)
            + (full - 1) * _segment_s(segment, segment + write_s, mtbf_s, restart_s)
            + _segment_s(max(last, write_s) - write_s + final_s, last + final_s, mtbf_s, restart_s))


def run_cost(steps: int, step_s: float, devices: int, nodes: int, state_bytes_per_device: float,
             checkpoint_bytes: float, device_watts: float, reliability: Reliability = Reliability(),
             prices: Prices = Prices()) -> RunCost:
    """Wall-clock, failures, checkpoints, energy and cost of `steps` steps of `step_s` seconds
    on `devices` devices in `nodes` nodes, each holding `state_bytes_per_device` of
    checkpointed state, `checkpoint_bytes` in all (replicas counted once)."""
    rel = reliability
    write = checkpoint_bytes / min(rel.storage_per_node * nodes, rel.storage_total)
    block = state_bytes_per_device / rel.host_copy_bandwidth if rel.async_save else write
    train_s = steps * step_s
    mtbf = 3600 / (rel.failures_per_device_hour * devices) if rel.failures_per_device_hour > 0 else math.inf
    # (nothing fails: checkpoint hourly, for the run's own sake: evaluation, extension)
    best = checkpoint_interval(block, mtbf) if math.isfinite(mtbf) else 3600.0
    shortest = max(1, math.ceil(write / step_s))

    def wall(interval_steps: int, mtbf_s: float = mtbf) -> float:
        return expected_wall_s(train_s, interval_steps * step_s, block, write, mtbf_s, rel.restart_s,
                               write if rel.async_save else 0.0)

    interval_steps = whole_steps(best, step_s, wall, shortest)
    interval = interval_steps * step_s
    wall_s = wall(interval_steps)
    fraction = train_s / wall_s
    wall_hours = wall_s / 3600
    device_hours = wall_hours * devices
    watts = prices.watts if prices.watts is not None else device_watts
    energy = device_hours * watts * prices.pue / 1000
    cost = device_hours * prices.per_device_hour if prices.per_device_hour is not None else None
    return RunCost(steps=steps, step_s=step_s, train_hours=train_s / 3600, checkpoint_block_s=block,
                   checkpoint_write_s=write,
                   checkpoint_interval_s=interval, checkpoint_interval_steps=interval_steps,
                   mtbf_hours=mtbf / 3600 if math.isfinite(mtbf) else None,
                   expected_failures=wall_s / mtbf, lost_to_failures=1 - wall(interval_steps, math.inf) / wall_s,
                   goodput=fraction, wall_hours=wall_hours,
                   device_hours=device_hours, energy_kwh=energy, cost=cost)
