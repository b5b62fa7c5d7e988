"""Exact and near-duplicate removal (MinHash LSH) and decontamination (13-gram overlap).

The work splits in two, as `data prepare` runs it:

- per document, in worker processes, on text: `exact_key(text)` (16 bytes) and
  `MinHasher.signature(text)` (a small uint32 array); `Decontaminator.contaminated(text)`.
  Each is a pure function of the text and the seed, the same in every process and on
  every run: hashing is xxHash and constants come from splitmix64, never Python's `hash()`,
  which is salted per process.
- across documents, in the main process: `DedupIndex.add(exact, signature)` decides, in
  insertion order, whether a document repeats an earlier one. It keeps only integers in
  flat arrays (about 270 bytes per kept document), so millions of documents fit.

Near-duplicates follow FineWeb (Penedo et al. 2024): word 5-gram shingles, 112 MinHash
values in 14 bands of 8 rows; two documents are candidates when all 8 values of any band
agree, which happens with probability 1 - (1 - s^8)^14 at Jaccard similarity s (Broder 1997;
Leskovec, Rajaraman & Ullman, Mining of Massive Datasets, ch. 3.4): 0.1% at s = 0.3, 5% at
s = 0.5, 50% at s = 0.69, 92% at s = 0.8, 97.2% at s = 0.83 (what editing 2% of the words
leaves), 99.96% at s = 0.9. Like FineWeb, a band match is the verdict: candidates are not
checked against an estimated similarity.

The MinHash values come from rensa's R-MinHash (fast similarity sketching, Dahlgaard, Knudsen
& Thorup 2017) over our own 64-bit shingle hashes. benchmarks/dedup_recall.py measured it, on
planted copies of standard-library text, at the recall and false-positive rate of classic
MinHash (both match the banding formula above) and, per process, 1.3-1.6x as fast as the
same pipeline with numpy (a*x + b) permutations, 2-2.4x datasketch with an xxHash and 4-4.7x
datasketch as documented (SHA-1). Splitting and hashing the words now take most of the time.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable

import numpy as np
import rensa
import xxhash

from .shards import DataError

# -- words and shingles ---------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
# \w runs for MinHash shingles; alphanumeric runs (the underscore splits too) for decontamination.
_WORD = re.compile(r"\w+")
_ALNUM = re.compile(r"[^\W_]+")


def _ascii_table(keep: str) -> bytes:
    """bytes.translate table that maps every ASCII byte outside `keep` to a space."""
    return bytes(c if chr(c) in keep else 0x20 for c in range(256))


_ASCII_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"  # after lower()
_WORD_TABLE = _ascii_table(_ASCII_ALNUM + "_")
_ALNUM_TABLE = _ascii_table(_ASCII_ALNUM)


def _words(text: str, pattern: re.Pattern, table: bytes) -> list[bytes]:
    """The lowercased words of text as UTF-8 bytes.

    ASCII text takes bytes.translate + split, five times faster than the regex and with the
    same words (for ASCII, \\w is [a-z0-9_] once lowercased); other text takes the regex.
    """
    lowered = text.lower()
    if lowered.isascii():
        return lowered.encode().translate(table).split()
    return [word.encode() for word in pattern.findall(lowered)]


def _splitmix64(seed: int, count: int) -> list[int]:
    """count 64-bit constants from splitmix64 (Steele et al. 2014): fixed forever, unlike a
    library RNG whose stream may change between versions."""
    out, state = [], seed & _MASK64
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


# Position weights of a gram's words: gram i..i+k hashes to fmix64(sum_j word[i+j] * W[j]).
# Odd, so that each word's hash enters the sum bijectively.
_MAX_GRAM = 64
_GRAM_WEIGHTS = np.array(_splitmix64(0x5CA1E, _MAX_GRAM), dtype=np.uint64) | np.uint64(1)


def _word_hashes(words: list[bytes]) -> np.ndarray:
    """(len(words),) uint64 xxh3 of each word."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, words), dtype=np.uint64, count=len(words))


def _gram_hashes(word_hashes: np.ndarray, k: int) -> np.ndarray:
    """(len - k + 1,) uint64 hash of each run of k consecutive words (empty if fewer than k words).

    A weighted sum of the words' (random) 64-bit hashes, then MurmurHash3's fmix64 finalizer
    so that every output bit depends on every word; numpy wraps uint64 arithmetic mod 2^64.
    """
    count = len(word_hashes) - k + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    h = word_hashes[:count] * _GRAM_WEIGHTS[0]
    for j in range(1, k):
        h += word_hashes[j:j + count] * _GRAM_WEIGHTS[j]
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h


def _check_gram(name: str, n: int) -> None:
    if not isinstance(n, int) or not 1 <= n <= _MAX_GRAM:
        raise DataError(f"{name} must be a whole number of words from 1 to {_MAX_GRAM}, not {n!r}")


# -- exact duplicates -----------------------------------------------------------------------


