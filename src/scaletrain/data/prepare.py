"""`scaletrain data prepare`: sources in, a data directory out.

    out/tokenizer.json    byte-level BPE, trained on the training documents (or the one given)
    out/shards/, index.json   tokens of each document followed by the end-of-document id (shards.py)
    out/stats.json        documents, bytes and tokens read, kept and dropped by reason
    out/manifest.json     sources, options, content hash and the key that decides reuse; written last

Three passes over the sources, all reading the same documents in the same order:
1. read and hash, cheaply, to decide whether an identical result already exists and to
   draw the validation split;
2. train the tokenizer on the training documents (skipped when a tokenizer is given);
3. tokenize with every core and write the shards.
Memory holds one number per document and one batch of documents, not the corpus, so
corpora larger than memory prepare too.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tokenizers

from .shards import DataError, ShardWriter, read_index, write_index
from .sources import ReadStats, list_files, read_documents
from .tokenizer import check_vocab_size, eos_id, load_tokenizer, train_tokenizer
from .tokenizer import vocab_size as tokenizer_vocab_size

if TYPE_CHECKING:
    from rich.progress import Progress

# Bump when the same sources and options would give a different data directory, so that
# directories prepared by older code are prepared again rather than reused.
PREPARE_VERSION = 1
# Text per encode_batch call: large enough that every core has documents to work on,
# small enough that a batch's token lists stay a few tens of MB.
ENCODE_BATCH_BYTES = 4 << 20
OUTPUT_FILES = ("manifest.json", "index.json", "stats.json", "tokenizer.json")


@dataclass
class PrepareResult:
    out: Path
    reused: bool  # an identical earlier result was found in out and left untouched
    stats: dict  # what stats.json holds
    warnings: list[str]  # notes for the user (skipped lines, non-UTF-8 files, ...)


def prepare(sources: list[str], out: str | Path, vocab_size: int, *, max_bytes: int | None = None,
            text_field: str = "text", tokenizer: str | Path | None = None, val_fraction: float = 0.005,
            seed: int = 0, workers: int | None = None, progress: Progress | None = None) -> PrepareResult:
    """Tokenize sources into the data directory out, or reuse what out holds if it was prepared identically.

    sources: files, directories (read recursively), globs ('data/**/*.txt'), .jsonl and
        .parquet files (text in `text_field`), or builtin:python-stdlib.
    vocab_size: ids of the tokenizer to train; ignored when `tokenizer` is given.
    max_bytes: stop reading before the kept documents exceed this many UTF-8 bytes.
    tokenizer: a tokenizer.json (or a directory holding one) to use instead of training one.
    val_fraction: share of documents, drawn by a hash of (seed, content), held out for validation.
    workers: threads that tokenize. The Rust thread pool of `tokenizers` is created once per
        process, so this applies only when no tokenizer has encoded in parallel before.
    progress: a rich Progress to which reading, training and tokenizing tasks are added.
    """
    sources, out = [str(source) for source in sources], Path(out)
    _check_options(vocab_size, max_bytes, val_fraction, seed, workers, tokenizer)
    files = list_files(sources)
    _check_out(out, sources, files)
    if workers is not None:
        os.environ["RAYON_NUM_THREADS"] = str(workers)  # read by the pool when it is first used

    given = None
    if tokenizer is not None:
        given = load_tokenizer(tokenizer)
        tokenizer_path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        # Kept as bytes: out/tokenizer.json may be the very file given, and out is cleared below.
        tokenizer_bytes = tokenizer_path.read_bytes()
        vocab_size = tokenizer_vocab_size(given)

    # Pass 1: read and hash everything that will be used, and draw the split.
    stats = ReadStats()
    draws = array("d")  # one uniform draw in [0, 1) per kept document
    task = _add_task(progress, "reading sources", len(files))
    for text, _ in read_documents(files, text_field, max_bytes, stats, on_file=lambda: _advance(progress, task, 1)):
        draws.append(_split_draw(seed, text))
    _finish_task(progress, task, len(files))

    options = {"vocab_size": vocab_size, "max_bytes": max_bytes, "text_field": text_field,
               "val_fraction": val_fraction, "seed": seed,
               "tokenizer": None if given is None else
               {"path": str(tokenizer_path), "sha256": hashlib.sha256(tokenizer_bytes).hexdigest()}}
    content_sha256 = stats.content.hexdigest()
    key = _key(options, content_sha256)
    if _is_complete(out, key):
        reused_stats = json.loads((out / "stats.json").read_text())
        return PrepareResult(out, True, reused_stats, reused_stats["warnings"])

    if stats.documents["kept"] == 0:
        dropped = stats.as_dict()["documents"]["dropped"]
        reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n) or "the sources hold none"
        raise DataError(f"no documents to prepare ({reasons}); give sources that contain text"
                        + (" or a larger max_bytes" if dropped["over_max_bytes"] else ""))
    is_val = _choose_validation(np.frombuffer(draws, dtype=np.float64), val_fraction)

    _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    warnings = stats.warnings()

    # Pass 2: the tokenizer, trained on training documents only so validation text stays unseen.
    if given is None:
        task = _add_task(progress, "training tokenizer", stats.bytes["kept"])
        tok = train_tokenizer(_texts(files, text_field, max_bytes, ~is_val, progress, task), vocab_size)
        _finish_task(progress, task, stats.bytes["kept"])
        tok.save(str(out / "tokenizer.json"))
        learned = tokenizer_vocab_size(tok)
        if learned < vocab_size:
            warnings.append(f"the tokenizer learned {learned} of the {vocab_size} ids asked for: the text has "
                            f"too few distinct byte pairs to merge; the data keeps vocab_size {vocab_size}")
    else:
        tok = given
        (out / "tokenizer.json").write_bytes(tokenizer_bytes)
    eos = eos_id(tok)

    # Pass 3: tokenize in batches (encode_batch_fast runs on every core) and write the shards.
    writers = {"train": ShardWriter(out, "train", vocab_size, eos), "val": ShardWriter(out, "val", vocab_size, eos)}
    task = _add_task(progress, "tokenizing", stats.bytes["kept"])
    batch: list[str] = []
    batch_val: list[bool] = []
    batch_bytes = 0
    split_bytes = {"train": 0, "val": 0}
    reread = ReadStats()
    documents = read_documents(files, text_field, max_bytes, reread)
    for (text, nbytes), val in zip(documents, is_val.tolist()):
        batch.append(text)
        batch_val.append(val)
        batch_bytes += nbytes
        split_bytes["val" if val else "train"] += nbytes
        if batch_bytes >= ENCODE_BATCH_BYTES:
            _encode_into(tok, batch, batch_val, writers)
            _advance(progress, task, batch_bytes)
            batch, batch_val, batch_bytes = [], [], 0
    _encode_into(tok, batch, batch_val, writers)
    _finish_task(progress, task, stats.bytes["kept"])
    if reread.content.hexdigest() != content_sha256:
        raise DataError("the sources changed while they were being prepared; prepare again once they are stable")
    splits = {name: writer.close() for name, writer in writers.items()}
    write_index(out, vocab_size, eos, splits)

    result_stats = stats.as_dict()
    result_stats["documents"].update(train=splits["train"]["documents"], val=splits["val"]["documents"])
    result_stats["bytes"].update(split_bytes)
    result_stats["tokens"] = {"train": splits["train"]["tokens"], "val": splits["val"]["tokens"]}
    result_stats["vocab_size"], result_stats["eos_id"] = vocab_size, eos
    result_stats["tokenizer"] = {"trained": given is None, "learned_vocab_size": tokenizer_vocab_size(tok)}
    result_stats["warnings"] = warnings
    _write_json(out / "stats.json", result_stats)

    # Last, so that a directory without a manifest is never taken for a complete one.
    _write_json(out / "manifest.json", {
        "key": key,
        "sources": {"given": sources, "files_listed": stats.files_listed, "files_read": stats.files_read},
        "options": options,
        "content_sha256": content_sha256,
        "scaletrain_version": _version(),
        "tokenizers_version": tokenizers.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    return PrepareResult(out, False, result_stats, warnings)


def _check_options(vocab_size: int, max_bytes: int | None, val_fraction: float, seed: int,
                   workers: int | None, tokenizer: str | Path | None) -> None:
    if tokenizer is None:
        check_vocab_size(vocab_size)
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"max_bytes must be a positive number of bytes, not {max_bytes}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be at least 0 and below 1, not {val_fraction}")
    if not isinstance(seed, int):
        raise DataError(f"seed must be an integer, not {seed!r}")
    if workers is not None and workers < 1:
        raise DataError(f"workers must be at least 1, not {workers}")


def _check_out(out: Path, sources: list[str], files) -> None:
    """Refuse an out that the sources would read back on the next run."""
    if out.exists() and not out.is_dir():
        raise DataError(f"output {str(out)!r} is a file; give a directory to prepare the data into")
    resolved = out.resolve()
    for source in sources:
        directory = Path(os.path.expanduser(source))
        if directory.is_dir() and resolved.is_relative_to(directory.resolve()):
            raise DataError(f"output {str(out)!r} is inside source directory {source!r}; "
                            "prepare into a directory outside the sources")
    for file in files:
        if file.path.resolve().is_relative_to(resolved):
            raise DataError(f"source file {str(file.path)!r} is inside the output directory {str(out)!r}; "
                            "prepare into a directory outside the sources")


def _split_draw(seed: int, text: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, content): the same document always lands in
    the same split, duplicates never straddle train and validation, and adding other
    documents moves no document between splits."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def _choose_validation(draws: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents are validation: those drawn below val_fraction, with at least one
    validation and one training document whenever there are two documents and val_fraction > 0."""
    is_val = draws < val_fraction
    if val_fraction > 0 and len(draws) >= 2 and not is_val.any():
        is_val[np.argmin(draws)] = True
    if is_val.all():
        is_val[np.argmax(draws)] = False  # training needs a document even when there is only one
    return is_val


