"""Near-duplicate recall, false positives and speed of MinHash implementations, on planted copies of real text.

Prints one JSON object. The corpus: docstrings and function sources (>= 100 words) from the
running interpreter's standard library, kept only when their word 5-gram Jaccard similarity
with every document kept before is below 0.3, so that the originals are truly distinct.
Planted after them, in random order: near-copies of some originals with --edit-rate of
their words edited (each edit a substitution, insertion or deletion at a random position,
by a word from the corpus), and exact copies that differ only in case and whitespace.

For each candidate implementation of `MinHasher.signature` (all use the same words, 5-gram
shingles, 14 x 8 banding and `DedupIndex`):

    recall          planted near-copies flagged as duplicates
    fpr             distinct originals flagged as duplicates
    exact_recall    planted exact copies flagged "exact_duplicate"
    docs_per_s, mb_per_s    signature() alone, one process, over every document of the stream

    rensa_rminhash  rensa's R-MinHash over our 64-bit shingle hashes (what dedup.py uses)
    rensa_cminhash  rensa's C-MinHash over the same shingle hashes
    numpy           classic MinHash: (a*x + b) mod 2^64 for all shingles at once, top 32 bits
    datasketch      datasketch.MinHash.update_batch of shingle strings, its default SHA-1 hash
    datasketch_xxh  the same with hashfunc=xxhash.xxh32_intdigest

Then, for the chosen implementation: detection against true Jaccard similarity (from a sweep
of edit rates) next to the banding theory 1 - (1 - s^r)^b; recall and false-positive rate of
other (bands, rows); and memory and speed of the index per document (ours, datasketch's
MinHashLSH, rensa's RMinHashLSH) on random signatures.

    .venv/bin/python benchmarks/dedup_recall.py [--originals 4000] [--near 1000] [--exact 300]
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import random
import re
import sysconfig
import time
import tracemalloc
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import datasketch
import numpy as np
import rensa
import xxhash

from planted import edit  # benchmarks/planted.py, beside this script
from scaletrain.data.dedup import (_EMPTY, _WORD, _WORD_TABLE, DedupIndex, MinHasher, _gram_hashes, _splitmix64,
                                   _word_hashes, _words, exact_key)

BANDS, ROWS, NGRAM = 14, 8, 5
WORD_SPAN = re.compile(r"\w+")


# -- the corpus -------------------------------------------------------------------------------

def stdlib_texts(min_words: int = 100, max_words: int = 3000) -> list[str]:
    """Docstrings and function sources of the standard library with min_words..max_words words, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    texts.append(docstring)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                texts.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
    return [t for t in texts if min_words <= len(WORD_SPAN.findall(t)) <= max_words]


def shingle_set(text: str) -> set[int]:
    words = _word_hashes(_words(text, _WORD, _WORD_TABLE))
    return set(_gram_hashes(words, min(NGRAM, len(words))).tolist())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b)


def distinct(texts: list[str], threshold: float) -> list[str]:
    """Texts whose exact 5-gram Jaccard similarity with every text kept before is below threshold."""
    postings: dict[int, list[int]] = {}
    sizes, kept = [], []
    for text in texts:
        shingles = shingle_set(text)
        shared = Counter(doc for s in shingles for doc in postings.get(s, ()))
        if any(c / (len(shingles) + sizes[doc] - c) >= threshold for doc, c in shared.items()):
            continue
        for s in shingles:
            postings.setdefault(s, []).append(len(kept))
        sizes.append(len(shingles))
        kept.append(text)
    return kept


def recase(text: str, rng: random.Random) -> str:
    """The same words with random case and random whitespace between them: an exact duplicate."""
    parts = text.split()
    flipped = [p.upper() if rng.random() < 0.3 else p for p in parts]
    return rng.choice(("", "  ", "\n")) + "".join(w + rng.choice((" ", "  ", "\n", "\t ")) for w in flipped)


# -- the candidates ---------------------------------------------------------------------------

def _shingles(text: str) -> np.ndarray | None:
    words = _word_hashes(_words(text, _WORD, _WORD_TABLE))
    return _gram_hashes(words, min(NGRAM, len(words))) if len(words) else None


class NumpyMinHasher:
    """Classic MinHash: num_perm universal hashes (a*x + b) mod 2^64, a odd, over all shingles at once."""

    def __init__(self, num_perm: int, seed: int = 0):
        constants = _splitmix64(seed + 0x6A09E667F3BCC908, 2 * num_perm)
        self.a = (np.array(constants[:num_perm], dtype=np.uint64) | np.uint64(1))[:, None]
        self.b = np.array(constants[num_perm:], dtype=np.uint64)[:, None]
        self.num_perm = num_perm

    def signature(self, text: str) -> np.ndarray:
        shingles = _shingles(text)
        if shingles is None:
            return np.full(self.num_perm, _EMPTY, dtype=np.uint32)
        low = np.full(self.num_perm, np.iinfo(np.uint64).max, dtype=np.uint64)
        for start in range(0, len(shingles), 4096):  # bounds the (num_perm, shingles) temporary to 4 MB
            permuted = self.a * shingles[start:start + 4096]
            permuted += self.b
            np.minimum(low, permuted.min(axis=1), out=low)
        return (low >> np.uint64(32)).astype(np.uint32)  # the top bits: the low bits of a*x+b are weak