def exact_key(text: str) -> bytes:
    """16-byte BLAKE2b of text lowercased, its whitespace runs collapsed to one space, stripped.

    Documents that differ only in case or spacing share a key. 16 bytes so that the key can
    name a document anywhere (rejects, manifests); `DedupIndex` compares the first 8.
    """
    normalised = " ".join(text.lower().split())
    return hashlib.blake2b(normalised.encode(), digest_size=16).digest()


# -- near duplicates ------------------------------------------------------------------------


_EMPTY = 0xFFFFFFFF  # every value of the signature of the empty set: each minimum is "infinity"


class MinHasher:
    """MinHash signatures of word n-gram shingles: `bands * rows` uint32 values per document.

    bands, rows: the LSH banding the signature is made for (FineWeb: 14 x 8 = 112 values).
    ngram: words per shingle (FineWeb: 5).
    seed: selects the hash functions; every process that compares signatures must use the same.
    """

    def __init__(self, bands: int = 14, rows: int = 8, ngram: int = 5, seed: int = 0):
        _check_banding(bands, rows)
        _check_gram("ngram", ngram)
        if not isinstance(seed, int):
            raise DataError(f"seed must be an integer, not {seed!r}")
        self.bands, self.rows, self.ngram, self.seed = bands, rows, ngram, seed
        self._rensa_seed = seed & _MASK64  # rensa takes an unsigned 64-bit seed
        self.num_perm = bands * rows
        self._empty = np.full(self.num_perm, _EMPTY, dtype=np.uint32)

    def signature(self, text: str) -> np.ndarray:
        """(bands * rows,) uint32 MinHash of the text's word n-grams.

        A text of fewer than `ngram` words is one shingle of all its words, so that short
        texts are compared rather than all colliding on the empty set. A text with no word
        at all gets the empty-set signature, which `DedupIndex` does not use for
        near-duplicates (exact duplicates are still found).
        """
        word_hashes = _word_hashes(_words(text, _WORD, _WORD_TABLE))
        if len(word_hashes) == 0:
            return self._empty.copy()
        shingles = _gram_hashes(word_hashes, min(self.ngram, len(word_hashes)))
        offsets = np.array([0, len(shingles)], dtype=np.uint64)
        digest = rensa.RMinHash.digest_matrix_from_flat_token_hashes(shingles, offsets, self.num_perm,
                                                                      self._rensa_seed)
        return np.array(digest.to_rows()[0], dtype=np.uint32)


def _check_banding(bands: int, rows: int) -> None:
    for name, value in (("bands", bands), ("rows", rows)):
        if not isinstance(value, int) or value < 1:
            raise DataError(f"MinHash {name} must be a positive integer, not {value!r} (FineWeb uses 14 bands x 8 rows)")


class DedupIndex:
    """Decides, in insertion order, whether a document repeats an earlier kept one.

    `add` returns None for a new document and remembers it; "exact_duplicate" when an earlier
    kept document has the same `exact_key`; "near_duplicate" when one shares a whole band of
    its MinHash signature. The first occurrence wins. Only kept documents are remembered, so
    replaying the kept documents of a finished chunk (resume) rebuilds the same index.

    Memory: 64 bits of the exact key and one 64-bit hash per band of each kept document, in
    open-addressing tables kept 30% to 60% full: 8 * (1 + bands) / 0.3 to 0.6 bytes, about
    270 bytes per document at 14 bands (`nbytes` tells the true figure). 64-bit keys make a
    false match among N documents a chance of N^2 / 2^65 per table: 3e-4 at N = 10^8.
    """

    def __init__(self, bands: int = 14, rows: int = 8):
        _check_banding(bands, rows)
        self.bands, self.rows = bands, rows
        self._exact = _U64Set()
        self._bands = _U64Set()
        self.documents = 0  # kept (remembered) documents

    def add(self, exact: bytes, signature: np.ndarray | None) -> str | None:
        """None if the document is new (and now remembered), else why it is dropped.

        exact: `exact_key(text)`. signature: `MinHasher.signature(text)`, or None to check
        exact duplicates only.
        """
        exact_keys = [int.from_bytes(exact[:8], "little") or 1]
        if self._exact.contains_any(exact_keys):
            return "exact_duplicate"
        band_keys = self._band_keys(signature)
        if self._bands.contains_any(band_keys):
            return "near_duplicate"
        self._exact.insert(exact_keys)
        self._bands.insert(band_keys)
        self.documents += 1
        return None

    @property
    def nbytes(self) -> int:
        """Bytes held by the index's tables."""
        return self._exact.nbytes + self._bands.nbytes

    def _band_keys(self, signature: np.ndarray | None) -> list[int]:
        """One nonzero 64-bit key per band: xxh3 of the band's values, seeded by the band's
        number so that equal values in different bands do not match. Empty for no signature."""
        if signature is None:
            return []
        values = np.ascontiguousarray(signature, dtype=np.uint32)
        if values.shape != (self.bands * self.rows,):
            raise ValueError(f"signature has shape {values.shape}; this index needs ({self.bands * self.rows},): "
                             f"a MinHasher with bands={self.bands}, rows={self.rows}")
        if values[0] == _EMPTY and (values == _EMPTY).all():
            return []  # the empty set (a text without words): nothing to compare
        data, width = values.tobytes(), 4 * self.rows
        return [xxhash.xxh3_64_intdigest(data[band * width:(band + 1) * width], seed=band) or 1
                for band in range(self.bands)]


