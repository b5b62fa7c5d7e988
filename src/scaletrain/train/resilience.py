"""Ending well when a run cannot go on: a preemption notice costs a step or two, a hang costs
the work since the last checkpoint, not the rest of the job's allocation.

**Signals.** Schedulers announce the end of a job with a signal and kill it a grace period later: Slurm
sends SIGTERM on preemption (and, with `--signal=TERM@T`, T seconds before the time limit),
Kubernetes SIGTERM before SIGKILL (30 s by default), torchrun forwards SIGTERM to its workers
and kills them 30 s later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torch ≥ 2.13). `StopSignals` turns SIGTERM, SIGUSR1 and
SIGHUP into a request: the loop ends a step later with a checkpoint, and `train()` raises
`StoppedBySignal`. SIGHUP is a terminal closed under a run (an SSH session lost), which would
otherwise end it with the work since the last checkpoint; the process's output then goes
nowhere (scaletrain/hangup.py), as writing to the closed terminal would fail. Ctrl-C (SIGINT)
still interrupts at once: a terminal sends it to torchrun and to every worker, and torchrun
sends it again, so a "second Ctrl-C aborts" rule could not tell a user's second press.

Under torch.distributed the ranks must stop after the same step, or the one that stops first
leaves the others in a collective; the signal may reach them during different steps. Every
step, each rank posts whether it has been signalled to a MAX all-reduce on a gloo group of its
own (CPU tensors; it never waits for the GPU), without waiting for it, and reads the result
posted a step earlier, which every rank reads alike. A signal during step s thus ends the run
after step s + 2 on every rank (s + 1 in one process).

**Hangs.** A rank stuck outside a collective (a filesystem that stopped answering, a deadlock)
or inside one that no timeout ends holds the whole job, and nothing fails. `Watchdog` is a
thread that expects a beat (a step, an evaluation or a checkpoint finished) every `timeout_s`;
without one it prints every thread's stack, says so and ends the process with status 75
(EX_TEMPFAIL: try again). torchrun then stops the other workers and, given `--max-restarts`,
starts them all again; they resume from the newest checkpoint. It is armed after the first
step, whose compilation and first collectives may take long. A checkpoint being written is
not a hang however long it takes, as long as it is still being written: once the loop has been
silent for half the timeout, the watchdog looks at the bytes of the newest checkpoint directory
(the one being written) every timeout / 8 (at most every minute), and a change counts as a beat
(a filesystem that stopped answering changes nothing, and a look that does not return within a
few seconds counts as no change). What it reports is the time since the last step, evaluation
or checkpoint finished.

**Loss spikes.** A loss that jumps well above its recent level without becoming NaN is the
usual first sign of an instability that ruins a large run, and the remedy that saved PaLM's
runs was to go back to a checkpoint from before it and skip the batches read since (Chowdhery et
al. 2022, section 5.1). `loss_spike` keeps a running mean and variance of the loss on the device
and flags a step whose loss exceeds the mean by more than a number of running standard
deviations (OLMo 2 counted losses beyond 7 as spikes: Team OLMo 2024, "2 OLMo 2 Furious"); the
trainer then rewinds as for a NaN.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from scaletrain import hangup
from scaletrain.errors import Stopped

log = logging.getLogger("scaletrain")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
HANG_EXIT_STATUS = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, worth a retry


def loss_spike(stats: torch.Tensor, loss: torch.Tensor, sigmas: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge one step's loss against the steps before it and fold it into their statistics.

    `stats` is (steps seen, running mean, running variance, last loss), as tensors on the device,
    so that no step waits for the host. The step is a spike when at least `window` steps have
    been seen and its loss exceeds the running mean by more than `sigmas` standard deviations;
    only a rise counts (a loss that falls is training). The mean is a plain average over the
    first window / 2 steps, then an exponential one with a span of `window` steps (weight
    2 / (window + 1)). The variance is estimated alike from successive differences, half the
    mean square of loss_t - loss_t-1 (von Neumann et al. 1941): the loss's fall over the window
    would swell the spread about the mean many times over early in a run (measured:
    benchmarks/spike_scores.py), but barely changes from one step to the next. A spike is folded
    in too, so that a run that goes on past one (no rewinds left) judges its next steps against
    where the loss now is; a loss that is not finite is left out (that is a divergence of its
    own). Returns (new stats, spike)."""
    seen, mean, var, last = stats.unbind()
    finite = torch.isfinite(loss)
    spike = finite & (seen >= window) & (loss - mean > sigmas * var.clamp_min(0).sqrt())
    floor = 2 / (window + 1)
    weight = torch.clamp(1 / (seen + 1), min=floor)
    step_weight = torch.where(seen >= 1, torch.clamp(1 / seen.clamp_min(1), min=floor), torch.zeros_like(seen))
    updated = torch.stack([seen + 1, mean + weight * (loss - mean),
                           (1 - step_weight) * var + step_weight * (loss - last) ** 2 / 2, loss])
    return torch.where(finite, updated, stats), spike


