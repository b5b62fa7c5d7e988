"""What a hang-up takes from a process: its terminal (closed, an SSH session lost), and a pipe or
socket it writes to (`| tee run.log`, ended with the terminal; an SSH session's own pipes).

A run answers SIGHUP by stopping with a checkpoint (train/resilience.py), and must not die on
its way there of a line it prints: once the terminal has hung up a write to it fails (EIO), and
one to a pipe whose reader is gone fails too (EPIPE, which Rich answers by ending the process).
`streams()` names the standard streams a hang-up would take, asked beforehand (a hung-up
terminal no longer answers as one); `detach()` points them at /dev/null. A broken pipe with no
SIGHUP (the reader gone alone) is a hang-up too: `Console` raises SIGHUP where the process
stops on it, and goes on silently where SIGHUP is ignored (`nohup`: the run was meant to outlive
its terminal, and the `tee` that went with it). What a run records (metrics.jsonl, checkpoints) goes to files, and is whole."""

from __future__ import annotations

import os
import signal
import stat

from rich.console import Console as RichConsole


def streams() -> tuple[int, ...]:
    """Which of this process's standard streams are a terminal, a pipe or a socket."""
    found = []
    for fd in (0, 1, 2):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:  # (closed)
            continue
        if os.isatty(fd) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            found.append(fd)
    return tuple(found)


def detach(fds: tuple[int, ...]) -> None:
    """Point the file descriptors `fds` at /dev/null."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class Console(RichConsole):
    """Rich's Console, where a reader gone (a broken pipe) is a hang-up: the stream points at
    /dev/null and, where the process answers SIGHUP (a run, which then stops with a checkpoint),
    SIGHUP is raised; where SIGHUP is ignored (nohup) the process goes on, its lines to /dev/null;
    elsewhere the command ends as Rich ends it (status 1). A worker of
    scaletrain.torchrun, whose output is the command's, sends it to that torchrun instead, which
    passes it to every worker (a worker stopping alone would be a failure to torchrun, answered
    by restarts); that torchrun itself waits for a worker to tell it so."""

    def on_broken_pipe(self) -> None:
        from scaletrain.torchrun import AGENT_PID  # (set in its process and for its workers)

        self.quiet = True
        detach((self.file.fileno(),))
        handler = signal.getsignal(signal.SIGHUP)
        if handler is signal.SIG_IGN:
            return
        if not callable(handler):
            raise SystemExit(1)
        agent = int(os.environ.get(AGENT_PID, "0"))
        if agent == os.getpid():
            return
        if agent and os.getppid() == agent:
            os.kill(agent, signal.SIGHUP)
        else:  # (alone, or a worker whose torchrun is gone)
            signal.raise_signal(signal.SIGHUP)