class _U64Set:
    """A set of nonzero 64-bit integers in one flat uint64 array (0 marks an empty slot).

    Open addressing with linear probing, kept at most 60% full. Probing goes through a
    memoryview, which reads and writes plain Python ints (numpy scalars would be several
    times slower); growth rehashes with vectorised numpy.
    """

    MAX_LOAD = 0.6

    def __init__(self, slots: int = 1 << 12):
        self.size = 0
        self._allocate(slots)

    def _allocate(self, slots: int) -> None:
        self._table = np.zeros(slots, dtype=np.uint64)
        self._view = memoryview(self._table).cast("B").cast("Q")
        self._mask = slots - 1
        self._limit = int(slots * self.MAX_LOAD)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def contains_any(self, keys: list[int]) -> bool:
        view, mask = self._view, self._mask
        for key in keys:
            slot = key & mask
            while (stored := view[slot]) != 0:
                if stored == key:
                    return True
                slot = (slot + 1) & mask
        return False

    def insert(self, keys: list[int]) -> None:
        """Insert keys that are not in the set."""
        view, mask = self._view, self._mask
        for key in keys:
            slot = key & mask
            while view[slot] != 0:
                slot = (slot + 1) & mask
            view[slot] = key
        self.size += len(keys)
        if self.size > self._limit:
            self._grow()

    def _grow(self) -> None:
        """Double the table and reinsert every key, all keys at once per probe step.

        Each round, every key not yet placed claims its current slot; of the keys claiming a
        free slot, the first takes it and the rest step on. A key only steps past a slot that
        is occupied, so every key stays reachable from its home slot.
        """
        old = self._table[self._table != 0]
        self._allocate(2 * len(self._table))
        slots = (old & np.uint64(self._mask)).astype(np.int64)
        pending = np.arange(len(old))
        while len(pending):
            claimants = pending[self._table[slots[pending]] == 0]
            _, first = np.unique(slots[claimants], return_index=True)
            winners = claimants[first]
            self._table[slots[winners]] = old[winners]
            placed = np.zeros(len(old), dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            slots[pending] = (slots[pending] + 1) & self._mask

    def __getstate__(self):
        return {"size": self.size, "table": self._table}  # a memoryview does not pickle

    def __setstate__(self, state):
        self.size = state["size"]
        self._allocate(len(state["table"]))
        self._table[:] = state["table"]


# -- decontamination ------------------------------------------------------------------------


class Decontaminator:
    """Flags training documents that share a word n-gram (13 words) with any evaluation text.

    The test of GPT-3 (Brown et al. 2020, section 4 and appendix C): a benchmark example is
    contaminated by a training document sharing a 13-gram with it. Words here are the text
    lowercased and split on every non-alphanumeric character, so casing, punctuation and
    spacing do not hide an overlap.

    An evaluation text of fewer than n words contributes its whole word sequence as one gram,
    as GPT-3 did ("or that overlap with the whole example when it is shorter than 13-grams"):
    otherwise short examples (a one-line question, a short answer) could never be found at
    all. The price: a very short evaluation text ("yes") matches almost every document, so
    give whole examples (question with its answer), not bare labels.

    Memory: 8 bytes per distinct evaluation gram, in sorted arrays looked up with
    `np.isin`-style binary search.
    """

    def __init__(self, eval_texts: Iterable[str], n: int = 13, whole_short_texts: bool = True):
        """whole_short_texts=False ignores texts of fewer than n words: for whole documents (a
        validation split) rather than benchmark examples, where a one-line file would otherwise
        flag every document that contains its words."""
        _check_gram("n", n)
        self.n = n
        grams: dict[int, list[np.ndarray]] = {}  # gram length -> hashes
        for text in eval_texts:
            word_hashes = _word_hashes(_words(text, _ALNUM, _ALNUM_TABLE))
            if len(word_hashes) >= (1 if whole_short_texts else n):
                k = min(n, len(word_hashes))
                grams.setdefault(k, []).append(_gram_hashes(word_hashes, k))
        # Longest first: the n-grams, which every long evaluation text contributes.
        self._grams = {k: np.unique(np.concatenate(parts)) for k, parts in sorted(grams.items(), reverse=True)}

    def contaminated(self, text: str) -> bool:
        """True if text shares a run of n words (or a whole short evaluation text) with an evaluation text."""
        if not self._grams:
            return False
        word_hashes = _word_hashes(_words(text, _ALNUM, _ALNUM_TABLE))
        for k, table in self._grams.items():
            grams = _gram_hashes(word_hashes, k)
            if len(grams):
                at = np.searchsorted(table, grams)
                np.minimum(at, len(table) - 1, out=at)
                if (table[at] == grams).any():
                    return True
        return False
