"""`scaletrain data import`: token data another framework already made, as a data directory.

Corpora are often tokenized once and kept in their trainer's format; re-tokenizing terabytes
to train here would cost hours and might not give the same tokens. Three formats are read:

- **megatron**: Megatron-LM's (and NeMo's) indexed dataset, PREFIX.bin with PREFIX.idx — the
  index's header b"MMIDIDX\\x00\\x00", version 1, the tokens' dtype code, the counts of
  sequences and documents, then each sequence's length (int32) and byte offset (int64) and the
  sequence each document starts at (int64, with the end as the last). Documents made with
  `preprocess_data.py --append-eod` end with the end-of-document token already.
- **parquet**: a document a row, its token ids a list in one column (input_ids: what Hugging
  Face datasets' map of a tokenizer writes, saved with to_parquet), copied a batch of rows at a
  time into the import's work folder and read from there.
- **flat**: one array of tokens whose documents each end with the end-of-document token:
  nanoGPT's train.bin (uint16, GPT-2's <|endoftext|> after each), OLMo's and Dolma's tokenized
  .npy memmaps (raw, no header: uint16, or uint32 for vocabularies past 65,536), or a NumPy .npy
  file with its header. A raw file's dtype is --dtype, else the smallest that holds the
  tokenizer's ids.

The tokens are copied into shards (data/shards.py) as `data prepare` writes them: each document
followed by the end-of-document id (one where the source ended it without, not a second where
it had one; empty documents dropped), a seeded share of the documents held out as the validation
split (one document at least where there are two, as prepare's), the tokenizer the data was
made with copied beside them. Every id is checked to be one of the tokenizer's. While it runs,
work/key marks the directory unfinished (read_index refuses it); the same import run again
starts over, and a finished one run again unchanged is reused. What is not done (the tokens are taken as they are): curation,
deduplication, and the removal of training documents that overlap the validation split.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np

from scaletrain.outputs import kind_of

from .shards import (DataError, ShardWriter, clear_data_dir, is_complete, refuse_foreign_files, token_dtype,
                     write_index)
from .tokenizer import bos_id, eos_id, load_tokenizer
from .tokenizer import vocab_size as tokenizer_vocab_size

FORMATS = ("auto", "megatron", "flat", "parquet")
MEGATRON_HEADER = b"MMIDIDX\x00\x00"
# Megatron-LM's dtype codes (megatron/core/datasets/indexed_dataset.py, DType): the integer ones.
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
RAW_DTYPES = ("uint16", "uint32", "int32")
BLOCK_TOKENS = 1 << 24  # tokens read and written at a time
PARQUET_ROWS = 4096  # documents read from a Parquet file at a time


@dataclass
class Source:
    """One source's tokens (memory-mapped) and where its documents begin and end in them."""

    path: str
    format: str
    tokens: np.ndarray
    bounds: np.ndarray  # int64: (start, end) of each document, shape (documents, 2)
    empty: int = 0  # documents of no sequences (a Megatron index's), not in bounds
    column: str | None = None  # a Parquet source's column of token ids (its tokens read by _spill)


@dataclass
class ImportResult:
    out: Path
    stats: dict
    reused: bool
    warnings: list[str]


