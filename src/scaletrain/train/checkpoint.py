"""Checkpoints in the Distributed Checkpoint (DCP) format, even in one process.

    checkpoints/step_0000100/   .metadata, *.distcp   written by torch.distributed.checkpoint
    checkpoints/step_0000100/COMMITTED                written last: {step, tokens, files: {name: [bytes, crc32]}}
    checkpoints/step_0000100/REWOUND                  written after a divergence rewound to it:
                                                      {loader, diverged_at, skipped_steps}
    checkpoints/latest                                name of the newest complete checkpoint

A checkpoint directory without its COMMITTED marker, or whose files differ in size from
what the marker recorded, is incomplete and never resumed from. DCP keeps no checksums of
tensor data, so the marker records a CRC-32 of every file, checked before loading: a
damaged checkpoint is reported rather than silently loaded. Under torch.distributed the ranks
share the checksumming, at the save and at the load: each reads its share of the files, so the
job reads the checkpoint once, not once per rank. `latest` is a convenience for
people and tools; resuming scans the directories, so a crash between the marker and the
pointer loses nothing. `REWOUND` is not part of the checkpoint's files: it records where the
data stood when training went back to this checkpoint, so that a run resumed from it skips the
batches that led to the divergence, as the rewound run did (see `record_rewind`).
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
import zlib
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from scaletrain.errors import UserError

log = logging.getLogger("scaletrain")
# DCP warns on every call without a process group (one process is a supported case here), also
# from the thread of a background save, so the filter is the process's, not a context's.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MARKER = "COMMITTED"
REWOUND = "REWOUND"
PREFIX = "step_"
LOCK_FILE = ".lock"  # (a run directory's: hold_run_dir)


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint where one was asked for."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose save did not finish, or whose files are not those it wrote: an older
    one may stand in for it."""


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:07d}"


def _sizes(path: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file() and f.name not in (MARKER, REWOUND)}


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _share(names: list[str], group=None) -> list[str]:
    """This rank's share of `names`, split among the ranks of `group` (all of them for one process)."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank(group)::dist.get_world_size(group)]


def _gather(value, group=None) -> list:
    """`value` from every rank of `group`, in rank order (this process's alone without a group)."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def save(root: Path, step: int, tokens: int, state: dict, keep: int, keep_every: int = 0,
         scheduled: bool = True) -> Path:
    """Write `state` as checkpoint `step`, mark it complete, point `latest` at it, and keep the
    `keep` newest complete checkpoints up to this step and those of steps that are multiples of
    `keep_every` (when not 0); older ones are deleted. A checkpoint not `scheduled` (a stop's,
    between the run's checkpoint steps) serves its resume but is no rewind's target, and takes no
    scheduled one's place among the `keep` (see _commit)."""
    path = _prepare(root, step)
    try:
        dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # (DCP's own exception is a BaseException)
        if (full := _disk_full(path, e)) is not None:
            raise full from None  # (lasting: a restart would find the disk as full)
        raise
    _commit(root, path, step, tokens, (keep, keep_every), scheduled=scheduled)
    return path


FULL_DISK_BYTES = 64 * 2**20  # free space below which a failed write is put down to a full disk


