"""Where a run's wall-clock went, from its metrics.jsonl: the goodput measured, to set beside the
planner's prediction of it (plan/cost.py).

The wall-clock of a run runs from the launch of its first process to its last record, over
every invocation of `scaletrain train` (a crash, a preemption or a time limit ends one; the next
resumes from the newest checkpoint). It divides into:

- steps: the training steps whose results the run kept (the step_s of train records, and of
  checkpoint records for the steps since the last train record: no record's steps straddle a
  checkpoint, so a resume keeps exactly the steps up to its checkpoint);
- steps redone: steps trained and then lost — past the checkpoint that the next invocation
  resumed from, or past the one a rewind went back to (their train records are superseded, a
  rewind also reports the unlogged steps it discarded, lost_s, and a crashed invocation's
  training past its last record is timed by its heartbeat, train/metrics.py's Heartbeat, which
  the next resume record carries as last_alive);
- setup: each process's start until its first step (imports, building and laying out the model,
  loading the checkpoint, opening the data: setup_s of the start and resume records) and each
  rewind's return to its checkpoint;
- checkpoints: what saving blocked training for (blocking_s; a background save's copy to host
  memory only);
- evaluation: validation loss and tasks (the eval records' seconds);
- between invocations: from an invocation's last record (or heartbeat) to the launch of the next:
  the time to notice the failure and restart (a hang's included, the scheduler's queue too);
- other: the rest (logging, waiting for a background save to finish, ...).

An invocation that ended where it was told to stop (`--stop-at-step`, as a sweep stops a shape's
trunk at each branch and trains the other points meanwhile) was paused, not failed: the time until
the next one is left out of the wall-clock (paused_s), as a job's time off the cluster is.

The goodput is steps / wall-clock: the share of the wall-clock that advanced the run, as Google's
ML Productivity Goodput counts it (the "productive training time" over the job's time). The
planner's goodput counts failures and checkpoints only (Daly's model: plan/cost.py), so it is an
upper bound of the measured one, which also pays for evaluation and setup. Pure arithmetic.
"""

from __future__ import annotations

# The parts of the wall-clock, in the order reports list them: a word and a label each.
PARTS = {"steps": ("steps", "steps kept"),
         "steps_redone": ("redone", "steps redone (lost to a crash or a rewind)"),
         "setup": ("setup", "setup (start-up, checkpoint loading, rewinds)"),
         "checkpoints": ("checkpoints", "checkpoints (what saving blocked)"),
         "evaluation": ("eval", "evaluation"),
         "between": ("restarts", "between invocations (noticing, restart, queue)"),
         "other": ("other", "other")}


def invocations(records: list[dict]) -> list[list[dict]]:
    """The records of each invocation of training: a start or a resume record opens one."""
    runs: list[list[dict]] = []
    for record in records:
        if record["kind"] in ("start", "resume") or not runs:
            runs.append([])
        runs[-1].append(record)
    return runs


def launched(invocation: list[dict]) -> float:
    """When the invocation's process started (its first record's time, less its setup)."""
    first = invocation[0]
    return first["time"] - (first.get("setup_s") or 0.0)


def paused(invocation: list[dict]) -> bool:
    """Whether the invocation ended at the step it was told to stop at (its end record neither
    complete nor stopped by a signal): what follows, until the next one, is a pause."""
    end = invocation[-1]
    return end["kind"] == "end" and not end.get("complete") and end.get("stopped_by") is None


def pauses(runs: list[list[dict]]) -> list[tuple[float, float]]:
    """(from, to) unix seconds of each pause between the invocations `runs`: from the last record of
    one that was `paused` to the launch of the next."""
    out = []
    for before, after in zip(runs, runs[1:]):
        if paused(before):
            last = max(r["time"] for r in before)
            out.append((last, max(last, launched(after))))  # (clocks of different hosts: never below zero)
    return out