def _texts(files, text_field: str, max_bytes: int | None, keep: np.ndarray, progress, task):
    """The kept documents again, those where keep is True, advancing the progress task by bytes."""
    documents = read_documents(files, text_field, max_bytes, ReadStats())
    for (text, nbytes), wanted in zip(documents, keep.tolist()):
        if wanted:
            yield text
        _advance(progress, task, nbytes)


def _encode_into(tok, batch: list[str], batch_val: list[bool], writers: dict[str, ShardWriter]) -> None:
    # No special tokens added: the writer appends the end-of-document id itself, and a
    # given tokenizer's post-processor (a Llama tokenizer's <s>, say) must not add others.
    for encoding, val in zip(tok.encode_batch_fast(batch, add_special_tokens=False), batch_val):
        writers["val" if val else "train"].add(encoding.ids)


def _key(options: dict, content_sha256: str) -> str:
    """What decides reuse: everything the output depends on. The tokenizer is named by its
    hash, not its path, and `workers` is absent because it does not change the output."""
    material = {"prepare_version": PREPARE_VERSION, "tokenizers_version": tokenizers.__version__,
                "options": {**options, "tokenizer": options["tokenizer"] and options["tokenizer"]["sha256"]},
                "content_sha256": content_sha256}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _is_complete(out: Path, key: str) -> bool:
    """out holds a finished prepare with this key: its manifest matches and every file it names exists."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        index = read_index(out)
    except (OSError, ValueError, KeyError):  # DataError is a ValueError
        return False
    if manifest.get("key") != key or not all((out / name).is_file() for name in OUTPUT_FILES):
        return False
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in index["splits"].values():
        for shard in split["shards"]:
            bin_path, docs_path = out / shard["path"], out / shard["docs"]
            if not docs_path.is_file() or not bin_path.is_file() \
                    or bin_path.stat().st_size != shard["tokens"] * itemsize:
                return False
    return True


def _clear(out: Path) -> None:
    """Remove an earlier prepare's files from out, and only those."""
    # The manifest goes first: if this prepare is interrupted, out has no manifest and is
    # never mistaken for a complete result.
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    shards = out / "shards"
    if shards.is_dir():
        for path in shards.iterdir():
            if path.name.startswith(("train_", "val_")):
                path.unlink()


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("scaletrain")
    except PackageNotFoundError:
        return "unknown"


def _add_task(progress, description: str, total: int):
    return None if progress is None else progress.add_task(description, total=total)


def _advance(progress, task, amount: int) -> None:
    if progress is not None:
        progress.advance(task, amount)


def _finish_task(progress, task, total: int) -> None:
    # Totals are estimates (reading stops early at max_bytes); show every task as done.
    if progress is not None:
        progress.update(task, completed=total)