def _causes(error: BaseException):
    """`error`, what it was raised from, and the ranks' failures a CheckpointException gathers
    (each an (exception, its stack) pair)."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__,
                  *(failure[0] if isinstance(failure, tuple) else failure
                    for failure in getattr(e, "failures", {}).values())]


def _disk_full(path: Path, error: BaseException) -> CheckpointError | None:
    """For a save of `path` that failed with `error` where its disk is full, the error to raise
    instead, one sentence saying so (the writer's own error may not: DCP's can be a RuntimeError
    from torch.save's zip writer), with the unfinished directory removed (it is never resumed
    from, and holds the space the next try needs); None where the disk has room."""
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _causes(error))
    try:
        usage = shutil.disk_usage(path.parent)
        free = usage.free if usage.total else None  # (a filesystem that reports no size says nothing of space)
    except OSError:
        free = None
    if not full and (free is None or free >= FULL_DISK_BYTES):
        return None
    try:
        written = sum(_sizes(path).values())
    except OSError:  # (gone: removed by the main rank meanwhile)
        written = 0
    if _is_main():
        shutil.rmtree(path, ignore_errors=True)
    previous = next((sum(_sizes(p).values()) for p in complete_checkpoints(path.parent)), None)
    need = f"; the last checkpoint took {previous / 1e6:,.1f} MB" if previous else ""
    return CheckpointError(f"checkpoint {str(path)!r} could not be written: the disk holding it is full "
                           f"({written / 1e6:,.1f} MB written before it ran out{need}); free space there (or keep "
                           "fewer checkpoints: checkpoint.keep, checkpoint.keep_every) and resume")


class AsyncSave:
    """A checkpoint being written in the background by `save_async`. `done()` says whether the
    writing, and the checksums of what was written, have finished; `wait()` waits for them,
    then commits the checkpoint (marker, `latest`, older ones pruned), once. Until then the
    directory has no marker and is never resumed from. The checksums are taken in a background
    thread too (zlib releases the GIL): over a large model's state they take seconds, which the
    training thread would otherwise spend at the commit."""

    def __init__(self, root: Path, path: Path, step: int, tokens: int, keep: tuple[int, int], future,
                 group=None, scheduled: bool = True) -> None:
        self.root, self.path, self.step, self.tokens, self.keep = root, path, step, tokens, keep
        self.scheduled = scheduled
        self._future, self._committed = _background().submit(self._written, future, group), False

    def _written(self, future, group) -> dict:
        try:
            future.result()  # raises what the writer raised
        except (Exception, CheckpointException) as e:
            if (full := _disk_full(self.path, e)) is not None:
                raise full from None
            raise
        # On the save's own group, after DCP's last collective on it and before the next
        # save's first (the trainer finishes one save before starting the next).
        return _file_table(self.path, group)

    def done(self) -> bool:
        return self._future.done()

    def settle(self, timeout_s: float = 300.0) -> None:
        """Let the writing end (or `timeout_s` pass), committing nothing and raising nothing: on
        an error's way out, before the run directory is given up."""
        concurrent.futures.wait([self._future], timeout=timeout_s)

    def wait(self) -> Path:
        if not self._committed:
            _commit(self.root, self.path, self.step, self.tokens, self.keep, self._future.result(), self.scheduled)
            self._committed = True
        return self.path


_BACKGROUND = None


def _background():
    """The thread that finishes background saves, one after another."""
    global _BACKGROUND
    if _BACKGROUND is None:
        from concurrent.futures import ThreadPoolExecutor

        _BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
    return _BACKGROUND


def save_async(root: Path, step: int, tokens: int, state: dict, keep: int, group=None, stager=None,
               keep_every: int = 0, scheduled: bool = True) -> AsyncSave:
    """Start writing `state` as checkpoint `step` and return once it has been copied to host
    memory, so that training can go on changing the live tensors. Under torch.distributed,
    `group` must be a process group of its own (gloo): DCP's background collectives on the
    group training uses interleave with training's and deadlock or corrupt it. `stager` (see
    pinned_stager) is DCP's default, pageable copies, when None. A stager that fails (a host may
    refuse to lock memory: a sandbox, a locked-memory limit) is closed and DCP's copies taken
    instead, with a warning; the AsyncSave's `stager_refused` says so, for the caller to stop
    passing it. (It fails before any of the save's collectives, so a rank that falls back still
    meets the others.)"""
    path = _prepare(root, step)

    def start(stager):
        return dcp.async_save(state, checkpoint_id=path, process_group=group, no_dist=not dist.is_initialized(),
                              async_stager=stager)
    refused = False
    try:
        future = start(stager)
    except Exception as e:  # (should the save itself be what fails, it fails again below, without the stager)
        if stager is None:
            raise
        log.warning("checkpoint.async_save: copying the state to page-locked memory failed (%s: %s); copying it "
                    "to pageable memory instead", type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        stager.close()
        _clear_cuda_error()
        refused, future = True, start(None)
    if hasattr(future, "staging_completion"):  # an asynchronous stager: the copy must end before training goes on
        future.staging_completion.result()
        future = future.upload_completion
    saving = AsyncSave(root, path, step, tokens, (keep, keep_every), future, group, scheduled)
    saving.stager_refused = refused
    return saving


def _clear_cuda_error() -> None:
    """Take a failed call's error off CUDA's per-thread last error, where it stays (a refused
    cudaHostRegister, through torch's pin_memory utility) until the next kernel launch's check reads
    it and fails that kernel's op instead: a small kernel is launched here and its error dropped."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError as e:
        log.debug("checkpoint.async_save: a CUDA error was left by the refused copy: %s", e)


def pinned_stager(pinned: bool = True):
    """A stager copying GPU state into page-locked host buffers (the copy runs at the link's full
    speed); with pinned=False into pageable ones (what a CPU can test). Its buffers are allocated
    (and locked) at the first save and copied into at each one after, so only the first save's
    blocking pays for allocating and locking them (the next save overwrites them: the trainer ends
    one save before it starts another). None where this torch has no such stager. The caller closes
    it after the last save."""
    try:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
        from torch.distributed.checkpoint.staging import AsyncStager
    except ImportError:
        return None

    class KeptStager(AsyncStager):
        """DCP's own copier of a state dict into host memory (torch's DefaultStager runs it too),
        kept from one save to the next: torch 2.11's DefaultStager releases the buffers after each
        copy (and fails on its next: KeyError), 2.13's keeps them; this is the same on both."""
        _synchronize_after_execute = False  # (stage returns once the copy has landed)

        def __init__(self):
            self.copier = StateDictStager(pin_memory=pinned, share_memory=False)

        def stage(self, state_dict):
            staged = self.copier.stage(state_dict, non_blocking=pinned)
            if pinned:  # the copies were queued on the stream: they must land before training goes on
                torch.cuda.synchronize()
            return staged

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            self.copier.close()

    return KeptStager()


