"""Where documents come from: files, directories, globs, .jsonl, .parquet and built-in corpora.

A document is one text file, one .jsonl line or one .parquet row. A file compressed with gzip,
bzip2, xz or zstandard (.gz, .bz2, .xz, .zst: how C4, the Pile, SlimPajama and Dolma ship) is
read as what its name says without that suffix, `c4.json.gz` as JSON Lines; a `.json` file is
JSON Lines when its first line is a record with the text field (C4's and Dolma's shards are
named so) and text otherwise (a code corpus's package.json). `list_files` turns the
sources a user gave into an ordered file list (cheap: no file is opened); `read_documents`
reads them in that order and yields the documents it keeps, counting every document it
drops, and why, in a `ReadStats`. Reading is deterministic (sources in the given order,
files sorted within each source), so the same sources always give the same documents.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import importlib
import importlib.util
import io
import json
import lzma
import os
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .shards import DataError

# Why a document was not kept; stats.json lists every reason, with zero counts too, so its
# shape does not depend on the data.
DROP_REASONS = ("empty", "binary", "bad_json", "missing_field", "over_max_bytes")
BINARY_SNIFF_BYTES = 8192  # a NUL byte this early means the file is not text (what git and grep assume too)
SHOWN_BAD_LINES = 5  # bad .jsonl lines quoted by file:line in the warnings; the rest are only counted


@dataclass(frozen=True)
class SourceFile:
    path: Path  # where to read it
    name: str  # its path relative to the source it came from, recorded in the content hash


def _python_stdlib() -> tuple[Path, list[Path]]:
    """The .py files of the running interpreter's standard library, without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]


def _python_packages() -> tuple[Path, list[Path]]:
    """The .py files of the packages installed for the running interpreter (its site-packages:
    a virtual environment's own when it runs in one); from 100 MB to over 1 GB of code."""
    root = Path(sysconfig.get_paths()["purelib"])
    return root, list(root.rglob("*.py")) if root.is_dir() else []


BUILTINS: dict[str, Callable[[], tuple[Path, list[Path]]]] = {"python-stdlib": _python_stdlib,
                                                               "python-packages": _python_packages}


def list_files(sources: list[str]) -> list[SourceFile]:
    """Expand sources (files, directories, globs with **, builtin:NAME) into the files to read, in order."""
    if not sources:
        raise DataError("no sources given; give at least one file, directory, glob or builtin:python-stdlib")
    files: list[SourceFile] = []
    for source in sources:
        files += _expand(source)
    return files


def _expand(source: str) -> list[SourceFile]:
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTINS:
            valid = ", ".join(f"builtin:{n}" for n in BUILTINS)
            raise DataError(f"unknown built-in corpus {source!r}; the built-in corpora are: {valid}")
        root, paths = BUILTINS[name]()
        return _relative_sorted(root, paths)
    pattern = os.path.expanduser(source)
    if _is_glob(pattern):
        matches = [Path(m) for m in glob.glob(pattern, recursive=True)]
        # A set: 'data/**' matches data/, its subdirectories and its files, each file many times over.
        paths = {p for m in matches for p in ([m] if m.is_file() else _walk(m) if m.is_dir() else [])}
        if not paths:
            raise DataError(f"glob {source!r} matched no files; check the pattern (use ** to search subdirectories)")
        return _relative_sorted(_glob_root(pattern), paths)
    path = Path(pattern)
    if path.is_file():
        return [SourceFile(path, path.name)]
    if path.is_dir():
        paths = _walk(path)
        if not paths:
            raise DataError(f"source directory {source!r} contains no files")
        return _relative_sorted(path, paths)
    raise DataError(f"source {source!r} does not exist; give an existing file or directory, "
                    "a glob such as 'data/*.txt', or builtin:python-stdlib")


def reads_under(source: str, folder: Path) -> bool:
    """Whether `source`, listed again, would read the files under `folder` (which need not exist
    yet): a directory holding it, or a glob matching it or a directory holding it (which the glob
    then reads whole: 'data/**', 'data/*')."""
    if source.startswith("builtin:"):
        return False
    pattern = os.path.expanduser(source)
    folder = folder.resolve()
    if not _is_glob(pattern):
        return Path(pattern).is_dir() and folder.is_relative_to(Path(pattern).resolve())
    root = _glob_root(pattern)
    if not folder.is_relative_to(root.resolve()):
        return False
    wildcards = Path(pattern).parts[len(root.parts):]
    parts = folder.relative_to(root.resolve()).parts
    return any(_matches(wildcards, parts[:depth]) for depth in range(1, len(parts) + 1))


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether path components `parts` match glob components `pattern` (** any number of them)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(pattern[1:], parts[skip:]) for skip in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(pattern[1:], parts[1:])


