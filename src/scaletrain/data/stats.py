"""`scaletrain data stats`: what a prepared data directory holds, as numbers and a histogram.

Everything is computed from the directory's own files: stats.json for what preparation read
and removed, the shards' document offsets for lengths, and the tokens themselves (sampled
past `max_tokens`) for the most frequent tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from scaletrain.data.shards import DataError, check_ids, document_offsets, open_split, read_index

PERCENTILES = (5, 25, 50, 75, 95, 99)


def document_lengths(data_dir: Path, split: str) -> np.ndarray:
    """Tokens of every document of a split (end-of-document token included), int64."""
    index = read_index(data_dir)
    shards = index["splits"].get(split, {}).get("shards", [])
    lengths = [np.diff(document_offsets(data_dir, shard)) for shard in shards]
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def token_counts(data_dir: Path, max_tokens: int = 50_000_000) -> tuple[np.ndarray, int]:
    """Occurrences of each token id in the training split, from at most `max_tokens` tokens
    spread evenly over the shards; returns (counts by id, tokens counted)."""
    split = open_split(data_dir, "train")  # (checks every shard is there, of the length index.json says)
    total = split.tokens or 1
    counts = np.zeros(split.vocab_size, dtype=np.int64)
    counted = 0
    for tokens in split.shards:
        take = min(len(tokens), max(1, max_tokens * len(tokens) // total))
        stride = max(1, len(tokens) // take)
        sample = np.asarray(tokens[::stride][:take])
        check_ids(sample, split.vocab_size, tokens)
        counts += np.bincount(sample, minlength=len(counts))
        counted += len(sample)
    return counts, counted


def describe(data_dir: str | Path, top: int = 20) -> dict:
    """The summary `data stats` prints: documents, tokens, removals by reason, duplicate rate,
    document-length percentiles (in tokens) and the most frequent tokens."""
    data_dir = Path(data_dir)
    index = read_index(data_dir)
    stats_path = data_dir / "stats.json"
    try:
        prepared = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{stats_path} is not valid JSON ({e}); prepare the data directory again") from None
    documents = prepared.get("documents", {}) if isinstance(prepared, dict) else None
    dropped = documents.get("dropped", {}) if isinstance(documents, dict) else None
    read = documents.get("read", 0) if isinstance(documents, dict) else None
    if not (isinstance(dropped, dict) and all(isinstance(n, int) for n in dropped.values()) and isinstance(read, int)):
        raise DataError(f"{stats_path} is not the stats.json `data prepare` writes (documents read and dropped by "
                        "reason); prepare the data directory again")
    dropped = {reason: n for reason, n in dropped.items() if n}
    duplicates = sum(n for reason, n in dropped.items() if "duplicate" in reason)
    lengths = document_lengths(data_dir, "train")
    counts, counted = token_counts(data_dir)
    order = np.argsort(-counts, kind="stable")[:top]
    tokenizer = _tokenizer(data_dir)
    return {
        "data_dir": str(data_dir),
        "documents": {split: entry["documents"] for split, entry in index["splits"].items()},
        "tokens": {split: entry["tokens"] for split, entry in index["splits"].items()},
        "documents_read": read,
        "dropped": dropped,
        "duplicate_rate": duplicates / read if read else 0.0,
        "length_percentiles": {p: int(np.percentile(lengths, p)) for p in PERCENTILES} if len(lengths) else {},
        "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
        "top_tokens": [{"id": int(i), "token": tokenizer(int(i)), "share": counts[i] / max(counted, 1)}
                       for i in order if counts[i]],
    }


def _tokenizer(data_dir: Path):
    """id -> readable text of the token (falls back to the id where there is no tokenizer)."""
    path = data_dir / "tokenizer.json"
    if not path.is_file():
        return str
    from scaletrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)  # (a damaged one refused in a sentence)
    return lambda i: tokenizer.decode([i], skip_special_tokens=False)


def plot_lengths(data_dir: str | Path, out: str | Path) -> Path:
    """A histogram PNG of training documents' lengths in tokens (log-spaced bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = document_lengths(Path(data_dir), "train")
    if not len(lengths):
        raise DataError(f"{data_dir} has no training documents to plot")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    bins = np.logspace(0, np.log10(max(lengths.max(), 2)), 50)
    ax.hist(lengths, bins=bins, color="#3b6ea8")
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    median = float(np.median(lengths))
    ax.axvline(median, color="#c0392b", linestyle="--", label=f"median {median:,.0f}")
    ax.legend()
    ax.set_title(f"{Path(data_dir).name}: {len(lengths):,} training documents, {int(lengths.sum()):,} tokens")
    fig.tight_layout()
    out = Path(out)
    if not out.parent.is_dir():
        plt.close(fig)
        raise DataError(f"cannot write the histogram to {out}: {out.parent} is not a directory")
    fig.savefig(out)
    plt.close(fig)
    return out