class CMinHasher:
    def __init__(self, num_perm: int, seed: int = 0):
        self.num_perm, self.seed = num_perm, seed

    def signature(self, text: str) -> np.ndarray:
        shingles = _shingles(text)
        if shingles is None:
            return np.full(self.num_perm, _EMPTY, dtype=np.uint32)
        digest = rensa.CMinHash.digests64_from_token_hash_sets([shingles], self.num_perm, self.seed)[0]
        return (np.array(digest, dtype=np.uint64) >> np.uint64(32)).astype(np.uint32)


class DatasketchMinHasher:
    """datasketch as its documentation shows it: MinHash.update_batch over shingle strings."""

    def __init__(self, num_perm: int, seed: int = 0, hashfunc=None):
        self.num_perm, self.seed, self.hashfunc = num_perm, seed, hashfunc
        # Permutations are drawn once and shared, as datasketch recommends for many sketches.
        self.permutations = datasketch.MinHash(num_perm=num_perm, seed=seed).permutations

    def signature(self, text: str) -> np.ndarray:
        words = _words(text, _WORD, _WORD_TABLE)
        if not words:
            return np.full(self.num_perm, _EMPTY, dtype=np.uint32)
        n = min(NGRAM, len(words))
        sketch = datasketch.MinHash(num_perm=self.num_perm, seed=self.seed, permutations=self.permutations,
                                    scheme="affine32", **({"hashfunc": self.hashfunc} if self.hashfunc else {}))
        sketch.update_batch([b" ".join(words[i:i + n]) for i in range(len(words) - n + 1)])
        return sketch.digest().astype(np.uint32)


def candidates(num_perm: int) -> dict:
    return {"rensa_rminhash": MinHasher(BANDS, ROWS, NGRAM), "rensa_cminhash": CMinHasher(num_perm),
            "numpy": NumpyMinHasher(num_perm), "datasketch": DatasketchMinHasher(num_perm),
            "datasketch_xxh": DatasketchMinHasher(num_perm, hashfunc=xxhash.xxh32_intdigest)}


# -- measurements ------------------------------------------------------------------------------

def run_stream(hasher, stream, bands=BANDS, rows=ROWS) -> dict:
    """Signatures and index verdicts for the stream [(text, kind)], kind one of original/near/exact."""
    start = time.perf_counter()
    signatures = [hasher.signature(text) for text, _ in stream]
    seconds = time.perf_counter() - start
    index = DedupIndex(bands, rows)
    start = time.perf_counter()
    verdicts = [index.add(exact_key(text), sig) for (text, _), sig in zip(stream, signatures)]
    index_seconds = time.perf_counter() - start
    by_kind = {kind: [v for (_, k), v in zip(stream, verdicts) if k == kind] for kind in ("original", "near", "exact")}
    mb = sum(len(text.encode()) for text, _ in stream) / 1e6
    return {"recall": _rate(v is not None for v in by_kind["near"]),
            "fpr": _rate(v is not None for v in by_kind["original"]),
            "false_positives": sum(v is not None for v in by_kind["original"]),
            "exact_recall": _rate(v == "exact_duplicate" for v in by_kind["exact"]),
            "docs_per_s": round(len(stream) / seconds), "mb_per_s": round(mb / seconds, 2),
            "exact_key_and_index_add_per_s": round(len(stream) / index_seconds)}


def _rate(flags) -> float:
    flags = list(flags)
    return round(sum(flags) / len(flags), 4) if flags else float("nan")


def detection_curve(hasher, originals, vocabulary, rng, rates=(0.01, 0.02, 0.03, 0.05, 0.08, 0.12), per_rate=300):
    """Detection of single near-copies against their true 5-gram Jaccard, next to the banding theory."""
    pairs = []
    for rate in rates:
        for text in rng.sample(originals, per_rate):
            copy = edit(text, rate, vocabulary, rng)
            index = DedupIndex(BANDS, ROWS)
            index.add(exact_key(text), hasher.signature(text))
            pairs.append((rate, jaccard(shingle_set(text), shingle_set(copy)),
                          index.add(exact_key(copy), hasher.signature(copy)) is not None))
    by_rate = [{"edit_rate": rate, "mean_jaccard": round(float(np.mean([j for r, j, _ in pairs if r == rate])), 3),
                "detected": _rate(d for r, _, d in pairs if r == rate)} for rate in rates]
    buckets = []
    for low in np.arange(0.5, 1.0, 0.05):
        inside = [(j, d) for _, j, d in pairs if low <= j < low + 0.05]
        if inside:
            mean = float(np.mean([j for j, _ in inside]))
            buckets.append({"jaccard": f"{low:.2f}-{low + 0.05:.2f}", "pairs": len(inside),
                            "detected": _rate(d for _, d in inside),
                            "theory_at_mean": round(1 - (1 - mean**ROWS) ** BANDS, 4)})
    return {"by_edit_rate": by_rate, "by_jaccard": buckets}


