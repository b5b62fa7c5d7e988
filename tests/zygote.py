"""Processes for the tests, forked from one that has already imported torch and scaletrain.

Starting Python and importing torch with DTensor and DCP (which the trainer needs) costs 7 s of
CPU per process on the 2-core machines this suite runs on, and the suite starts about a hundred
such processes: `scaletrain` commands, and the ranks of multi-process runs. A multiprocessing
forkserver imports those modules once per test process; every process forked from it is a new OS
process with the environment, working directory, arguments and standard streams it is given, as
a user's `scaletrain` command or a torchrun rank has, started in 0.2 s instead of 7-10 s.

What only a fresh interpreter shows stays tested by fresh interpreters: the entry point
(`python -m scaletrain.cli` with `fresh=True`), torchrun under `scaletrain train --nproc`, a
command sent signals or killed (tests start those with subprocess), and `scaletrain` importing
what it needs by itself (the forkserver preloads only libraries, never `scaletrain.cli`).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What most processes the tests start import: the trainer (torch, DTensor, DCP), the fits (SciPy)
# and the plots (Matplotlib). Imported by the forkserver when the first process is started.
PRELOAD = ["torch", "scaletrain.train.trainer", "scipy.optimize", "matplotlib.pyplot"]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _child(target: Callable, args: tuple, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: the environment, directory and standard streams it was given, then
    `target(*args)`, then what an interpreter does at exit (its non-daemon threads joined, its
    atexit functions run). multiprocessing exits with target's SystemExit code (0 on return)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    if "OMP_NUM_THREADS" in env:  # (torch may have sized its thread pool in the forkserver)
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        target(*args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        threading._shutdown()
        atexit._run_exitfuncs()


def _command(argv: list[str]) -> None:
    """`scaletrain ARGV`: its exit status as the process's."""
    sys.argv = ["scaletrain", *argv]
    from scaletrain.cli import main

    sys.exit(main(argv))


def _start(target: Callable, args: tuple, env: dict[str, str], logs: Path, name: str):
    process = _CONTEXT.Process(target=_child, args=(target, args, env, str(logs / f"{name}.out"),
                                                    str(logs / f"{name}.err")))
    process.start()
    return process


def _wait(processes: list, timeout: float, describe: str) -> None:
    """Wait for every process; when one fails, end the others (they would wait for it in a
    collective until its timeout); past `timeout`, end them all and raise TimeoutExpired."""
    pending = {p.sentinel: p for p in processes}
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            for p in processes:
                p.kill()
                p.join()
            raise subprocess.TimeoutExpired(describe, timeout)
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=left):
            process = pending.pop(sentinel)
            process.join()
            if process.exitcode != 0:
                for other in pending.values():
                    other.kill()
                    other.join()
                pending.clear()
                break


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def run_cli(*args: str, timeout: float = 300, fresh: bool = False) -> subprocess.CompletedProcess:
    """`scaletrain ARGS` in a new process, from the project's root, as a user runs it: forked from
    the preloaded forkserver, or a fresh interpreter with `fresh`. Its output is captured."""
    env = {**os.environ, "COLUMNS": "200"}
    if fresh:
        return subprocess.run([sys.executable, "-m", "scaletrain.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)
    return _run_one(_command, (list(args),), env, timeout, ["scaletrain", *args])


def _run_one(target: Callable, args: tuple, env: dict[str, str], timeout: float, argv: list[str]
             ) -> subprocess.CompletedProcess:
    """`target(*args)` in one process forked from the forkserver, in `env`; `argv`: what it stands
    for, in the result and in a timeout's message."""
    with tempfile.TemporaryDirectory(prefix="process-") as logs:
        process = _start(target, args, env, Path(logs), "process")
        _wait([process], timeout, " ".join(argv))
        return subprocess.CompletedProcess(argv, process.exitcode, _read(Path(logs) / "process.out"),
                                           _read(Path(logs) / "process.err"))


def script(path: str, argv: list[str]) -> None:
    """`python PATH ARGV` in this process (PATH absolute or relative to the project's root): the
    script run as __main__, its folder first on sys.path. A target for `run_ranks`."""
    import runpy

    sys.argv = [path, *argv]
    sys.path.insert(0, str((ROOT / path).parent))
    runpy.run_path(str(ROOT / path), run_name="__main__")


def run_script(path: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python PATH ARGS` (PATH relative to the project's root, e.g. one of benchmarks/) in a new
    process forked from the preloaded forkserver, in the tests' environment. Its output is captured."""
    return _run_one(script, (path, list(args)), dict(os.environ), timeout, ["python", path, *args])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable, args: tuple, nproc: int, timeout: float) -> subprocess.CompletedProcess:
    """`target(*args)` in nproc processes with torchrun's environment for one node (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the ranks of one job,
    over gloo (one torch thread each unless OMP_NUM_THREADS says otherwise, as torchrun sets).
    When one fails the others are ended, as torchrun does. Returns the ranks' return code (the
    first failure's) and their outputs, each line prefixed with its rank."""
    port = _free_port()  # (taken by another between here and rank 0's bind: a transient failure, retried)
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        processes = []
        for rank in range(nproc):
            env = {"OMP_NUM_THREADS": "1", **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
            processes.append(_start(target, args, env, Path(logs), f"rank{rank}"))
        _wait(processes, timeout, f"{nproc} ranks of {getattr(target, '__name__', target)}")
        codes = [p.exitcode for p in processes]
        failed = [c for c in codes if c not in (0, -signal.SIGKILL)]
        code = failed[0] if failed else max(codes, key=abs)
        outputs = {kind: "".join(f"[rank{rank}] {line}\n" for rank in range(nproc)
                                 for line in _read(Path(logs) / f"rank{rank}.{kind}").splitlines())
                   for kind in ("out", "err")}
    return subprocess.CompletedProcess([str(target), *map(str, args)], code, outputs["out"], outputs["err"])