def working_clock(records: list[dict]):
    """A function of a unix time: the seconds since the run's launch, its pauses before then left
    out, as account's wall-clock leaves them (compare --x hours)."""
    runs = invocations(records)
    start, breaks = launched(runs[0]), pauses(runs)
    return lambda t: t - start - sum(max(0.0, min(t, end) - begin) for begin, end in breaks)


def account(records: list[dict], kept: list[dict]) -> dict | None:
    """The wall-clock of the run whose records (superseded ones included, since its start) are
    `records`, and of which `kept` are not superseded, split into PARTS (seconds): {"wall_s",
    "goodput", "invocations", "rewinds", "parts": {part: seconds}, "paused_s", "timeline": [[(time,
    step), ...] per invocation]}; the wall-clock leaves out the pauses after invocations `paused`
    (paused_s), the timeline's times do not. None when its train records do not time their steps
    (a run written before step_s was recorded), or it has none."""
    train = [r for r in records if r["kind"] == "train"]
    if not train or any("step_s" not in r for r in train):
        return None
    runs = invocations(records)
    start = launched(runs[0])

    def step_time(rows: list[dict]) -> float:  # (a checkpoint record carries the steps since the last record)
        return sum(r.get("step_s") or 0.0 for r in rows if r["kind"] in ("train", "checkpoint"))
    kept_steps = step_time(kept)
    rewinds = [r for r in records if r["kind"] == "rewind"]
    # Between the last record of an invocation and the launch of the next (clocks of different
    # hosts may disagree by a little: never below zero), the part it went on training (to its
    # last heartbeat, which the next one's resume record carries) and the rest.
    gaps = []
    for before, after in zip(runs, runs[1:]):
        if paused(before):
            continue
        last = max(r["time"] for r in before)
        gap = max(0.0, launched(after) - last)
        alive = min(gap, max(0.0, (after[0].get("last_alive") or last) - last))
        gaps.append((alive, gap - alive))
    paused_s = sum(end - begin for begin, end in pauses(runs))
    wall = max(r["time"] for r in records) - start - paused_s
    parts = {
        "steps": kept_steps,
        "steps_redone": step_time(records) - kept_steps + sum(r.get("lost_s") or 0.0 for r in rewinds)
        + sum(alive for alive, _ in gaps),
        "setup": sum(run[0].get("setup_s") or 0.0 for run in runs) + sum(r.get("seconds") or 0.0 for r in rewinds),
        "checkpoints": sum(r.get("blocking_s") or 0.0 for r in records if r["kind"] == "checkpoint"),
        "evaluation": sum(r.get("seconds") or 0.0 for r in records if r["kind"] == "eval"),
        "between": sum(rest for _, rest in gaps),
    }
    parts["other"] = max(0.0, wall - sum(parts.values()))
    return {"wall_s": wall, "goodput": kept_steps / wall if wall > 0 else None, "invocations": len(runs),
            "rewinds": len(rewinds), "parts": parts, "paused_s": paused_s,
            "timeline": [[(launched(run) - start, run[0]["step"])]
                         + [(r["time"] - start, r["step"]) for r in run if r["kind"] in ("start", "resume", "train", "rewind")]
                         for run in runs]}


def wall_line(time: dict) -> str:
    """The account in a line: the goodput, then the other parts' shares of the wall-clock (and the
    time paused, which it leaves out)."""
    parts, wall = time["parts"], time["wall_s"]
    rest = [f"{PARTS[k][0]} {parts[k] / wall:.1%}" for k in PARTS if k != "steps" and parts[k] >= 0.0005 * wall]
    if time.get("paused_s"):
        rest.append(f"{duration(time['paused_s'])} paused, not counted")
    return f"{time['goodput']:.1%} of {duration(wall)}" + (f" ({', '.join(rest)})" if rest else "")


def duration(seconds: float) -> str:
    """A span of time for people: seconds, minutes, hours or days."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