def unwritable(root: Path) -> str | None:
    """Why a run could not save checkpoints under `root`, in one sentence, or None: a file where it
    or a step's directory goes (or a link to nothing), or a directory it may not write (a read-only
    filesystem, no permission), which the first save would find only after the steps before it."""
    if root.exists() and not root.is_dir():
        return f"{str(root)!r} is a file where the run keeps its checkpoints; move it away or choose another run.name"
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(PREFIX) and entry.name[len(PREFIX):].isdigit() and not entry.is_dir():
                what = "a link to nothing" if entry.is_symlink() and not entry.exists() else "a file"
                return f"{str(entry)!r} is {what} where the run saves a checkpoint's directory; move it away or delete it"
    where = next(p for p in (root, *root.parents) if p.exists() or p.is_symlink())
    effective = os.access in os.supports_effective_ids  # (the ids the process writes with, as a setuid one does)
    if where.is_dir() and not os.access(where, os.W_OK | os.X_OK, effective_ids=effective):
        return (f"checkpoints cannot be written under {str(where)!r} (a read-only filesystem, or no permission to "
                "write there); make it writable or give another run.dir")
    return None  # (a file on the way to it: the run's own mkdir says so)


def _prepare(root: Path, step: int) -> Path:
    path = checkpoint_dir(root, step)
    if _is_main():
        if path.exists():  # a leftover of an interrupted save of this step
            shutil.rmtree(path)
        path.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    return path


def _file_table(path: Path, group=None) -> dict[str, list[int]]:
    """Each file of a written checkpoint: [size, CRC-32], as its marker records them. Every rank
    of `group` takes part and gets the whole table: the files are those the group's first rank
    sees (rank 0 writes DCP's metadata last), and each rank checksums its share of them. A rank
    that cannot read its share makes every rank raise, rather than leave them waiting."""
    listing = [None]
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        try:
            listing = [_sizes(path)]
        except OSError as e:
            listing = [f"{path} cannot be listed ({e})"]
    if dist.is_initialized():
        dist.broadcast_object_list(listing, group=group, group_src=0)
    sizes = listing[0]
    try:
        mine = sizes if isinstance(sizes, str) else {
            name: [sizes[name], _crc32(path / name)] for name in _share(sorted(sizes), group)}
    except OSError as e:
        mine = f"a file of {path} cannot be read back to checksum it ({e})"
    parts = _gather(mine, group)
    failed = [part for part in parts if isinstance(part, str)]
    if failed:
        raise OSError(f"checkpoint not committed: {failed[0]}")
    return dict(sorted(item for part in parts for item in part.items()))


