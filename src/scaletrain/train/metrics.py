"""metrics.jsonl: one JSON object per event, appended and flushed as it happens; the same
records' numbers, optionally, as TensorBoard scalars and in a Weights & Biases run; and traces
of chosen steps from the PyTorch profiler.

Every record has `kind` ("train", "eval", "checkpoint", "resume", "end", ...), `step`,
`tokens` and `time` (unix seconds). A resumed run appends a "resume" record; records of an
earlier invocation with a step past the resumed one (work lost with a crash) are superseded,
and `read_metrics` drops them so the history reads as one run. A "rewind" record (a divergence
sent the run back to a checkpoint) supersedes the records past its step alike; TensorBoard is
told to drop them too (purge_step). Weights & Biases keeps the first value logged at a step:
after a resume it keeps the interrupted invocation's records (the same losses, resume being
exact; only timings differ), after a rewind the diverged steps' records, not the retrained ones.

The file is strict JSON, which every reader takes (jq, JavaScript, Go, pandas): a value that is
not finite (a diverged step's loss, an infinite gradient norm) is written as null, and the
record lists it under "nonfinite" as [key, ..., "NaN" | "Infinity" | "-Infinity"];
`read_metrics` gives the floats back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path

import torch

from scaletrain.config import ConfigError

log = logging.getLogger("scaletrain")

# The records whose numbers go to TensorBoard and W&B, as "kind/key" (and "kind/key/name" for a
# dict of numbers, such as eval's loss_by_source).
TRACKED = ("train", "eval", "checkpoint")


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers by tracker name: {"train/loss": 2.31, "eval/loss_by_source/code": ...}."""
    if record["kind"] not in TRACKED:
        return {}
    out = {}
    for key, value in record.items():
        if key in ("kind", "step", "time"):
            continue
        for name, number in (value.items() if isinstance(value, dict) else [(None, value)]):
            if isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number):
                out["/".join(part for part in (record["kind"], key, name) if part)] = number
    return out


class TensorBoardSink:
    """Scalars in run_dir/tensorboard (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, log_dir: Path, resumed_from: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # Resumed: events of an earlier invocation past the checkpoint are superseded.
        self.writer = SummaryWriter(str(log_dir), purge_step=None if resumed_from is None else resumed_from + 1)

    def record(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"], walltime=record["time"])
        if record["kind"] == "rewind":  # the steps past it are trained again: their new events replace the old
            self.writer.close()
            self.writer = type(self.writer)(self.writer.log_dir, purge_step=record["step"] + 1)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One Weights & Biases run per run directory: its id is kept in run_dir/wandb_id, so every
    invocation (a resume included) logs to the same run."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        import wandb

        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir),
                                  config=config)
        except Exception as e:  # not logged in, no network, a project the account cannot write to
            raise ConfigError(f"log.wandb_project = {project!r}: Weights & Biases did not start ({e}); run "
                              "`wandb login`, or set WANDB_MODE=offline to log locally and `wandb sync` later") from None

    def record(self, record: dict) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()


NONFINITE = "nonfinite"


def json_line(record: dict) -> str:
    """One line of strict JSON: non-finite floats as null, named under NONFINITE (module doc)."""
    found: list[list] = []

    def finite(value, path):
        if isinstance(value, float) and not math.isfinite(value):
            found.append([*path, "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"])
            return None
        if isinstance(value, dict):
            return {key: finite(item, (*path, str(key))) for key, item in value.items()}  # (JSON's keys are strings)
        if isinstance(value, (list, tuple)):
            return [finite(item, (*path, i)) for i, item in enumerate(value)]
        return value

    record = finite(record, ())
    if found:
        record[NONFINITE] = found
    return json.dumps(record, allow_nan=False)


def _restore_nonfinite(record: dict) -> dict:
    """json_line's inverse: the floats a record names under NONFINITE, back in their places."""
    for *path, value in record.pop(NONFINITE, None) or ():
        try:
            *parents, last = path
            place = record
            for key in parents:
                place = place[key]
            if place[last] is None:
                place[last] = float(value.lower().replace("infinity", "inf"))
        except (LookupError, TypeError, ValueError, AttributeError):
            continue  # (edited by hand: what cannot be put back stays null)
    return record


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True, sinks: list | None = None):
        """enabled=False (ranks other than 0) builds records but writes nothing. sinks: trackers
        (TensorBoardSink, WandbSink) that each record is also given to."""
        self.path, self._file, self.sinks = path, None, sinks or []
        if not enabled:
            return
        if path.is_file() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"  # a crash mid-write left half a line: end it
        else:
            torn = False
        self._file = open(path, "a")
        if torn:
            self._file.write("\n")

    def write(self, kind: str, step: int, tokens: int, **values) -> dict:
        record = {"kind": kind, "step": step, "tokens": tokens, "time": round(time.time(), 3), **values}
        if self._file is not None:
            self._file.write(json_line(record) + "\n")
            self._file.flush()
        for sink in self.sinks:
            sink.record(record)
        return record

    def write_from_any_rank(self, kind: str, step: int, tokens: int, **values) -> dict:
        """write(), also on the ranks that write nothing else: a record only the rank it happened
        on knows of (a hang: the hung rank's watchdog may end the job before rank 0's sees it).
        One write of one line to the file opened for appending, so that the lines of ranks writing
        at once stay whole (on a local or POSIX filesystem). Not given to the sinks of rank 0."""
        if self._file is not None:
            return self.write(kind, step, tokens, **values)
        record = {"kind": kind, "step": step, "tokens": tokens, "time": round(time.time(), 3), **values}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json_line(record) + "\n").encode())
        finally:
            os.close(fd)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for sink in self.sinks:
            sink.close()


