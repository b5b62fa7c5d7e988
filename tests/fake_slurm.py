"""Stand-ins for Slurm's commands, for running launch's batch script on one machine
(test_distributed; install() puts `srun`, `scancel` and `scontrol` in a folder for PATH).

- srun runs its command once a node (SLURM_NNODES), each in the folder nodeN of where it is
  called (a node's own filesystem, where a path may be missing), as step 0 of the job, the others
  once the first listens on the rendezvous's port (it hosts the rendezvous); it records
  its own process id in SLURM_TASKS_FILE (its tasks' processes are its descendants: it adopts
  those orphaned, as slurmstepd holds a step's processes), kills what is left of a task once its
  own process has ended (as slurmstepd does), and ends with the highest status (128 + N for a
  signal N), as srun does.
- scancel --signal=SIG JOB.STEP sends SIG to every process of the step; without --signal it
  does as Slurm does to a cancelled job: SIGTERM, and SIGKILL to what is left after
  KILL_WAIT_S. It records its arguments (SLURM_TASKS_FILE + ".scancel").
- scontrol answers `show hostnames` with this machine's address."""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

KILL_WAIT_S = 5.0
PR_SET_CHILD_SUBREAPER = 36  # (linux/prctl.h)


def _descendants(root: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    more = {root}
    while more:
        found |= more
        more = {pid for pid, parent in parents.items() if parent in more} - found
    return found - {root}


def _wait_for(port: str, task: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until something listens on `port` here (or `task` ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and task.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", int(port))) == 0:
                return
        time.sleep(0.1)


def srun(command: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    Path(os.environ["SLURM_TASKS_FILE"]).write_text(str(os.getpid()))
    endpoint = next((a.split("=", 1)[1] for a in command if a.startswith("--rdzv-endpoint=")), None)
    tasks = []
    for node in range(int(os.environ["SLURM_NNODES"])):
        env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_STEP_ID": "0"}
        tasks.append(subprocess.Popen(command, cwd=f"node{node}", env=env))
        if node == 0 and endpoint:  # (the first node hosts the rendezvous, as on Slurm the first host does)
            _wait_for(endpoint.rsplit(":", 1)[1], tasks[0])
    # As slurmstepd: once a task's own process has ended, what is left of it is killed.
    left = {task.pid: set() for task in tasks}
    while any(task.poll() is None for task in tasks) or any(left.values()):
        for task in tasks:
            if task.poll() is None:
                left[task.pid] = _descendants(task.pid)
            elif left[task.pid]:
                for pid in left[task.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                left[task.pid] = set()
        time.sleep(0.1)
    return max(code if code >= 0 else 128 - code for code in (task.returncode for task in tasks))


def scancel(args: list[str]) -> int:
    tasks = Path(os.environ["SLURM_TASKS_FILE"])
    Path(f"{tasks}.scancel").write_text(" ".join(args))
    signum = next((signal.Signals[f"SIG{a.split('=', 1)[1]}"] for a in args if a.startswith("--signal=")), None)
    if os.fork():  # (the killer outlives the step's processes, this one among them)
        return 0
    os.setsid()
    if signum is None:
        end_tasks(tasks, KILL_WAIT_S)
    else:
        for pid in _descendants(int(tasks.read_text())) - {os.getpid()}:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    return 0


def end_tasks(tasks: Path, kill_wait_s: float) -> None:
    """SIGTERM to every process of the step srun recorded in `tasks`, SIGKILL to those left after
    `kill_wait_s` (the test's cleanup, too, whatever happened)."""
    if not tasks.exists():
        return
    victims = _descendants(int(tasks.read_text())) - {os.getpid()}
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + kill_wait_s
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in victims):
            time.sleep(0.1)


def install(folder: Path) -> None:
    """Put srun, scancel and scontrol, and python3 (this Python), in `folder` (for PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("srun", "scancel", "scontrol"):
        (folder / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "{__file__}" {name} "$@"\n')
    (folder / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for tool in folder.iterdir():
        tool.chmod(0o755)


if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    if name == "srun":
        sys.exit(srun(args))
    if name == "scancel":
        sys.exit(scancel(args))
    if name == "scontrol" and args[:1] == ["show"] and args[1:2] == ["hostnames"]:
        print("127.0.0.1")
        sys.exit(0)
    sys.exit(f"fake_slurm: {name} {' '.join(args)} is not faked")