def _commit(root: Path, path: Path, step: int, tokens: int, keep: tuple[int, int], files: dict | None = None,
            scheduled: bool = True) -> None:
    """Mark `path` complete (one process writes) and prune older checkpoints but the newest and
    those kept for good, `keep` = (how many newest, multiple of the steps kept; 0: none). Every rank
    calls it (the checksums are shared) unless `files`, its _file_table, was already taken.

    A checkpoint not `scheduled` (a stop's) takes no scheduled one's place among the `keep` newest:
    it is kept while `keep` has room beside them, so that the run keeps every checkpoint a run that
    never stopped keeps, which a rewind goes back to (scheduled ones only: the same in both)."""
    files = files if files is not None else _file_table(path)
    if not _is_main():
        return
    _write_atomic(path / MARKER, json.dumps({"step": step, "tokens": tokens, "files": files,
                                             **({} if scheduled else {"scheduled": False})}, indent=1))
    _write_atomic(root / "latest", path.name + "\n")
    newest, every = keep
    for unfinished in [p for p in all_checkpoints(root) if step_of(p) < step and not (p / MARKER).exists()]:
        shutil.rmtree(unfinished, ignore_errors=True)  # saves that never finished: never resumed from
    older = [p for p in complete_checkpoints(root) if step_of(p) < step]
    kept = [p for p in older if is_scheduled(p)][:newest - 1 if scheduled else newest]
    kept += [p for p in older if not is_scheduled(p)][:max(newest - 1 - len(kept), 0)]
    for old in [p for p in older if p not in kept and not (every and step_of(p) % every == 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def record_rewind(path: Path, loader: dict, diverged_at: int, skipped_steps: int) -> None:
    """Record beside checkpoint `path` that training went back to it after diverging at step
    `diverged_at`, with the data at `loader` (past the batches since the checkpoint). One process
    writes it, atomically; a later rewind to the same checkpoint replaces it."""
    if _is_main():
        _write_atomic(path / REWOUND, json.dumps({"loader": loader, "diverged_at": diverged_at,
                                                  "skipped_steps": skipped_steps}, indent=1))


def discard_after(root: Path, step: int, group=None) -> list[str]:
    """Remove the checkpoints of steps after `step` (those of a history a rewind abandoned, so
    that no resume takes them up again); returns their names. Every rank calls it: all list the
    directory before one removes them, and all return once they are gone."""
    newer = [p for p in all_checkpoints(root) if step_of(p) > step]
    if dist.is_initialized():
        dist.barrier(group)
    if _is_main():
        for path in newer:
            shutil.rmtree(path, ignore_errors=True)
        kept = complete_checkpoints(root)
        if kept:
            _write_atomic(root / "latest", kept[0].name + "\n")
    if dist.is_initialized():
        dist.barrier(group)
    return [p.name for p in newer]


def rewound(path: Path) -> dict | None:
    """What `record_rewind` recorded beside `path`, or None."""
    try:
        return json.loads((path / REWOUND).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise CheckpointError(f"{path / REWOUND} is unreadable ({e}); it records the data position a divergence "
                              "skipped to — delete it to read those batches again") from e


def bytes_on_disk(root: Path) -> int:
    """The bytes of the files of the checkpoint directories under `root` not yet committed (0 if
    none): they grow while one is written (the watchdog's sign that a long save is not a hang),
    whatever its step beside the others' (a leftover of a later step, say)."""
    total = 0
    for path in all_checkpoints(root):
        try:
            if not (path / MARKER).exists():
                total += sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
        except FileNotFoundError:  # (removed meanwhile: pruned, or a leftover replaced)
            continue
    return total


def marker(path: Path) -> dict:
    """What the COMMITTED marker of a complete checkpoint records: step, tokens, files."""
    return json.loads((path / MARKER).read_bytes())


def is_scheduled(path: Path) -> bool:
    """Whether a complete checkpoint was saved at one of its run's checkpoint steps, not only
    because the run stopped there (a stop's serves its resume; a rewind goes back to scheduled ones)."""
    try:
        return marker(path).get("scheduled", True)
    except (OSError, ValueError):
        return True


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def check_complete(path: Path, verify: bool = False) -> str | None:
    """None if `path` is a complete checkpoint, else why not. `verify` also checks every file's
    CRC-32; under torch.distributed every rank must then call it, and each checks a share of the
    files (all get the same answer)."""
    try:
        problem, recorded = _check_marker_and_sizes(path)
        if verify and problem is None:
            for name in _share(sorted(recorded)):
                if _crc32(path / name) != recorded[name][1]:
                    problem = f"file {name} does not match the checksum recorded when it was written (corrupted)"
                    break
    except OSError as e:  # every rank still reaches the gather below
        problem = f"it cannot be read ({e})"
    if not verify:
        return problem
    return next((p for p in _gather(problem) if p is not None), None)


def _check_marker_and_sizes(path: Path) -> tuple[str | None, dict[str, tuple[int, int]]]:
    """(why `path` is incomplete or None, the marker's {file: (size, CRC-32)})."""
    marker = path / MARKER
    if not marker.is_file():
        return "it has no COMMITTED marker (the save did not finish)", {}
    try:
        recorded = json.loads(marker.read_bytes())["files"]
        recorded = {str(name): (int(size), int(crc)) for name, (size, crc) in recorded.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return "its COMMITTED marker is unreadable", {}
    actual = _sizes(path)
    for name, (size, _) in recorded.items():
        if name not in actual:
            return f"file {name} is missing", recorded
        if actual[name] != size:
            return f"file {name} is {actual[name]} bytes, {size} were written (truncated or changed)", recorded
    return None, recorded


def all_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under root, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=step_of, reverse=True)


def complete_checkpoints(root: Path, say_damaged: bool = False) -> list[Path]:
    """The complete checkpoints under root, newest first. `say_damaged`: warn (once a process) of
    each one whose save finished and that is damaged since, which a reader of checkpoints chosen by
    their order (the newest, an average's earlier ones) passes over; a save still being written
    (a run in progress) is not said."""
    complete = []
    for path in all_checkpoints(root):
        problem = check_complete(path)
        if problem is None:
            complete.append(path)
        elif say_damaged and (path / MARKER).is_file() and path not in _SAID_DAMAGED:
            _SAID_DAMAGED.add(path)
            log.warning("checkpoint %s is damaged (%s): passed over", path, problem)
    return complete


_SAID_DAMAGED: set[Path] = set()


def no_complete_checkpoint(run_dir: Path) -> CheckpointError:
    """The error of a run directory without a complete checkpoint, saying why: none saved yet,
    saves that never finished, or checkpoints damaged since (the newest's problem named)."""
    found = all_checkpoints(Path(run_dir) / "checkpoints")
    where = f"run directory {str(run_dir)!r}"
    if not found:
        return CheckpointError(f"{where} has no checkpoint yet; train it past its first save (checkpoint.interval)")
    committed = [p for p in found if (p / MARKER).is_file()]
    steps = ", ".join(str(step_of(p)) for p in (committed or found))
    if not committed:
        return CheckpointError(f"{where} has no complete checkpoint: its saves of steps {steps} never finished; train "
                               "it again to save one")
    return CheckpointError(f"{where} has no complete checkpoint: those of steps {steps} are damaged (step "
                           f"{step_of(committed[0])}: {check_complete(committed[0])}); train it again from the "
                           "start, or restore them from a copy")


def with_earlier(path: Path, count: int) -> list[Path]:
    """The complete checkpoint `path` and the count - 1 complete ones of its run just before it,
    oldest first (what an average of `count` checkpoints ending at `path` takes); CheckpointError
    when fewer are kept."""
    earlier = [p for p in complete_checkpoints(path.parent, say_damaged=True) if step_of(p) < step_of(path)][:count - 1]
    if len(earlier) < count - 1:
        raise CheckpointError(f"an average of {count} checkpoints ending at step {step_of(path)} needs {count - 1} "
                              f"complete checkpoints before it in {path.parent}, which keeps {len(earlier)}; average "
                              "fewer, choose a later step, or keep more (checkpoint.keep, checkpoint.keep_every)")
    return [*reversed(earlier), path]


def hold_run_dir(run_dir: Path, wait_s: float = 0.0):
    """Lock `run_dir` for the run training in it (an exclusive flock of run_dir/.lock, released by
    release_run_dir or when the process ends, however it ends), waiting up to `wait_s` for
    another holder to let go: (the lock, None), or (None, a sentence saying who holds it). A
    filesystem without locks gives (None, None): the run goes on."""
    path = run_dir / LOCK_FILE
    try:
        held = open(path, "a+")
    except OSError:
        return None, None
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            held.seek(0)
            holder = held.read().strip() or "a process"
            if time.monotonic() < deadline:
                if not said:
                    log.warning("waiting for %s, which holds run directory %s, to end (%.0f s at most)", holder,
                                run_dir, wait_s)
                    said = True
                time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
                continue
            held.close()
            return None, (f"run directory {str(run_dir)!r} is in use by another run ({holder}); wait for it to end, or "
                          "choose another run.name")
        except OSError:  # (no locks on this filesystem)
            held.close()
            return None, None
    return held, None


def sign_run_dir(held) -> None:
    """Write who holds the lock hold_run_dir took into its file, for the message of a run refused
    (once it trains: an invocation that finds nothing to do leaves the directory as it was)."""
    if held is None:
        return
    try:  # (no more than a courtesy)
        held.seek(0)
        held.truncate()
        held.write(f"process {os.getpid()} on {socket.gethostname()}, since "
                   f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}\n")
        held.flush()
    except OSError:
        pass


def release_run_dir(held) -> None:
    """Give up the lock hold_run_dir took (None: nothing held)."""
    if held is not None:
        fcntl.flock(held, fcntl.LOCK_UN)
        held.close()


def committed_checkpoints(root: Path) -> list[Path]:
    """Checkpoints whose save finished (they have a marker), whether or not damaged since."""
    return [p for p in all_checkpoints(root) if (p / MARKER).is_file()]


def saved_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Every entry of checkpoint `path` as DCP names it ("model.layers.0.attention.wq.weight",
    "optim.state.….exp_avg"), with its (global) shape; None for what is not a tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # unpickling a damaged .metadata raises anything
        raise CheckpointError(f"checkpoint {path} could not be read ({type(e).__name__}: {e})") from e
    return {name: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            for name, entry in saved.items()}


# What a section of a checkpoint's state holds, for saying that one lacks it.
SECTIONS = {"ema": "moving average of the weights (its run trained with train.ema_decay = 0: drop --ema)",
            "optim": "optimizer state"}


def load(path: Path, state: dict, optional: tuple[str, ...] = ()) -> None:
    """Load checkpoint `path` into `state` in place (tensors are filled, other values replaced).
    Entries of `state` named in `optional` ("section.key") that the checkpoint lacks are
    removed from it instead of failing the load (e.g. the CUDA generator's state when a run
    checkpointed on a CPU resumes on a GPU). Raises CheckpointDamaged for a save that did not
    finish or files that changed, CheckpointError when intact files do not fit `state`."""
    problem = check_complete(path, verify=True)
    if problem:
        raise CheckpointDamaged(f"checkpoint {path} is not usable: {problem}")
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name in optional:
        section, key = name.split(".", 1)
        if name not in saved and isinstance(state.get(section), dict):
            state[section].pop(key, None)
    sections = {name.split(".", 1)[0] for name in saved}
    for section, value in state.items():
        if isinstance(value, dict) and value and section not in sections:
            raise CheckpointError(f"checkpoint {path} holds no {SECTIONS.get(section, repr(section) + ' entries')}")
    try:
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        cause = (str(e).strip().splitlines() or [""])[-1]  # DCP wraps the cause in a traceback; its last line
        raise CheckpointError(f"checkpoint {path} could not be read ({type(e).__name__}: {cause})") from e


def load_newest(root: Path, state: dict, optional: tuple[str, ...] = (), at_most: int | None = None,
                scheduled_only: bool = False) -> Path | None:
    """Load the newest checkpoint under root that is complete and intact (of step `at_most` or
    earlier, if given; a scheduled one, if `scheduled_only`); None if root holds none.

    Incomplete or damaged newer checkpoints are reported and skipped, so a crash during a save,
    or a damaged file, costs one checkpoint interval and nothing else. An intact checkpoint that
    fails to load (it does not fit `state`, or reading failed) is raised, not skipped: an older
    one would fail alike or silently lose an interval. If checkpoints exist but none can be
    loaded, that is an error: starting again from step 0 would overwrite the run. (A load that
    fails part-way may have filled some of `state`; a later successful load overwrites every
    entry, so nothing of the damaged checkpoint survives.)
    """
    problems = []
    for path in all_checkpoints(root):
        if at_most is not None and step_of(path) > at_most:
            continue
        if scheduled_only and check_complete(path) is None and not is_scheduled(path):
            continue
        try:
            load(path, state, optional)
            return path
        except CheckpointDamaged as e:
            problems.append(str(e))
            log.warning("skipping %s; falling back to the previous checkpoint", e)
    if problems:
        raise CheckpointError(f"none of the {len(problems)} checkpoints in {root} can be loaded "
                              f"({'; '.join(problems)}); move them aside to start the run again")
    return None