class Heartbeat:
    """`heartbeat.json` in the run directory: the time and step of an invocation's last finished
    step, rewritten at most every EVERY seconds. After a crash it tells how long the process
    went on training past its last record — work no record tells of, lost with it — which the next
    invocation's resume record carries (`last_alive`; report/goodput.py counts that time as steps
    redone, not as time between invocations). A hung process stops beating at its last step."""

    NAME = "heartbeat.json"
    EVERY = 1.0  # seconds between beats, at least

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path, self.enabled, self.last = Path(run_dir) / self.NAME, enabled, -math.inf

    def beat(self, step: int, force: bool = False) -> None:
        """Record `step` as finished now, unless the last beat is under EVERY seconds old (`force`:
        whatever its age; an invocation's end, whose beat is then its last moment alive)."""
        now = time.time()
        if self.enabled and (force or now - self.last >= self.EVERY):
            partial = self.path.with_suffix(".tmp")
            partial.write_text(json.dumps({"time": round(now, 3), "step": step}))
            os.replace(partial, self.path)  # (a crash mid-write leaves the previous beat)
            self.last = now

    @classmethod
    def read(cls, run_dir: Path) -> dict | None:
        """The last beat of a run directory's earlier invocations, if one wrote any."""
        try:
            return json.loads((Path(run_dir) / cls.NAME).read_text())
        except (OSError, ValueError):
            return None


class StepProfiler:
    """The PyTorch profiler over steps [first, last] (log.profile_steps) of this process: CPU
    operators, and on a GPU its kernels, with shapes and memory, written when the last of them
    (or the run) ends as a Chrome trace, run_dir/profile/steps_FIRST-LAST_rankR.json, which
    Perfetto (ui.perfetto.dev) or chrome://tracing opens. Each step is a range named "step N"."""

    def __init__(self, steps: list[int] | None, folder: Path, rank: int, cuda: bool):
        self.first, self.last = steps if steps else (0, -1)
        self.folder, self.rank, self.cuda = folder, rank, cuda
        self.profiler, self.traced = None, []

    def step(self, step: int):
        """A context for running step `step` (1-based): traced when in [first, last]."""
        if not self.first <= step <= self.last:
            return contextlib.nullcontext()
        if self.profiler is None:  # the first step traced (a resumed run may start past `first`)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.start()
        self.traced.append(step)
        return torch.autograd.profiler.record_function(f"step {step}")

    def after(self, step: int, last: bool) -> None:
        """After step `step`; `last`: the run stops after it."""
        if self.profiler is not None and (step >= self.last or last):
            self.close()

    def close(self) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.folder / f"steps_{self.traced[0]}-{self.traced[-1]}_rank{self.rank}.json"))
        self.profiler = None


def process_started() -> float | None:
    """When this process started, in unix seconds (from Linux's /proc: to a clock tick); None
    where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, uptime - started)


def read_metrics(run_dir: str | Path, kind: str | None = None, superseded: bool = False) -> list[dict]:
    """The run's records in order, without those superseded by a later resume or rewind (with
    them if `superseded`: every event of this run, e.g. a hang past the step resumed from)."""
    path = Path(run_dir) / "metrics.jsonl"
    records: list[dict] = []
    damaged = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # blank, or a record torn by a crash (ended by the next invocation); else not ours
            damaged += bool(line.strip()) and not line.startswith('{"kind": ')
            continue
        if not _sound(record):  # (edited by hand, or written by something else)
            damaged += 1
            continue
        _restore_nonfinite(record)
        if record["kind"] == "start":  # a new run in this directory: the earlier one's records go
            records = []
        elif record["kind"] in ("resume", "rewind") and not superseded:
            records = [r for r in records if r["step"] <= record["step"]]
        records.append(record)
    if damaged and str(path) not in _warned:
        _warned.add(str(path))
        log.warning("%s: %d line(s) are not records this project writes (not JSON, a field missing or of another type); "
                    "they were left out", path, damaged)
    return [r for r in records if kind is None or r["kind"] == kind]


_warned: set[str] = set()  # (one warning per file and process: a report reads a file many times)
# The fields that, where a record has them, are numbers (or null): those every record has,
# and those of the others' that reports do arithmetic with.
_NUMBERS = {"time", "loss", "lr", "grad_norm", "mfu", "mfu_causal", "train_loss", "val_loss", "bits_per_byte",
            "tokens_per_s", "flops_per_token", "total_steps", "ema_loss"}


_NUMBERED = ("start", "train", "eval", "checkpoint", "resume", "rewind", "end", "memory", "hang")


def _sound(record) -> bool:
    """A record as MetricsLog writes it: kind, whole-number step and tokens, numbers where numbers go."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return False
    if not all(type(record.get(key)) is int for key in ("step", "tokens")):
        return False
    if record["kind"] not in _NUMBERED:  # (a plan_check's speeds are {planned, measured, ratio})
        return True
    return all(value is None or type(value) in (int, float)
               for key, value in record.items()
               if key in _NUMBERS or key.endswith(("_s", "_ms", "_gb")) or key.startswith("noise_"))
