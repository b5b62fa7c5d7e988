"""torchrun, run in this process for `train --nproc`, `eval --nproc` and the job files of `launch`
(`python3 -m scaletrain.torchrun TORCHRUN_ARGS`), with three differences from torch's own:

- **A stop signal is answered once.** On SIGTERM torchrun sends SIGTERM to its workers, which
  stop after a step with a checkpoint (train/resilience.py), and waits for them. It answers
  every signal so, and a second one during that wait raises out of it: torchrun ended in a
  traceback and its workers went unwaited, killed with a Slurm job step (Slurm signals every
  process of a step) before their checkpoint was written. Here the stop signals (SIGTERM,
  SIGUSR1, SIGHUP) after the first are ignored. SIGINT (Ctrl-C) still ends everything at once.
- **SIGUSR1 stops as SIGTERM does** (Slurm's `--signal=USR1@...`; torchrun would die of it and
  leave its workers behind), **and so does SIGHUP** (the terminal closed, an SSH session lost:
  torchrun passed it on, and the workers died of it without a checkpoint). It is passed on as
  SIGHUP, for the workers to stop writing to the terminal as this process does
  (scaletrain/hangup.py): a write to a hung-up terminal fails. Under `nohup`, which
  ignores SIGHUP, it stays ignored, here and in the workers (torchrun answered it).
- **A refusal comes back as one line.** Bad input found only once the workers run (a run whose
  every checkpoint is damaged, say) fails them, and torchrun answers a failure by starting
  every worker again, --max-restarts times, to be refused again. A worker instead hands its
  lasting refusal over (hand_over, from cli._refused): it writes the line to the file named by
  REFUSAL_FILE and waits to be stopped, neither failing nor ending (its peers' collectives
  would fail at once, and torchrun restart them all). Seeing the file, run() stops every
  worker and returns the line for the caller to say (exit status 2). In launch's Slurm script
  the node then ends the job step on every node (end_step): the others would wait on it.

Workers that restart must not read stale addresses from the store torchrun shares across
attempts (pytorch issues #135712, #167288): TORCH_DISABLE_SHARE_RDZV_TCP_STORE is set for them.

The rendezvous's keep-alive timer (torch.distributed.elastic.rendezvous.utils._PeriodicTimer)
stops its thread with a finalizer that joins it. Where the timer's last reference goes in its own
thread (the rendezvous handler dropped while a keep-alive runs), that is a join of the current
thread: "Exception ignored ... RuntimeError: cannot join current thread", a traceback at the end of
a job that had ended well or said its one line. The timers run() starts are stopped without
joining themselves (_stop_timer)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REFUSAL_FILE = "SCALETRAIN_REFUSAL_FILE"  # (set for the workers)
REFUSAL_WAIT_S = 120.0  # the longest a refusing worker waits to be stopped (its torchrun gone, say)
# The process id of run()'s process, for its workers (hangup.Console: a reader gone is told to it).
AGENT_PID = "SCALETRAIN_AGENT_PID"
# When the first torchrun of the command started (unix seconds), for its workers: `train
# --time-limit` counts from it, not from a worker's own start (a restarted worker's is later).
LAUNCHED = "SCALETRAIN_LAUNCHED"
# Set (to 1) by launch's Slurm script: a refusal ends the job step on every node (end_step).
END_STEP_ON_REFUSAL = "SCALETRAIN_END_STEP_ON_REFUSAL"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
# What torchrun answers by stopping its workers: its own list, and SIGUSR1.
HANDLED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _stop_timer(thread: threading.Thread, stop_event: threading.Event) -> None:
    """torch's _PeriodicTimer._stop_thread, but from the timer's own thread it stops the thread
    without joining it (module doc)."""
    stop_event.set()
    if thread is not threading.current_thread():
        thread.join()


def run(torchrun_args: list[str]) -> tuple[int, str | None]:
    """torchrun with `torchrun_args` (as its command line takes them) in this process, from its
    main thread. Returns the exit status (128 + the signal's number when a signal stopped it)
    and a worker's refusal, if one refused (the status is then 2)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("scaletrain.torchrun.run answers signals, which only the main thread can")
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import utils as rendezvous_utils

    from scaletrain import hangup

    received: list[int] = []
    running = [True]  # (a signal after torchrun returned, the watcher's or a user's, ends nothing)
    raise_signal = api._terminate_process_handler  # (torch's: raises SignalException in the main thread)
    lost = hangup.streams()
    # A signal this process ignores stays ignored, by it and by the workers that inherit that:
    # SIGHUP under `nohup`, which torch's torchrun answers by ending its workers all the same.
    handled = [name for name in HANDLED.split(",") if signal.getsignal(signal.Signals[name]) is not signal.SIG_IGN]

    def answer(signum, frame):
        stopping = any(s in STOP_SIGNALS for s in received)
        received.append(signum)
        if signum == signal.SIGHUP:
            hangup.detach(lost)  # (whenever it comes: what this process says next would fail)
        if not running[0]:
            return
        if signum in STOP_SIGNALS:
            if stopping:
                return  # (the workers are saving: torchrun waits for them)
            if signum != signal.SIGHUP:
                signum = signal.SIGTERM  # (what the workers stop on, whichever came)
        raise_signal(signum, frame)

    with tempfile.TemporaryDirectory(prefix="scaletrain-") as scratch:
        refusal = Path(scratch) / "refusal"
        env = {REFUSAL_FILE: str(refusal), AGENT_PID: str(os.getpid()), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               LAUNCHED: os.environ.get(LAUNCHED) or str(time.time())}
        # (and what torchrun sets in its own process: restored as they were)
        saved_env = {key: os.environ.get(key) for key in (*env, "OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE")}
        saved_handlers = {signum: signal.getsignal(signum) for signum in (*STOP_SIGNALS, signal.SIGINT,
                                                                          signal.SIGHUP, signal.SIGQUIT)}
        done = threading.Event()

        elastic_levels: dict[str, int] = {}

        def watch():  # stops every worker once one refused (it waits for that: hand_over)
            while not done.wait(0.2):
                if refusal.exists():
                    # (what torchrun says of stopping them, three warnings, would come before the one line)
                    for name, logger in list(logging.root.manager.loggerDict.items()):
                        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
                            elastic_levels[name] = logger.level
                            logger.setLevel(logging.ERROR)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

        watcher = threading.Thread(target=watch, name="scaletrain-refusal", daemon=True)
        os.environ.update(env)
        api._terminate_process_handler = answer  # (torchrun installs it as it starts the workers)
        timer = getattr(rendezvous_utils, "_PeriodicTimer", None)  # (each timer takes it as it starts)
        stop_thread = timer.__dict__.get("_stop_thread") if timer is not None else None
        if stop_thread is not None:
            timer._stop_thread = staticmethod(_stop_timer)
        try:
            if os.getpid() == 1:
                # A container's first process ignores a signal it has no handler for: answered from
                # here, not only once torchrun starts the workers (elsewhere the default ends a stop
                # during the rendezvous at once, also where the rendezvous blocks in C++, which
                # holds off a handler written in Python).
                for signum in STOP_SIGNALS:
                    if signum.name in handled:
                        signal.signal(signum, answer)
            watcher.start()
            try:
                torchrun.main([f"--signals-to-handle={','.join(handled)}", *torchrun_args])
                code = 0
            except api.SignalException:
                code = 128 + received[0] if received else 1
            except ChildFailedError as e:  # (what torchrun ends with: which worker failed, how)
                print(f"{type(e).__name__}: {e}", file=sys.stderr)
                code = 1
            except KeyboardInterrupt:  # (Ctrl-C before torchrun answers it)
                code = 128 + signal.SIGINT
            except Exception as e:  # (a rendezvous that failed or timed out, a store not reached)
                print(f"torchrun ended: {type(e).__name__}: {str(e) or 'see its arguments'}", file=sys.stderr)
                code = 1
        finally:
            running[0] = False
            done.set()
            if watcher.is_alive():
                watcher.join()
            api._terminate_process_handler = raise_signal
            if stop_thread is not None:
                timer._stop_thread = stop_thread
            for name, level in elastic_levels.items():
                logging.getLogger(name).setLevel(level)
            for signum, handler in saved_handlers.items():
                signal.signal(signum, handler)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if refusal.exists():
            return 2, refusal.read_text()
        return code, None


def hand_over(message: str) -> bool:
    """In a worker of run(): hand a lasting refusal to it (REFUSAL_FILE) and wait to be stopped
    (run() stops every worker on seeing it; ending now would fail the collectives of the ranks
    that did not refuse, which torchrun would answer by restarting them all). False where this
    is not such a worker, or the file cannot be written (run() is gone, and its folder with it):
    the caller says the refusal itself. True, after REFUSAL_WAIT_S, where nothing stopped it."""
    path = os.environ.get(REFUSAL_FILE)
    if path is None:
        return False
    mine = f"{path}.{os.getpid()}"
    try:  # (written whole, then moved into place: never read half-written)
        Path(mine).write_text(message)
        os.replace(mine, path)
    except OSError:
        return False
    parent, deadline = os.getppid(), time.monotonic() + REFUSAL_WAIT_S
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def end_step() -> None:
    """In a Slurm job step (launch's script sets END_STEP_ON_REFUSAL), after this node's workers
    refused their input: SIGKILL to the step's processes on every node. Where only this node
    refuses (a path missing here), the others would wait on it in a collective until it timed out
    (train.hang_timeout_s + 60 s), then in their restart's rendezvous; they have nothing to save
    (a checkpoint takes every rank). The step then fails, and with it the job, which is not
    requeued (a failed job is not)."""
    if os.environ.get(END_STEP_ON_REFUSAL) != "1" or "SLURM_STEP_ID" not in os.environ:
        return
    step = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
    try:
        subprocess.run(["scancel", "--signal=KILL", step], timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"scancel of job step {step} failed ({e}); the other nodes end at their timeouts", file=sys.stderr)


if __name__ == "__main__":
    status, refused = run(sys.argv[1:])
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr, flush=True)
        end_step()
    sys.exit(status)