def index_memory(n: int = 30_000) -> dict:
    """Bytes and time per document of three LSH indexes holding n random 112-value signatures.

    Time from one run, memory (tracemalloc) from a second: tracing slows Python down.
    """
    rng = np.random.default_rng(0)
    signatures = rng.integers(0, 2**32 - 1, size=(n, BANDS * ROWS), dtype=np.uint32)
    keys = [exact_key(str(i)) for i in range(n)]

    def ours():
        index = DedupIndex(BANDS, ROWS)
        for key, sig in zip(keys, signatures):
            index.add(key, sig)
        return index

    permutations = datasketch.MinHash(num_perm=BANDS * ROWS).permutations
    sketches = [datasketch.MinHash(hashvalues=sig, permutations=permutations, scheme="affine32") for sig in signatures]

    def datasketch_lsh():
        lsh = datasketch.MinHashLSH(num_perm=BANDS * ROWS, params=(BANDS, ROWS))
        for i, sketch in enumerate(sketches):
            lsh.query(sketch)
            lsh.insert(i, sketch, check_duplication=False)
        return lsh

    out = {}
    for name, build, note in (
            ("scaletrain_DedupIndex", ours, "add (exact key, then bands) per document; tables 30-60% full, "
                                            "so bytes per document range over about 190-370"),
            ("datasketch_MinHashLSH", datasketch_lsh, "query + insert per document; excludes the MinHash "
                                                      "objects it needs")):
        start = time.perf_counter()
        built = build()
        seconds = time.perf_counter() - start
        del built
        tracemalloc.start()
        built = build()
        traced = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del built
        out[name] = {"bytes_per_doc": round(traced / n), "us_per_add": round(seconds / n * 1e6, 1), "note": note}

    # rensa keeps its index in Rust, out of tracemalloc's sight: resident memory before and after.
    tokens = rng.integers(0, 2**63, size=n * 50, dtype=np.uint64)
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(tokens, np.arange(0, n * 50 + 1, 50, dtype=np.uint64),
                                                                  BANDS * ROWS, 0)
    before = _resident_bytes()
    start = time.perf_counter()
    lsh = rensa.RMinHashLSH(threshold=0.8, num_perm=BANDS * ROWS, num_bands=BANDS)
    lsh.insert_matrix_and_query_duplicate_flags(matrix)
    seconds = time.perf_counter() - start
    out["rensa_RMinHashLSH"] = {"bytes_per_doc": round((_resident_bytes() - before) / n),
                                "us_per_add": round(seconds / n * 1e6, 2),
                                "note": "one batched call for all documents (no per-document verdict in order); "
                                        "memory from resident set size"}
    return {"documents": n, **out}


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--originals", type=int, default=4000)
    parser.add_argument("--near", type=int, default=1000)
    parser.add_argument("--exact", type=int, default=300)
    parser.add_argument("--edit-rate", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    start = time.perf_counter()
    texts = stdlib_texts()
    rng.shuffle(texts)
    originals = distinct(texts, threshold=0.3)[:args.originals]
    vocabulary = [w for t in rng.sample(originals, min(200, len(originals))) for w in WORD_SPAN.findall(t)]
    near = [(edit(t, args.edit_rate, vocabulary, rng), "near") for t in rng.sample(originals, args.near)]
    exact = [(recase(t, rng), "exact") for t in rng.sample(originals, args.exact)]
    copies = near + exact
    rng.shuffle(copies)
    stream = [(t, "original") for t in originals] + copies
    corpus_seconds = time.perf_counter() - start

    num_perm = BANDS * ROWS
    results = {name: run_stream(hasher, stream) for name, hasher in candidates(num_perm).items()}
    chosen = MinHasher(BANDS, ROWS, NGRAM)
    banding = {f"{b}x{r}": {k: v for k, v in run_stream(MinHasher(b, r, NGRAM), stream, b, r).items()
                            if k in ("recall", "fpr", "false_positives")}
               for b, r in ((14, 8), (16, 7), (20, 6), (20, 5), (9, 13))}

    print(json.dumps({
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                    "numpy": np.__version__, "rensa": version("rensa"), "datasketch": datasketch.__version__,
                    "xxhash": xxhash.VERSION},
        "corpus": {"stdlib_texts": len(texts), "originals": len(originals), "near_copies": len(near),
                   "exact_copies": len(exact), "edit_rate": args.edit_rate,
                   "mean_words": round(float(np.mean([len(WORD_SPAN.findall(t)) for t, _ in stream]))),
                   "mb": round(sum(len(t.encode()) for t, _ in stream) / 1e6, 2),
                   "build_seconds": round(corpus_seconds, 1)},
        "banding": f"{BANDS}x{ROWS}, word {NGRAM}-grams",
        "candidates": results,
        "chosen": "rensa_rminhash",
        "detection_vs_jaccard": detection_curve(chosen, originals, vocabulary, rng),
        "other_banding": banding,
        "index_per_document": index_memory(),
    }, indent=2))


if __name__ == "__main__":
    main()
