"""Speed and verdicts of `curate` (data/curate.py) on real code and real prose, one process.

Prints one JSON object with, for each corpus: its size, curate's MB/s with the default
filters and with normalisation alone, the documents and bytes dropped by reason, and (for
code) which files were dropped. MB/s is UTF-8 bytes of input per second of curate calls
alone; the files are read into memory first.

    code   the running interpreter's standard library (builtin:python-stdlib), as prepare reads it
    prose  .txt, .md and .rst files (those document_kind calls prose) under this machine's
           /usr/share/doc, CMake's Help, and the site-packages of the interpreter and the venv

    .venv/bin/python benchmarks/curate_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import ftfy

from scaletrain.data.curate import REASONS, curate, document_kind, load_filters
from scaletrain.data.sources import ReadStats, SourceFile, list_files, read_documents

STAGES = {"code": ("code",), "prose": ("gopher_quality", "gopher_repetition", "c4")}  # the stages each kind meets
PROSE_GLOBS = ["/usr/share/doc/**/*.{ext}", "/usr/share/cmake*/Help/**/*.{ext}",
               sysconfig.get_paths()["purelib"] + "/**/*.{ext}",
               str(Path(sysconfig.get_paths()["stdlib"]) / "site-packages") + "/**/*.{ext}"]


def code_corpus() -> list[tuple[str, str]]:
    """(file name, text) of each standard-library module, read as prepare reads builtin:python-stdlib."""
    files = list_files(["builtin:python-stdlib"])
    return [(name, text) for text, _, name in read_documents(files, "text", None, ReadStats())]


def prose_corpus() -> list[tuple[str, str]]:
    """(path, text) of each prose file under PROSE_GLOBS that exists here, read as prepare reads files."""
    paths = sorted({Path(p) for pattern in PROSE_GLOBS for ext in ("txt", "md", "rst")
                    for p in glob.glob(pattern.format(ext=ext), recursive=True)})
    files = [SourceFile(path, str(path)) for path in paths if path.is_file() and document_kind(path.name) == "prose"]
    return [(name, text) for text, _, name in read_documents(files, "text", None, ReadStats())]


def composition(documents) -> dict[str, float]:
    """MB of the corpus by where it came from: the package under site-packages, else the directory under /usr/share."""
    megabytes = Counter()
    for name, text in documents:
        parts = Path(name).parts
        depth = parts.index("site-packages") + 2 if "site-packages" in parts else 5
        megabytes[str(Path(*parts[:depth]))] += len(text.encode("utf-8")) / 1e6
    return {where: round(mb, 2) for where, mb in megabytes.most_common(8)}


def timed(documents, kind, cfg, repeats):
    """Best-of-repeats seconds of curating every document, and the verdicts."""
    best, verdicts = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        verdicts = [curate(text, kind, cfg) for _, text in documents]
        best = min(best, time.perf_counter() - start)
    return best, verdicts


def measure(documents, kind, repeats) -> dict:
    megabytes = sum(len(text.encode("utf-8")) for _, text in documents) / 1e6
    default, normalize_only = load_filters("default"), load_filters("none")
    normalize_only = normalize_only.model_copy(update={"normalize": default.normalize})
    seconds, verdicts = timed(documents, kind, default, repeats)
    seconds_normalize, _ = timed(documents, kind, normalize_only, repeats)
    dropped = Counter(reason for _, reason in verdicts if reason)
    dropped_bytes = Counter()
    examples: dict[str, list[str]] = {}
    for (name, text), (_, reason) in zip(documents, verdicts):
        if reason:
            dropped_bytes[reason] += len(text.encode("utf-8"))
            examples.setdefault(reason, []).append(name)
    n_dropped = sum(dropped.values())
    return {
        "documents": len(documents),
        "megabytes": round(megabytes, 2),
        "non_ascii_documents": sum(not text.isascii() for _, text in documents),
        "mb_per_s_default_filters": round(megabytes / seconds, 2),
        "mb_per_s_normalize_only": round(megabytes / seconds_normalize, 2),
        "dropped_documents": n_dropped,
        "dropped_fraction": round(n_dropped / len(documents), 4),
        "dropped_bytes_fraction": round(sum(dropped_bytes.values()) / 1e6 / megabytes, 4),
        "dropped_by_reason": {reason: dropped[reason] for reason in REASONS
                              if reason == "empty_after_normalize" or reason.split(":")[0] in STAGES[kind]},
        # Every standard-library module that is lost; a few examples per reason for prose.
        "dropped_files": examples if kind == "code" else {reason: names[:5] for reason, names in examples.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="time each corpus this many times, keep the best")
    args = parser.parse_args()
    result = {"python": sys.version.split()[0], "ftfy": ftfy.__version__, "machine": platform.machine(),
              "code": measure(code_corpus(), "code", args.repeats),
              "prose": measure(prose := prose_corpus(), "prose", args.repeats)}
    result["prose"]["largest_sources_mb"] = composition(prose)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