def read_source(spec: str, fmt: str = "auto", dtype: str | None = None, eos: int = 0,
                raw_dtype: str = "uint16", column: str | None = None) -> Source:
    """The tokens and documents of one source: a Megatron prefix (or its .bin or .idx), a flat
    token file, a .npy, or a .parquet of a document a row (its ids in `column`); `eos` splits a
    flat file into documents. `dtype`: a raw flat file's, as given (refused for the others, which
    say their own); else `raw_dtype`. `column`: a Parquet file's (input_ids when None; the others
    have none: import_tokens refuses it where no source is Parquet)."""
    path = Path(spec)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    megatron = Path(f"{prefix}.idx").is_file()
    if fmt == "auto":
        fmt = "megatron" if megatron else "parquet" if path.suffix == ".parquet" else "flat"
    if fmt == "parquet":
        if dtype is not None:
            raise DataError("--dtype reads a raw file of tokens; a Parquet file's schema names its own: drop it")
        if not path.is_file():
            raise DataError(f"source {spec!r} does not exist; give a .parquet file of tokenized documents")
        return _parquet(path, column or "input_ids")
    if fmt == "megatron":
        if not megatron or not Path(f"{prefix}.bin").is_file():
            raise DataError(f"{spec!r} is not a Megatron indexed dataset: {prefix}.idx and {prefix}.bin must both "
                            "exist; give the prefix they share, or --format flat for one file of tokens")
        if dtype is not None:
            raise DataError("--dtype reads a raw file of tokens; a Megatron dataset's index names its own: drop it")
        return _megatron(str(prefix))
    if path.is_dir():
        raise DataError(f"source {spec!r} is a directory; give a file of tokens (a .bin or .npy), a Megatron "
                        "dataset's prefix or a .parquet file")
    if not path.is_file():
        raise DataError(f"source {spec!r} does not exist; give a file of tokens (a .bin or .npy) or a Megatron "
                        "dataset's prefix")
    return _flat(path, dtype, eos, raw_dtype)


