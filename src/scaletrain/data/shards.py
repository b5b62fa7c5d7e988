"""Token shards on disk: flat uint16/uint32 token files plus document offsets, named by index.json.

Layout of a data directory's token part:

    index.json                      {"version", "dtype", "vocab_size", "eos_id", "splits": {...}}
    shards/train_00000_00000.bin        tokens of whole documents, each followed by eos_id (data
                                        prepare's names: its chunk, then the shard of that chunk)
    shards/train_00000_00000.docs.npy   int64 offsets of length documents + 1 into that shard

Document offsets live in one .npy per shard rather than inside index.json: a corpus of
millions of documents would make index.json too large to read on every start, while a
memory-mapped .npy costs nothing until it is used.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.errors import UserError

INDEX_VERSION = 1
# A data directory's files beside its shards (`data prepare`'s, `data import`'s), the manifest
# first: written last, removed first, so that a directory without it is never taken for finished.
DATA_FILES = ("manifest.json", "index.json", "stats.json", "tokenizer.json")
DATA_FOLDERS = ("shards", "work", "rejects")  # (the shards; a prepare's or import's work, and rejects)
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens: 512 MB of uint16 per shard


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends tokenized documents to the shards of one split; `close()` returns its index entry."""

    def __init__(self, data_dir: str | Path, split: str, vocab_size: int, eos_id: int,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, prefix: str | None = None):
        """Shards are named shards/{prefix}_{n:05d}.bin; prefix defaults to the split's name
        (parallel writers of one split give each its own prefix)."""
        self.root = Path(data_dir)
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        self.split, self.eos_id, self.shard_tokens = split, eos_id, shard_tokens
        self.prefix = prefix or split
        self.dtype = token_dtype(vocab_size)
        self.shards: list[dict] = []
        self._pieces: list[np.ndarray] = []
        self._offsets: list[int] = [0]

    def add(self, ids) -> None:
        """Add one document (its ids, without the end-of-document token, which is appended here)."""
        doc = np.empty(len(ids) + 1, dtype=self.dtype)
        doc[:-1] = ids
        doc[-1] = self.eos_id
        self._pieces.append(doc)
        self._offsets.append(self._offsets[-1] + len(doc))
        if self._offsets[-1] >= self.shard_tokens:
            self._flush()

    def extend(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        """Add whole documents at once: `tokens`, each document followed by the end-of-document id
        already, and where they begin and the last ends in them (`offsets`, from 0)."""
        self._pieces.append(tokens.astype(self.dtype, copy=False))
        self._offsets.extend((np.asarray(offsets[1:], dtype=np.int64) + self._offsets[-1]).tolist())
        if self._offsets[-1] >= self.shard_tokens:
            self._flush()

    def extend_document(self, pieces: list[np.ndarray]) -> None:
        """Add one document given in pieces (its ids, without the end-of-document token, which is
        appended here)."""
        self._pieces += [*(piece.astype(self.dtype, copy=False) for piece in pieces),
                         np.array([self.eos_id], dtype=self.dtype)]
        self._offsets.append(self._offsets[-1] + sum(len(piece) for piece in pieces) + 1)
        if self._offsets[-1] >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if len(self._offsets) == 1:
            return
        name = f"{self.prefix}_{len(self.shards):05d}"
        bin_rel, docs_rel = f"shards/{name}.bin", f"shards/{name}.docs.npy"
        _write_atomic(self.root / bin_rel, np.concatenate(self._pieces).tobytes())
        np.save(self.root / docs_rel, np.asarray(self._offsets, dtype=np.int64))
        self.shards.append({"path": bin_rel, "docs": docs_rel,
                            "tokens": self._offsets[-1], "documents": len(self._offsets) - 1})
        self._pieces, self._offsets = [], [0]

    def close(self) -> dict:
        self._flush()
        return {"tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards),
                "shards": self.shards}


def write_index(data_dir: str | Path, vocab_size: int, eos_id: int, splits: dict[str, dict],
                bos_id: int | None = None) -> None:
    """index.json; `bos_id`: the id every document begins with, where the tokenizer has one."""
    index = {"version": INDEX_VERSION, "dtype": token_dtype(vocab_size).name,
             "vocab_size": vocab_size, "eos_id": eos_id, **({"bos_id": bos_id} if bos_id is not None else {}),
             "splits": splits}
    _write_atomic(Path(data_dir) / "index.json", json.dumps(index, indent=1).encode())


def finished_key(data_dir: Path) -> str | None:
    """The key of the finished prepare or import in data_dir (its manifest's), if any."""
    try:
        return json.loads((data_dir / "manifest.json").read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def refuse_foreign_files(out: Path, verb: str) -> None:
    """Refuse an output directory, not yet a data directory, that holds more than a data
    directory's own files (DATA_FILES) and empty folders of the names prepare and import write
    (shards, work, rejects: a non-empty one would be cleared): a user's files, which data must not
    be written among or over. `verb`: what the command does there ("prepare", "import"). Hidden
    files and a mount point's lost+found are not counted."""
    def foreign(p: Path) -> bool:
        if p.name in DATA_FILES or p.name.startswith(".") or p.name == "lost+found":
            return False
        return not (p.name in DATA_FOLDERS and p.is_dir() and not any(p.iterdir()))
    others = sorted(p.name for p in out.iterdir() if foreign(p)) if out.is_dir() else []
    if others:
        raise DataError(f"output {str(out)!r} holds other files ({', '.join(others[:3])}"
                        f"{', ...' if len(others) > 3 else ''}); give a new or empty directory to {verb} the data into")


def clear_data_dir(data_dir: Path) -> None:
    """Remove a data directory's files (DATA_FILES), its shards and a prepare's or import's work
    and rejects from data_dir, and only those."""
    for name in DATA_FILES:
        (data_dir / name).unlink(missing_ok=True)
    for folder in ("work", "rejects"):
        shutil.rmtree(data_dir / folder, ignore_errors=True)
    shards = data_dir / "shards"
    if shards.is_dir():
        for path in shards.iterdir():
            if path.name.startswith(("train_", "val_")):
                path.unlink()


def is_complete(data_dir: Path, key: str) -> bool:
    """data_dir holds a finished prepare or import with this key: its manifest matches, every
    file exists, and each shard is the length, with the document offsets, that index.json says."""
    try:
        manifest = json.loads((data_dir / "manifest.json").read_text())
        index = read_index(data_dir)
    except (OSError, ValueError, KeyError):  # DataError is a ValueError
        return False
    if manifest.get("key") != key or not all((data_dir / name).is_file() for name in DATA_FILES):
        return False
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in index["splits"].values():
        for shard in split["shards"]:
            bin_path = data_dir / shard["path"]
            if not bin_path.is_file() or bin_path.stat().st_size != shard["tokens"] * itemsize:
                return False
            try:
                document_offsets(data_dir, shard)
            except DataError:
                return False
    return True


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


class DataError(UserError, ValueError):
    """A data directory that cannot be read; the message says what is wrong and how to fix it."""


def read_index(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "index.json"
    if Path(data_dir).exists() and not Path(data_dir).is_dir():
        hint = (f"; give its folder {str(Path(data_dir).parent)!r}" if Path(data_dir).name in ("index.json", "manifest.json")
                else "; give the directory `scaletrain data prepare` wrote (it holds index.json and shards/)")
        raise DataError(f"data directory {str(data_dir)!r} is a file, not a prepared data directory{hint}")
    if not Path(data_dir).is_dir():
        raise DataError(f"data directory {str(data_dir)!r} does not exist; create it with `scaletrain data prepare`")
    if not path.is_file() and (Path(data_dir) / "work" / "key").is_file():
        raise DataError(f"{str(data_dir)!r} holds a prepare or import that did not finish; run the same `scaletrain "
                        "data prepare` (or `data import`) command again to finish it")
    if not path.is_file():
        raise DataError(f"{str(data_dir)!r} has no index.json, so it is not a prepared data directory; "
                        "create it with `scaletrain data prepare`")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); prepare the data directory again") from None
    if index.get("version") != INDEX_VERSION:
        raise DataError(f"{path} has version {index.get('version')!r}, this scaletrain reads {INDEX_VERSION}; "
                        "prepare the data directory again")
    if index.get("dtype") not in ("uint16", "uint32") or not isinstance(index.get("vocab_size"), int) \
            or not isinstance(index.get("splits"), dict):
        raise DataError(f"{path} is damaged (its dtype {index.get('dtype')!r}, vocab_size {index.get('vocab_size')!r} "
                        "or splits are not what data prepare writes); prepare the data directory again")
    ids = 2 ** (16 if index["dtype"] == "uint16" else 32)  # (the token ids its dtype holds)
    if not 0 < index["vocab_size"] <= ids or not (isinstance(index.get("eos_id"), int)
                                                   and 0 <= index["eos_id"] < index["vocab_size"]):
        raise DataError(f"{path} is damaged (vocab_size {index['vocab_size']!r} with end-of-document id "
                        f"{index.get('eos_id')!r} in {index['dtype']}, where data prepare writes 1 to {ids:,} tokens "
                        "and an id below them); prepare the data directory again")
    return index


@functools.lru_cache(maxsize=4)
def _tokenizer_ids(text: bytes) -> int:
    """How many ids the tokenizer of this tokenizer.json gives (parsed once a process: a search
    reads its data's indexes at every run's start)."""
    from tokenizers import Tokenizer

    from scaletrain.data.tokenizer import vocab_size

    return vocab_size(Tokenizer.from_str(text.decode()))


def read_indexes(sources: dict[str, Path]) -> dict[str, dict]:
    """The index of each named data directory, checked to share one tokenizer (the directories of
    a mixture must: the model sees one vocabulary)."""
    indexes, tokenizers = {}, {}
    for name, path in sources.items():
        indexes[name] = read_index(path)
        tokenizer = Path(path) / "tokenizer.json"
        tokenizers[name] = tokenizer.read_bytes() if tokenizer.is_file() else None
    if len(set(tokenizers.values())) > 1:
        raise DataError(f"the data directories {', '.join(map(str, sources.values()))} have different tokenizers; "
                        "prepare them with one (`data prepare --tokenizer DIR/tokenizer.json`)")
    text = next(iter(tokenizers.values()), None)
    if text is not None:  # (ids its tokenizer gives past the index's vocab_size would fail in the embedding)
        try:
            ids = _tokenizer_ids(text)
        except Exception as e:  # (a tokenizer.json edited or cut)
            raise DataError(f"{str(Path(next(iter(sources.values()))) / 'tokenizer.json')!r} is not a tokenizer "
                            f"({type(e).__name__}); prepare the data directory again") from None
        small = {name: index["vocab_size"] for name, index in indexes.items() if index["vocab_size"] < ids}
        if small:
            name = next(iter(small))
            raise DataError(f"{sources[name]}/index.json says vocab_size {small[name]:,}, but its tokenizer gives ids up "
                            f"to {ids - 1:,}; it is damaged: prepare the data directory again")
    # (tasks and prompts begin as the documents do: the directories must agree, a mixture's too)
    begins = {name: index.get("bos_id") for name, index in indexes.items()}
    if len(set(begins.values())) > 1:
        raise DataError(f"the data directories {', '.join(map(str, sources.values()))} begin documents differently "
                        f"(beginning-of-sequence id by directory: {begins}); prepare them alike, all with the "
                        "tokenizer's beginning-of-sequence token or all with --no-bos")
    return indexes


@dataclass
class TokenSplit:
    """One split's shards as a single read-only token sequence (memory-mapped, never loaded whole)."""

    shards: list[np.memmap]
    starts: np.ndarray  # (n_shards + 1,) cumulative token offsets
    eos_id: int
    vocab_size: int

    @property
    def tokens(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated split, as int64."""
        if start < 0 or start + length > self.tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside a split of {self.tokens}")
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.starts[i])
            take = min(length - filled, len(self.shards[i]) - offset)
            out[filled:filled + take] = self.shards[i][offset:offset + take]
            check_ids(out[filled:filled + take], self.vocab_size, self.shards[i])
            filled += take
            i += 1
        return out


def check_ids(tokens: np.ndarray, vocab_size: int, shard: np.memmap) -> None:
    """DataError when a shard's tokens hold an id the tokenizer does not have: a damaged file, which
    would otherwise index past the embedding (an IndexError on a CPU, a device-side assert on a GPU)."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(f"shard {shard.filename} holds token id {int(tokens.max())}, beyond the {vocab_size} ids of "
                        "its tokenizer: the file is damaged; prepare the data directory again")


def document_offsets(data_dir: str | Path, shard: dict) -> np.ndarray:
    """Where each document of one shard (an entry of index.json) starts, and where the last ends:
    int64, documents + 1 of them, rising from 0 to the shard's tokens. DataError when the file is
    missing, unreadable or does not fit the shard."""
    path = Path(data_dir) / shard["docs"]
    again = "prepare the data directory again"
    try:
        offsets = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"document offsets {path} cannot be read ({e}); {again}") from None
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) != shard["documents"] + 1 \
            or offsets[0] != 0 or offsets[-1] != shard["tokens"] or np.any(np.diff(offsets) <= 0):
        raise DataError(f"document offsets {path} do not describe that shard's {shard['documents']} documents of "
                        f"{shard['tokens']} tokens (rising offsets from 0 to {shard['tokens']}); {again}")
    return offsets.astype(np.int64, copy=False)


def open_split(data_dir: str | Path, split: str) -> TokenSplit:
    index = read_index(data_dir)
    if split not in index["splits"]:
        raise DataError(f"data directory {str(data_dir)!r} has no {split!r} split "
                        f"(it has {', '.join(index['splits']) or 'none'})")
    entry = index["splits"][split]
    dtype = np.dtype(index["dtype"])
    shards = []
    for shard in entry["shards"]:
        path = Path(data_dir) / shard["path"]
        if not path.is_file() or path.stat().st_size != shard["tokens"] * dtype.itemsize:
            raise DataError(f"shard {path} is missing or not {shard['tokens']} tokens long; "
                            "prepare the data directory again")
        shards.append(np.memmap(path, dtype=dtype, mode="r"))
    starts = np.concatenate([[0], np.cumsum([len(s) for s in shards], dtype=np.int64)])
    return TokenSplit(shards, starts, int(index["eos_id"]), int(index["vocab_size"]))
