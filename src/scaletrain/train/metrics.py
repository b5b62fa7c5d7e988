"""metrics.jsonl: one JSON object per event, appended and flushed as it happens.

Every record has `kind` ("train", "eval", "checkpoint", "resume", "end", ...), `step`,
`tokens` and `time` (unix seconds). A resumed run appends a "resume" record; records of an
earlier invocation with a step past the resumed one (work lost with a crash) are superseded,
and `read_metrics` drops them so the history reads as one run. A "rewind" record (a divergence
sent the run back to a checkpoint) supersedes the records past its step alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True):
        """enabled=False (ranks other than 0) builds records but writes nothing."""
        self.path, self._file = path, None
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
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_metrics(run_dir: str | Path, kind: str | None = None, superseded: bool = False) -> list[dict]:
    """The run's records in order, without those superseded by a later resume or rewind (with
    them if `superseded`: every event of this run, e.g. a hang past the step resumed from)."""
    path = Path(run_dir) / "metrics.jsonl"
    records: list[dict] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # blank, or torn by a crash
            continue
        if record["kind"] == "start":  # a new run in this directory: the earlier one's records go
            records = []
        elif record["kind"] in ("resume", "rewind") and not superseded:
            records = [r for r in records if r["step"] <= record["step"]]
        records.append(record)
    return [r for r in records if kind is None or r["kind"] == kind]
