"""What the directories that scaletrain writes are, told by their files; and the refusal of an
output that would write over another command's.

Every command that writes a directory (a prepared data directory, a run, a sweep, a search) or
a file (an evaluation, a plot, a launch script) is given its path by the user, and a path typed
wrong is one that already holds something else: a sweep's results, a run's metrics, data runs
train on. Those are checked here before any work, so that a refused command loses nothing."""

from __future__ import annotations

import json
from pathlib import Path

from scaletrain.errors import UserError


def read_own(path: str | Path, key: str) -> dict:
    """The JSON object a command wrote into its output directory and reads back when it goes on
    (a search's grid.json, a tuning's tune.json), which holds `key`; a UserError in one line
    where it was damaged since (edited, cut short by a full disk): refused, nothing lost."""
    try:
        doc = json.loads(Path(path).read_text())
        if isinstance(doc, dict) and key in doc:
            return doc
    except (ValueError, UnicodeDecodeError):  # (JSONDecodeError is a ValueError)
        pass
    raise UserError(f"{str(path)!r} is damaged (not the JSON scaletrain wrote there); give another --out, or "
                    "remove the directory to start again")


def read_rows(path: str | Path, text_columns: tuple[str, ...]) -> list[dict]:
    """The rows of a results.csv that a command wrote into its output directory, numbers as floats
    (but `text_columns`); a UserError in one line naming the line damaged since."""
    import csv

    rows = []
    with Path(path).open(newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                rows.append({k: (v if k in text_columns else float(v)) for k, v in row.items()})
            except (TypeError, ValueError):  # (a value missing, or not a number)
                raise UserError(f"{str(path)!r} line {line} is damaged (not the row scaletrain wrote there); give "
                                "another --out, or remove the directory to start again") from None
    return rows


def _grid_settings(path: Path) -> dict:
    try:
        return json.loads((path / "grid.json").read_text()).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return {}


# (kind, what tells it, the files it owns), in the order they are told apart: a run directory
# holds a tokenizer.json as data does; a sweep and a hyperparameter search each hold a grid.json
# (of settings with budgets: a grid.json of other contents is not theirs).
# What `report` writes into a run directory and `fit` into a sweep (written again by them, but
# not to be written over by another command's --out).
REPORT_FILES = ("loss.png", "speed.png", "tasks.png", "batch.png", "progress.png", "norms.png", "report.html")
FIT_FILES = ("isoflop.png", "optimal.png", "contours.png", "residuals.png")
KINDS = (
    ("prepared data directory", lambda p: (p / "index.json").is_file() or (p / "manifest.json").is_file()
     or (p / "work" / "key").is_file(), ("manifest.json", "index.json", "stats.json", "tokenizer.json")),
    ("run directory", lambda p: (p / "config.toml").is_file() and ((p / "metrics.jsonl").is_file()
                                                                  or (p / "checkpoints").is_dir()),
     ("config.toml", "metrics.jsonl", "heartbeat.json", "stats.json", "tokenizer.json", "branch.json", "wandb_id",
      *REPORT_FILES)),
    ("mixture search", lambda p: (p / "mixtures.json").is_file(),
     ("mixtures.json", "results.csv", "mixture.json", "mixture.png")),
    ("tuning directory", lambda p: (p / "tune.json").is_file(), ("tune.json", "results.csv")),
    ("demo directory", lambda p: (p / "demo.json").is_file() or (p / "sweep" / "grid.json").is_file()
     and (p / "data" / "index.json").is_file(), ("demo.json", "timing.json")),
    ("hyperparameter search", lambda p: (p / "grid.json").is_file() and "lr_factors" in _grid_settings(p),
     ("grid.json", "results.csv", "hparams.json", "hparams.png")),
    ("sweep", lambda p: "budgets" in _grid_settings(p), ("grid.json", "results.csv", "law.json", *FIT_FILES)),
    ("Hugging Face model directory", lambda p: (p / "config.json").is_file() and any(p.glob("*.safetensors")),
     ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
      "model.safetensors.index.json")),
)


def kind_of(path: str | Path) -> str | None:
    """What the directory `path` is, by the files in it; None for a new, empty or other one."""
    path = Path(path)
    if not path.is_dir():
        return None
    return next((kind for kind, tells, _ in KINDS if tells(path)), None)