class StoppedBySignal(Stopped):
    """Training ended early on a signal, after saving a checkpoint of `step`; running the same
    command resumes it. `code` is the exit status a shell gives a process the signal ended."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step = signum, step
        self.code = 128 + signum
        where = f" with a checkpoint at {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}{where}; run the same "
                         "command to continue")


TIME_LIMIT = 1000  # what a rank votes to stop at `train --time-limit` with (beyond every signal's number)


class StoppedAtTimeLimit(Stopped):
    """Training ended at `train --time-limit`, after saving a checkpoint of `step`: not a
    failure (status 0, which torchrun restarts nothing for); running the same command resumes it."""

    code = 0

    def __init__(self, deadline: float, step: int, checkpoint: str | None):
        self.step = step
        where = f" with a checkpoint at {checkpoint}" if checkpoint else ""
        at = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(deadline))
        super().__init__(f"stopped at the time limit ({at}) after step {step}{where}; run the same command to "
                         "continue")


def stop_name(reason: int | None) -> str | None:
    """An end record's stopped_by: the signal's name, or "time_limit"."""
    if reason is None:
        return None
    return "time_limit" if reason == TIME_LIMIT else signal.Signals(reason).name


class StopSignals:
    """Between install() and uninstall(): SIGTERM, SIGUSR1 and SIGHUP are recorded instead of
    ending the process (SIGHUP also detaches it from its terminal, which is gone), and
    `stop_before_next_step()` says, the same on every rank, when to stop. A signal the process
    ignores stays ignored (SIGHUP under `nohup`: the run goes on when its terminal closes).

    Handlers can only be installed from the main thread; when training runs in another thread,
    signals keep their previous meaning and this never asks to stop."""

    def __init__(self, group=None):
        self.group = group  # a gloo group used for nothing else; None in one process
        self.received: int | None = None  # the first signal this process got
        self._previous: dict[int, object] = {}
        self._lost: tuple[int, ...] = ()  # (the standard streams a hang-up takes: hangup.streams)
        self._vote: torch.Tensor | None = None
        self._work = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._lost = hangup.streams()
            for signum in SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:  # (`nohup` ignores SIGHUP: kept so)
                    self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self, finished: bool) -> None:
        """Restore the previous handlers. `finished`: the loop ended normally on every rank, so
        each posted as many votes and the last one completes; after an error another rank may
        never post it, and it is not waited for."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._work is not None and finished:
            self._work.wait()
        self._work = None

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGHUP:
            hangup.detach(self._lost)
        if self.received is None:
            self.received = signum

    def stop_before_next_step(self, deadline: float | None = None) -> int | None:
        """The signal to stop on (or TIME_LIMIT, once time.time() has reached `deadline` on a
        rank) if the step about to run is to be the last, else None. Every rank calls it once
        before each step."""
        if deadline is not None and self.received is None and time.time() >= deadline:
            self.received = TIME_LIMIT
        if self.group is None:
            return self.received
        agreed = None
        if self._work is not None:
            self._work.wait()
            agreed = int(self._vote.item()) or None
        self._vote = torch.tensor([self.received or 0], dtype=torch.int64)
        self._work = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed


class Watchdog:
    """Ends the process with HANG_EXIT_STATUS when, after the first `beat()`, the next does not
    come within `timeout_s` seconds (0: never). `on_hang(seconds)` runs first, e.g. to record the
    hang; the stacks go to stderr. `progress()`, if given, returns a value that changes while
    work the loop may be waiting for still advances (the bytes of a checkpoint being written):
    after half the timeout without a beat it is looked at every timeout / 8 (at most every
    minute: on a parallel filesystem every rank's look lists the checkpoint's files), and a
    change puts the deadline off as a beat does."""

    PROBE_S = 5.0  # the longest a look at `progress` may take before it counts as no change

    def __init__(self, timeout_s: float, on_hang: Callable[[float], None] | None = None,
                 progress: Callable[[], object] | None = None):
        self.timeout_s, self.on_hang, self.progress = timeout_s, on_hang, progress
        self._last: float | None = None  # the deadline counts from here; disarmed until the first beat
        self._beat: float | None = None  # the last beat itself (what the messages report)
        self._seen = None  # what progress() returned at the last look, while the loop was silent
        self._looked = float("-inf")  # when
        self._probe: threading.Thread | None = None
        self._done = threading.Event()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="scaletrain-watchdog", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        self._last = self._beat = time.monotonic()
        self._seen = None

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _advanced(self) -> bool:
        """Whether progress() changed since the last look (the first look only takes a value)."""
        if self.progress is None or (self._probe is not None and self._probe.is_alive()):
            return False  # nothing to look at, or the last look never returned (a stuck filesystem)
        looked: list = []

        def look() -> None:
            try:
                looked.append(self.progress())
            except OSError:
                pass
        self._looked = time.monotonic()
        self._probe = threading.Thread(target=look, name="scaletrain-watchdog-probe", daemon=True)
        self._probe.start()
        self._probe.join(timeout=self.PROBE_S)
        if not looked:
            return False
        seen, self._seen = self._seen, looked[0]
        return seen is not None and looked[0] != seen

    def _watch(self) -> None:
        while not self._done.wait(min(self.timeout_s / 4, 5.0)):
            if self._last is None:
                continue
            now = time.monotonic()
            if now - self._last < self.timeout_s / 2:
                continue
            quiet = now - self._beat  # since something last finished
            if now - self._looked >= min(60.0, self.timeout_s / 8) and self._advanced():
                log.warning("nothing finished in %.0f s, but a checkpoint is still being written: not a hang", quiet)
                self._last = time.monotonic()  # not beat(): the next look compares with this one
                continue
            if now - self._last < self.timeout_s:
                continue
            log.error("no step, evaluation or checkpoint finished in %.0f s (train.hang_timeout_s = %g): the "
                      "stacks of every thread follow; exiting with status %d so that the launcher restarts the "
                      "job from its newest checkpoint", quiet, self.timeout_s, HANG_EXIT_STATUS)
            try:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                if self.on_hang is not None:
                    # In a thread of its own, waited for a few seconds only: on a filesystem that
                    # stopped answering (one of the hangs this is for), recording it blocks too.
                    record = threading.Thread(target=self.on_hang, args=(quiet,), daemon=True)
                    record.start()
                    record.join(timeout=5)
            finally:
                os._exit(HANG_EXIT_STATUS)  # the main thread is stuck: nothing else would end the process