def _megatron(prefix: str) -> Source:
    idx = Path(f"{prefix}.idx")
    bad = f"{idx} is not a Megatron indexed dataset's index"
    with open(idx, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != MEGATRON_HEADER:
        raise DataError(f"{bad} (it does not begin with MMIDIDX); give the prefix of a .bin/.idx pair that "
                        "Megatron-LM's preprocess_data.py wrote")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
    if version != 1 or code not in MEGATRON_DTYPES:
        raise DataError(f"{idx} is version {version} with dtype code {code}, where this reads version 1 with integer "
                        f"tokens (codes {sorted(MEGATRON_DTYPES)}); write it with Megatron-LM's preprocess_data.py")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    expected = 34 + sequences * (4 + 8) + documents * 8
    if idx.stat().st_size < expected:
        raise DataError(f"{bad}: it is {idx.stat().st_size:,} bytes, shorter than the {expected:,} its counts need "
                        "(cut short?); write it again")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=34, shape=(sequences,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=34 + 4 * sequences, shape=(sequences,))
    starts_at = np.memmap(idx, dtype=np.int64, mode="r", offset=34 + 12 * sequences, shape=(documents,))
    data = Path(f"{prefix}.bin")
    size = data.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"{data} is {size:,} bytes, not a whole number of {dtype.name} tokens; it is damaged")
    tokens = np.memmap(data, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    # Megatron's writer lays the sequences end to end, each pointer the bytes of those before it,
    # and the .bin holds them and nothing more: an index of other data (a stale X.idx beside a
    # new X.bin, say) describes other offsets or another size.
    counts = np.asarray(lengths, dtype=np.int64)
    laid = np.concatenate([[0], np.cumsum(counts)[:-1]]) * dtype.itemsize if sequences else np.zeros(0, np.int64)
    if np.any(counts < 0) or not np.array_equal(np.asarray(pointers, dtype=np.int64), laid) \
            or int(counts.sum()) != len(tokens):
        raise DataError(f"{bad} of {data}: its {sequences:,} sequences of {int(counts.sum()):,} tokens in all, laid "
                        f"end to end, are not the {len(tokens):,} tokens {data.name} holds; give the .bin and .idx "
                        "that Megatron-LM's preprocess_data.py wrote together")
    firsts = np.asarray(pointers, dtype=np.int64) // dtype.itemsize
    ends = firsts + counts
    marks = np.asarray(starts_at, dtype=np.int64)
    if len(marks) and (marks[0] != 0 or marks[-1] != sequences or np.any(np.diff(marks) < 0)) \
            or np.any(np.asarray(lengths) < 0) or (len(ends) and int(ends.max()) > len(tokens)):
        raise DataError(f"{bad} that fits {data} ({sequences:,} sequences, {len(tokens):,} tokens): its offsets "
                        "point outside the data or its documents do not run from the first sequence to the last; "
                        "write it again")
    whole = marks[1:] > marks[:-1]  # (a document of no sequences holds nothing)
    first_seq, last_seq = marks[:-1][whole], marks[1:][whole] - 1
    bounds = np.stack([firsts[first_seq], ends[last_seq]], axis=1) if len(first_seq) else np.zeros((0, 2), np.int64)
    if len(bounds) and np.any(bounds[1:, 0] < bounds[:-1, 1]):
        raise DataError(f"{bad} whose documents lie in order in {data}; write it again")
    return Source(prefix, "megatron", tokens, bounds, empty=int((~whole).sum()))


def _parquet(path: Path, column: str) -> Source:
    """A Parquet file whose rows are documents, each a list of token ids in `column` (as Hugging
    Face datasets' map(tokenize) writes them: input_ids), its schema checked: its tokens are read
    by _spill, into the import's work folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path} cannot be read as Parquet ({e}); it is damaged") from None
    if column not in schema.names:
        raise DataError(f"{path} has no column {column!r} (it has {', '.join(schema.names)}); give the column of "
                        "token ids with --column")
    kind = schema.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise DataError(f"{path}'s column {column!r} holds {kind}, not lists of token ids; give the column of token "
                        "ids with --column")
    return Source(str(path), "parquet", np.zeros(0, kind.value_type.to_pandas_dtype()), np.zeros((0, 2), np.int64),
                  column=column)


def _spill(source: Source, folder: Path, number: int) -> Source:
    """A Parquet source with its tokens: copied a batch of rows at a time into a file in `folder`
    and memory-mapped from there (the list offsets its document bounds), so that a file larger
    than memory imports."""
    import pyarrow.parquet as pq

    dtype, copy = source.tokens.dtype, folder / f"parquet_{number:05d}.tokens"
    lengths, nulls = [np.zeros(0, np.int64)], 0
    with open(copy, "wb") as f:
        for batch in pq.ParquetFile(source.path).iter_batches(batch_size=PARQUET_ROWS, columns=[source.column]):
            ids = batch.column(0)
            holes = ids.null_count + ids.flatten().null_count  # (a null row, or a null id inside one)
            nulls += holes
            offsets = np.asarray(ids.offsets, dtype=np.int64)
            if len(ids) and not holes:  # (a batch with holes is refused below, not converted)
                f.write(np.ascontiguousarray(ids.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]],
                                             dtype=dtype).tobytes())
            lengths.append(np.diff(offsets))
    if nulls:
        raise DataError(f"{source.path}'s column {source.column!r} has {nulls} null value(s), rows or token ids in "
                        "them; fill or drop them")
    ends = np.cumsum(np.concatenate(lengths))
    tokens = np.memmap(copy, dtype=dtype, mode="r") if copy.stat().st_size else np.zeros(0, dtype)
    return replace(source, tokens=tokens, bounds=np.stack([ends - np.concatenate(lengths), ends], axis=1))


def _flat(path: Path, dtype: str | None, eos: int, raw_dtype: str) -> Source:
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":  # a .npy with its header: NumPy says the dtype
        if dtype is not None:
            raise DataError(f"{path} is a NumPy file, whose header names its dtype; drop --dtype")
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"{path} cannot be read as a NumPy array ({e}); it is damaged") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise DataError(f"{path} holds a {tokens.ndim}-dimensional {tokens.dtype} array; a file of tokens is one "
                            "dimension of integers")
    else:
        kind = np.dtype(dtype or raw_dtype)
        size = path.stat().st_size
        if size % kind.itemsize:
            raise DataError(f"{path} is {size:,} bytes, not a whole number of {kind.name} tokens; give its --dtype "
                            f"({', '.join(RAW_DTYPES)})")
        tokens = np.memmap(path, dtype=kind, mode="r") if size else np.zeros(0, kind)
        head = np.asarray(tokens[:1 << 20])
        if dtype is None and kind == np.uint16 and len(head) >= 64 and not head[1::2].any():
            raise DataError(f"{path} read as uint16 tokens has a 0 at every other position: it holds uint32 (or int32) "
                            "tokens; give --dtype uint32")
    ends = [np.flatnonzero(tokens[i:i + BLOCK_TOKENS] == eos) + i + 1 for i in range(0, len(tokens), BLOCK_TOKENS)]
    ends = np.concatenate([*ends, np.zeros(0, np.int64)]).astype(np.int64)
    if not len(ends) or ends[-1] != len(tokens):  # (the last document without its end)
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return Source(str(path), "flat", tokens, np.stack([starts, ends], axis=1))


def _ended(tokens: np.ndarray, bounds: np.ndarray, eos: int) -> np.ndarray:
    """Whether each document `bounds` marks in `tokens` ends with its end-of-document token."""
    ended = np.zeros(len(bounds), bool)
    some = bounds[:, 1] > bounds[:, 0]
    if some.any():
        ended[some] = np.asarray(tokens[bounds[some, 1] - 1]) == eos
    return ended


def _bodies(tokens: np.ndarray, bounds: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each document `bounds` marks in `tokens` (none empty: _without_empty)
    without its end-of-document token, where it has one."""
    return bounds[:, 0], bounds[:, 1] - bounds[:, 0] - _ended(tokens, bounds, eos)


def _without_empty(source: Source, eos: int) -> Source:
    """`source` without its empty documents (no tokens, or an end-of-document token alone), counted
    as empty."""
    bounds = source.bounds
    keep = bounds[:, 1] - bounds[:, 0] - _ended(source.tokens, bounds, eos) > 0
    return replace(source, bounds=bounds[keep], empty=source.empty + int((~keep).sum())) if not keep.all() else source


def _documents(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, eos: int,
               dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents at (starts, lengths) as shards hold them, each followed by `eos`, in `dtype`,
    and their offsets (from 0)."""
    offsets = np.concatenate([[0], np.cumsum(lengths + 1)]).astype(np.int64)
    out = np.full(int(offsets[-1]), eos, dtype=dtype)
    if len(lengths):
        base = int(starts.min())
        window = np.asarray(tokens[base:int((starts + lengths).max())])
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[np.repeat(offsets[:-1], lengths) + within] = window[np.repeat(starts - base, lengths) + within]
    return out, offsets


def _blocks(bounds: np.ndarray) -> Iterator[slice]:
    """Runs of consecutive documents of about BLOCK_TOKENS tokens (at least one document each)."""
    if not len(bounds):
        return
    cuts = np.searchsorted(bounds[:, 1] - bounds[0, 0], np.arange(BLOCK_TOKENS, int(bounds[-1, 1] - bounds[0, 0]),
                                                                   BLOCK_TOKENS), side="left")
    edges = np.unique(np.concatenate([[0], cuts + 1, [len(bounds)]]).clip(0, len(bounds)))
    for a, b in zip(edges, edges[1:]):
        yield slice(int(a), int(b))


IMPORT_VERSION = 1  # bump when the same sources and options would import differently


def import_tokens(sources: list[str], out: str | Path, tokenizer: str | Path, *, fmt: str = "auto",
                  dtype: str | None = None, eos: int | None = None, val_fraction: float = 0.005, seed: int = 0,
                  overwrite: bool = False, column: str | None = None) -> ImportResult:
    """Copy the documents of `sources` (read_source's) into data directory `out`, tokenized by
    `tokenizer` (a tokenizer.json: the one the tokens were made with); `eos`: the end-of-document
    id, by default the tokenizer's end-of-text token. An interrupted import, run again the same,
    starts again; run again unchanged once finished, it reuses what it wrote."""
    out = Path(out)
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is not one this reads; give one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in RAW_DTYPES:
        raise DataError(f"dtype {dtype!r} is not one a file of tokens is read as; give one of {', '.join(RAW_DTYPES)}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"the validation fraction must be in [0, 1), not {val_fraction}")
    if not sources:
        raise DataError("no sources given; give Megatron dataset prefixes or files of tokens")
    found = kind_of(out)
    if (out.exists() and not out.is_dir()) or found not in (None, "prepared data directory"):
        raise DataError(f"output {str(out)!r} is {'a file' if not out.is_dir() else f'a {found}'}; give a new "
                        "directory to import the data into")
    if found is None:
        refuse_foreign_files(out, "import")
    tok = load_tokenizer(tokenizer)
    vocab = tokenizer_vocab_size(tok)
    end = eos_id(tok, tokenizer) if eos is None else eos
    if not 0 <= end < vocab:
        raise DataError(f"--eos-id {end} is not one of the tokenizer's {vocab:,} ids")
    read = [read_source(spec, fmt, dtype, end, token_dtype(vocab).name, column) for spec in sources]
    if column is not None and not any(source.format == "parquet" for source in read):
        raise DataError("--column names a Parquet file's column of token ids, and no source is a Parquet file: drop it")
    tokenizer_file = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    tokenizer_text = tokenizer_file.read_bytes()
    key = hashlib.sha256(json.dumps({
        "version": IMPORT_VERSION, "sources": [[s.path, s.format, s.tokens.dtype.name, _identity(s)] for s in read],
        "column": column, "tokenizer": hashlib.sha256(tokenizer_text).hexdigest(), "eos": end,
        "val_fraction": val_fraction, "seed": seed}, sort_keys=True).encode()).hexdigest()
    if is_complete(out, key):
        stats = json.loads((out / "stats.json").read_text())
        return ImportResult(out, stats, reused=True, warnings=stats.get("warnings", []))
    unfinished = out / "work" / "key"
    ours = unfinished.is_file() and unfinished.read_text() == key  # (this import, interrupted: started again)
    if not ours and not overwrite and any((out / name).exists() for name in ("manifest.json", "index.json", "work")):
        raise DataError(f"{str(out)!r} holds a data directory already (or an unfinished prepare or import of another "
                        "one); give another output directory, or --overwrite to replace it (runs trained on it would "
                        "then no longer resume)")
    clear_data_dir(out)
    (out / "work").mkdir(parents=True)
    unfinished.write_text(key)  # (read_index calls the directory unfinished while it is here)
    try:
        read = [_spill(source, out / "work", number) if source.format == "parquet" else source
                for number, source in enumerate(read)]
        return _write(out, read, tok, tokenizer, tokenizer_file, vocab, end, key, fmt, val_fraction, seed)
    except DataError:  # (bad data found on the way: nothing half-written is left)
        clear_data_dir(out)
        raise


def _write(out: Path, read: list[Source], tok, tokenizer, tokenizer_file: Path, vocab: int, end: int, key: str,
           fmt: str, val_fraction: float, seed: int) -> ImportResult:
    """import_tokens' copy of the documents into out, its index, stats and manifest."""

    # The validation split: a seeded draw per document, at least one each way where there are two
    # (as data prepare's: train measures the validation loss before its first step), of the documents
    # that hold something: empty ones are left out first.
    marked = [len(source.bounds) for source in read]  # (documents its end-of-document ids mark, empty ones too)
    read = [_without_empty(source, end) for source in read]
    counts = [len(source.bounds) for source in read]
    rng = np.random.default_rng(seed)
    held = np.concatenate([rng.random(n) < val_fraction for n in counts] or [np.zeros(0, bool)])
    if val_fraction > 0 and len(held) >= 2 and not held.any():
        held[-1] = True
    if len(held) and held.all():
        held[0] = False
    kind = token_dtype(vocab)
    writers = {"train": ShardWriter(out, "train", vocab, end), "val": ShardWriter(out, "val", vocab, end)}
    empty, begins, warnings = sum(source.empty for source in read), [], []
    bos = bos_id(tok)
    first = 0
    for source, n, ends in zip(read, counts, marked):
        if ends == 1 and len(source.tokens) > BLOCK_TOKENS:
            warnings.append(f"{source.path} is one document of {len(source.tokens):,} tokens: its end-of-document id "
                            f"{end} never comes before its end (is --eos-id, or the tokenizer, the data's?)")
        for block in _blocks(source.bounds):
            drawn = held[first + block.start:first + block.stop]
            for split, chosen in (("train", source.bounds[block][~drawn]), ("val", source.bounds[block][drawn])):
                starts, lengths = _bodies(source.tokens, chosen, end)
                if len(starts) == 1:  # (perhaps a long one: copied a slice at a time, not five times its size)
                    start, length = int(starts[0]), int(lengths[0])
                    pieces = [_check_ids(source, source.tokens[i:min(i + BLOCK_TOKENS, start + length)], vocab,
                                         tokenizer).astype(kind) for i in range(start, start + length, BLOCK_TOKENS)]
                    writers[split].extend_document(pieces)
                    begins.append(bos is not None and int(source.tokens[start]) == bos)
                elif len(starts) > 1:
                    _check_ids(source, source.tokens[int(starts.min()):int((starts + lengths).max())], vocab, tokenizer)
                    tokens, offsets = _documents(source.tokens, starts, lengths, end, kind)
                    begins.append(bos is not None and bool(np.all(tokens[offsets[:-1]] == bos)))
                    writers[split].extend(tokens, offsets)
        first += n
    splits = {split: writer.close() for split, writer in writers.items()}
    if not splits["train"]["documents"]:
        raise DataError(f"the sources hold no documents ({len(held) + empty:,} read, {empty:,} of them empty: nothing but an "
                        "end-of-document token); give the files or prefixes of the tokenized data")
    if not splits["val"]["documents"]:
        warnings.append("the validation split is empty (" + ("a validation fraction of 0" if val_fraction == 0 else
                        "a single document") + "): train measures its validation loss on it and refuses a run on this "
                        "data; import with a --val-fraction above 0 and two documents or more")
    # Documents that all begin with the tokenizer's beginning-of-sequence token were made with it:
    # tasks and prompts then begin with it too (data/prepare.py's bos_id).
    starts_with_bos = bos is not None and bool(begins) and all(begins)
    shutil.copyfile(tokenizer_file, out / "tokenizer.json")
    stats = {"documents": {"read": len(held) + sum(source.empty for source in read),
                           "kept": splits["train"]["documents"] + splits["val"]["documents"], "dropped": {"empty": empty},
                           "train": splits["train"]["documents"], "val": splits["val"]["documents"]},
             "tokens": {"read": sum(len(source.tokens) for source in read), "train": splits["train"]["tokens"],
                        "val": splits["val"]["tokens"]},
             "vocab_size": vocab, "eos_id": end, **({"bos_id": bos} if starts_with_bos else {}),
             "imported": [{"path": s.path, "format": s.format, "dtype": s.tokens.dtype.name, "documents": n + s.empty}
                          for s, n in zip(read, counts)],
             "warnings": warnings}
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    write_index(out, vocab, end, splits, bos_id=bos if starts_with_bos else None)
    (out / "manifest.json").write_text(json.dumps({  # last: a directory without it is not finished
        "key": key, "imported": [s.path for s in read],
        "options": {"vocab_size": vocab, "format": fmt, "eos_id": end, "val_fraction": val_fraction, "seed": seed},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=1))
    shutil.rmtree(out / "work")
    return ImportResult(out, stats, reused=False, warnings=warnings)


def _check_ids(source: Source, tokens: np.ndarray, vocab: int, tokenizer) -> np.ndarray:
    """`tokens` (read), refused where an id is not one of the tokenizer's (before the shards' dtype,
    into which a larger or negative id would wrap)."""
    tokens = np.asarray(tokens)
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab else int(tokens.min())
        raise DataError(f"{source.path} holds token id {bad}, not one of the {vocab:,} ids of {tokenizer}; give the "
                        "tokenizer the data was made with" + (" (or, for a raw file, the --dtype it was written in)"
                                                              if source.format == "flat" else ""))
    return tokens


def _identity(source: Source) -> list:
    """What says a source is unchanged: its files' sizes and modification times."""
    files = [Path(f"{source.path}.idx"), Path(f"{source.path}.bin")] if source.format == "megatron" \
        else [Path(source.path)]
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