def _walk(root: Path) -> list[Path]:
    """Every regular file under root, skipping hidden files and directories (.git, .DS_Store)."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        paths += [Path(dirpath, f) for f in filenames if not f.startswith(".") and Path(dirpath, f).is_file()]
    return paths


def _glob_root(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard: what matched paths are named relative to."""
    parts = []
    for part in Path(pattern).parts[:-1]:
        if _is_glob(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def _relative_sorted(root: Path, paths) -> list[SourceFile]:
    named = [SourceFile(p, Path(os.path.relpath(p, root)).as_posix()) for p in paths]
    return sorted(named, key=lambda f: f.name)


@dataclass
class ReadStats:
    """What reading the sources found: counts by reason, the content hash, notes for the user."""

    files_listed: int = 0
    files_read: int = 0
    files_not_utf8: int = 0
    documents: Counter = field(default_factory=Counter)  # "read", "kept" and each drop reason
    bytes: Counter = field(default_factory=Counter)  # UTF-8 bytes of those documents
    bad_lines: list[str] = field(default_factory=list)  # the first few "file:line: reason"
    not_utf8_examples: list[str] = field(default_factory=list)
    binary_examples: list[str] = field(default_factory=list)
    # sha256 over (name, size, sha256 of the content) of each file read, in order: any
    # change to what was read changes it; files never reached (max_bytes) do not.
    content: "hashlib._Hash" = field(default_factory=hashlib.sha256)

    def drop(self, reason: str, nbytes: int) -> None:
        self.documents["read"] += 1
        self.documents[reason] += 1
        self.bytes["read"] += nbytes
        self.bytes[reason] += nbytes

    def keep(self, nbytes: int) -> None:
        self.documents["read"] += 1
        self.documents["kept"] += 1
        self.bytes["read"] += nbytes
        self.bytes["kept"] += nbytes

    def bad_line(self, file: SourceFile, lineno: int, nbytes: int, reason: str, message: str) -> None:
        self.drop(reason, nbytes)
        if len(self.bad_lines) < SHOWN_BAD_LINES:
            self.bad_lines.append(f"{file.path}:{lineno}: {message}; line skipped")

    def hash_file(self, file: SourceFile, size: int, digest: str) -> None:
        self.content.update(json.dumps([file.name, size, digest]).encode() + b"\n")

    def as_dict(self) -> dict:
        def by_reason(counter: Counter) -> dict:
            return {"read": counter["read"], "kept": counter["kept"],
                    "dropped": {reason: counter[reason] for reason in DROP_REASONS}}
        return {"documents": by_reason(self.documents), "bytes": by_reason(self.bytes),
                "files": {"listed": self.files_listed, "read": self.files_read,
                          "not_utf8": self.files_not_utf8,
                          "not_read_over_max_bytes": self.files_listed - self.files_read}}

    def warnings(self) -> list[str]:
        notes = list(self.bad_lines)
        bad = self.documents["bad_json"] + self.documents["missing_field"]
        if bad > len(self.bad_lines):
            notes.append(f"skipped {bad - len(self.bad_lines)} more records that were not JSON "
                         "or had no text field (counted in stats.json)")
        if self.files_not_utf8:
            notes.append(f"{self.files_not_utf8} files were not valid UTF-8 and were read with replacement "
                         f"characters, e.g. {', '.join(self.not_utf8_examples)}")
        if self.documents["binary"]:
            notes.append(f"skipped {self.documents['binary']} binary files (NUL bytes in the first "
                         f"{BINARY_SNIFF_BYTES // 1024} KB), e.g. {', '.join(self.binary_examples)}")
        return notes


# How a text file (not a .jsonl record or .parquet row) is cut into documents: whole, at blank
# lines, or at every line. One long text (a book, Tiny Shakespeare, enwik8) is one document
# whole, which leaves no document for validation and fails the quality filters' length limits.
SPLITS = {"file": None, "paragraph": re.compile(r"\n[ \t\r\f\v]*\n\s*"), "line": re.compile(r"\n+")}


def read_documents(files: list[SourceFile], text_field: str, max_bytes: int | None, stats: ReadStats,
                   on_file: Callable[[], None] | None = None, split: str = "file") -> Iterator[tuple[str, int, str]]:
    """Yield (text, UTF-8 bytes, source file name) of each kept document, recording counts and the
    content hash in stats; `split` is how text files are cut into documents (SPLITS).

    With max_bytes, reading stops at the first document that would take the kept bytes past
    it, so the kept bytes never exceed max_bytes.
    """
    if split not in SPLITS:
        raise DataError(f"split {split!r}: give one of {', '.join(SPLITS)} (a text file's documents: the whole "
                        "file, its paragraphs between blank lines, or its lines)")
    stats.files_listed = len(files)
    for file in files:
        stats.files_read += 1
        for text, name in _documents_of(file, text_field, stats, SPLITS[split]):
            text = encodable(text)
            nbytes = len(text.encode("utf-8"))
            if not text.strip():
                stats.drop("empty", nbytes)
            elif max_bytes is not None and stats.bytes["kept"] + nbytes > max_bytes:
                stats.drop("over_max_bytes", nbytes)
                return
            else:
                stats.keep(nbytes)
                yield text, nbytes, name
        if on_file is not None:
            on_file()


def encodable(text: str) -> str:
    """text with lone surrogates (which JSON's \\ud800 escapes can carry, and UTF-8 cannot
    encode) replaced by '?'; other text unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")


# A record's own file name, where a .jsonl or .parquet of many files carries one (The Stack's
# "path", others' "filename"): it tells curation whether the record is code or prose.
NAME_FIELDS = ("path", "filename", "file_name")


# Compressed files: suffix -> the module whose open() reads them (zstandard is not in the
# standard library before Python 3.14: an optional dependency, asked for when needed).
COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}
# Bumped when a kind of file is read otherwise than before: 2, compressed files (dropped as
# binary before) and .json files of JSON Lines (one text before). Part of the key of a prepare
# that lists such files (reader_version), whose result changed; the others keep theirs.
READER_VERSION = 2


def reader_version(files: list[SourceFile]) -> int | None:
    """READER_VERSION where `files` hold a kind it changed the reading of, else None."""
    changed = any(file.path.suffix.lower() in (".json", *COMPRESSED) for file in files)
    return READER_VERSION if changed else None


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a .zst file, its frames one after another; a stream cut before
    its last frame ends is an OSError (zstandard's own reader ends there silently)."""

    def __init__(self, path: Path):
        import zstandard

        self._zstd, self._file, self._pending = zstandard, open(path, "rb"), b""
        self._frame = zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._file.read(1 << 20)
            if not chunk:
                if not self._frame.eof:
                    raise OSError("the zstandard stream ends inside a frame")
                return 0
            try:
                self._pending = self._frame.decompress(chunk)
                while self._frame.eof and self._frame.unused_data:  # (the next frame begins)
                    rest = self._frame.unused_data
                    self._frame = self._zstd.ZstdDecompressor().decompressobj()
                    self._pending += self._frame.decompress(rest)
            except self._zstd.ZstdError as e:
                raise OSError(str(e)) from None
        n = min(len(buffer), len(self._pending))
        buffer[:n], self._pending = self._pending[:n], self._pending[n:]
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _open(file: SourceFile):
    """A binary file object of `file`'s content, decompressed by its suffix."""
    module = COMPRESSED.get(file.path.suffix.lower())
    if module is None:
        return open(file.path, "rb")
    if module == "zstandard":
        if importlib.util.find_spec("zstandard") is None:
            raise DataError(f"{file.path} is compressed with zstandard, which needs the zstandard package: "
                            "pip install zstandard (or decompress it first)")
        return io.BufferedReader(_ZstdReader(file.path))
    return importlib.import_module(module).open(file.path, "rb")


def _format(file: SourceFile, text_field: str) -> str:
    """"jsonl", "parquet" or "text": how `file` is read (see the module's docstring)."""
    compressed = file.path.suffix.lower() in COMPRESSED
    inner = Path(file.path.stem).suffix.lower() if compressed else file.path.suffix.lower()
    if inner == ".jsonl" or (inner == ".json" and compressed):
        return "jsonl"
    if inner == ".parquet" and not compressed:
        return "parquet"
    if inner == ".json":
        try:
            with open(file.path, "rb") as f:
                record = json.loads(f.readline())
        except (ValueError, OSError):  # (not one record a line: a JSON document, read as text)
            return "text"
        return "jsonl" if isinstance(record, dict) and isinstance(record.get(text_field), str) else "text"
    return "text"


def _documents_of(file: SourceFile, text_field: str, stats: ReadStats,
                  separator: re.Pattern | None = None) -> Iterator[tuple[str, str]]:
    """(text, name) of each document of a file; name is the file's (without a compression
    suffix, which would hide a code file's extension), or a record's own. A text file is cut
    into documents at `separator` (each piece without it), or is one."""
    kind = _format(file, text_field)
    if kind == "jsonl":
        yield from _read_jsonl(file, text_field, stats)
    elif kind == "parquet":
        yield from _read_parquet(file, text_field, stats)
    else:
        text = _read_text(file, stats)
        if text is not None:
            name = file.name
            if file.path.suffix.lower() in COMPRESSED:
                name = name[:-len(file.path.suffix)]
            if separator is None:
                yield text, name
            else:
                yield from ((piece, name) for piece in separator.split(text) if piece)


def _decode(raw: bytes, file: SourceFile, stats: ReadStats, already_counted: bool) -> tuple[str, bool]:
    """UTF-8 text of raw; invalid bytes become U+FFFD and the file is counted once as not UTF-8."""
    try:
        return raw.decode("utf-8"), already_counted
    except UnicodeDecodeError:
        if not already_counted:
            stats.files_not_utf8 += 1
            if len(stats.not_utf8_examples) < 3:
                stats.not_utf8_examples.append(str(file.path))
        return raw.decode("utf-8", errors="replace"), True


def _read_text(file: SourceFile, stats: ReadStats) -> str | None:
    raw = _read_all(file)
    stats.hash_file(file, len(raw), hashlib.sha256(raw).hexdigest())
    if b"\0" in raw[:BINARY_SNIFF_BYTES]:
        stats.drop("binary", len(raw))
        if len(stats.binary_examples) < 3:
            stats.binary_examples.append(str(file.path))
        return None
    return _decode(raw, file, stats, False)[0]


def _record_name(record: dict, file: SourceFile) -> str:
    for key in NAME_FIELDS:
        if isinstance(record.get(key), str):
            return record[key]
    return file.name


def _unreadable(file: SourceFile, error: Exception) -> DataError:
    return DataError(f"{file.path} could not be decompressed ({error}); replace it with a whole copy")


def _read_all(file: SourceFile) -> bytes:
    with _open(file) as f:
        try:
            return f.read()
        except (OSError, EOFError, lzma.LZMAError) as e:  # (a truncated or corrupt archive)
            raise _unreadable(file, e) from None


def _lines(f, file: SourceFile) -> Iterator[bytes]:
    """The lines of the open `file`, a corrupt or truncated archive refused where it breaks."""
    while True:
        try:
            line = f.readline()
        except (OSError, EOFError, lzma.LZMAError) as e:
            raise _unreadable(file, e) from None
        if not line:
            return
        yield line


def _read_jsonl(file: SourceFile, text_field: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    _hash_whole_file(file, stats)
    not_utf8 = False
    with _open(file) as f:
        for lineno, raw in enumerate(_lines(f, file), 1):
            line, not_utf8 = _decode(raw, file, stats, not_utf8)
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # (a byte-order mark, which some editors write)
            if not line.strip():
                continue  # a blank line holds no record; it is neither a document nor an error
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                stats.bad_line(file, lineno, len(raw), "bad_json", f"not valid JSON ({e.msg})")
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                what = "a non-string" if isinstance(record, dict) and text_field in record else "no"
                stats.bad_line(file, lineno, len(raw), "missing_field", f"has {what} {text_field!r} field")
                continue
            yield text, _record_name(record, file)


def _hash_whole_file(file: SourceFile, stats: ReadStats) -> None:
    # Hashed in a read of its own (the second read comes from the page cache), so the hash
    # is of the whole file however far the parser gets before max_bytes stops it.
    digest, size = hashlib.sha256(), 0
    with open(file.path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    stats.hash_file(file, size, digest.hexdigest())


def _read_parquet(file: SourceFile, text_field: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _hash_whole_file(file, stats)
    try:
        parquet = pq.ParquetFile(file.path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{file.path} is not a readable Parquet file ({e})") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{file.path} has no column {text_field!r} (its columns are: {', '.join(names)}); "
                        "name the text column with text_field")
    kind = parquet.schema_arrow.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"column {text_field!r} of {file.path} holds {kind}, not strings; "
                        "name a text column with text_field")
    name_column = next((n for n in NAME_FIELDS if n in names and n != text_field), None)
    columns = [text_field] + ([name_column] if name_column else [])
    # Batches bound memory to a slice of one row group, whatever the file's size.
    for batch in parquet.iter_batches(columns=columns):
        texts = batch.column(0).to_pylist()
        record_names = batch.column(1).to_pylist() if name_column else [None] * len(texts)
        for text, name in zip(texts, record_names):
            if text is None:
                stats.drop("missing_field", 0)
            else:
                yield text, name if isinstance(name, str) else file.name