def check_output_dir(path: str | Path, kind: str, flag: str = "--out") -> None:
    """Refuse, before any work, an output directory that holds another command's output than a
    `kind` (one of KINDS's): a sweep into a run, data into a sweep."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a file; give a directory for the {kind}")
    found = kind_of(path)
    if found is not None and found != kind:
        raise UserError(f"{flag} {str(path)!r} is a {found}, not a {kind}; give a new directory for the {kind}")


def check_output_file(path: str | Path | None, flag: str, suffixes: tuple[str, ...] = (),
                      makes_folder: bool = False) -> None:
    """Refuse, before any work, an output file that cannot be written (a directory, or under a
    folder that does not exist, unless the command `makes_folder`), that is one of a directory's
    own files (a sweep's results.csv, a run's metrics.jsonl), or whose suffix is not one of
    `suffixes` (when given)."""
    if path is None:
        return
    if not str(path).strip():
        raise UserError(f"{flag} is empty; give the path of a file to write")
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a directory; give the path of a file to write")
    if not target.parent.is_dir() and not (makes_folder and not target.parent.exists()):
        raise UserError(f"{flag} {str(path)!r}: its folder {str(target.parent)!r} does not exist; create it or give "
                        "another path")
    found = kind_of(target.parent)
    owned = next((own for kind, _, own in KINDS if kind == found), ())
    if target.name in owned:
        raise UserError(f"{flag} {str(path)!r} is a file of the {found} {str(target.parent)!r}, its own; give "
                        "another file name")
    if suffixes and target.suffix.lower().removeprefix(".") not in suffixes:
        what = f"a {target.suffix} file" if target.suffix else "a file whose name has no suffix"
        raise UserError(f"{flag} {str(path)!r}: {what} cannot be written here; give a name ending in one of "
                        f"{', '.join('.' + s for s in suffixes)}")


def plot_suffixes() -> tuple[str, ...]:
    """The image formats Matplotlib writes."""
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


# The first line of the configs plan and tune write, by which they know their own: an earlier
# output of theirs may be replaced, anything else not (launch's job files: launch.WRITTEN).
WRITTEN_BY = {"plan": "# written by scaletrain plan", "tune": "# written by scaletrain tune"}


def _refusal_to_replace(path: Path, command: str) -> str | None:
    """Why `command` may not replace the existing file `path`, or None where it is the command's
    own earlier output, unchanged for plan (its text is the plan's config beside it)."""
    from scaletrain.launch import WRITTEN, WRITTEN_KEY

    text = path.read_text(errors="replace")
    lines = text.splitlines()
    if command == "launch":
        try:
            items = json.loads(text).get("items", [])
            ours = any(item.get("metadata", {}).get("annotations", {}).get(WRITTEN_KEY) == "launch" for item in items)
        except (ValueError, AttributeError):
            ours = WRITTEN in lines[:2]
    else:
        ours = lines[:1] == [WRITTEN_BY[command]]
    if not ours:
        return f"exists and was not written by scaletrain {command}, which would replace it"
    if command == "plan":
        beside = path.with_suffix(".plan.json")
        try:
            planned = json.loads(beside.read_text()).get("config")
        except (OSError, ValueError, AttributeError):
            planned = None
        if [planned] != text.split("\n", 1)[1:]:  # (the config after its first line)
            return f"was written by scaletrain plan and changed since (or its {beside.name} was), which would be lost"
    return None


def check_written_config(path: str | None, flag: str, source: str | None, command: str,
                          suffixes: tuple[str, ...] = ("toml",)) -> None:
    """Refuse, before any work, a file written from a config that cannot be (check_output_file's
    reasons, a name not ending in one of `suffixes`), that is the config read (`source`), or that
    exists and is not an earlier output of `command` (_refusal_to_replace), which it would replace."""
    check_output_file(path, flag, suffixes)
    if path is None:
        return
    if source is not None and Path(path).resolve() == Path(source).resolve():
        raise UserError(f"{flag} {path!r} is the config given, which it would write over; give another file name")
    if Path(path).is_file() and (why := _refusal_to_replace(Path(path), command)) is not None:
        raise UserError(f"{flag} {path!r} {why}; give a new file name, or remove it")
