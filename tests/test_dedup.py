"""Exact and near-duplicate removal and decontamination (data/dedup.py) on real text: the standard library's sources."""

from __future__ import annotations

import multiprocessing
import pickle
import random
import re
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data.dedup import Decontaminator, DedupIndex, MinHasher, exact_key

WORD = re.compile(r"\w+")


@lru_cache(maxsize=1)
def distinct_texts(count: int = 240, words: int = 300, max_jaccard: float = 0.2) -> tuple[str, ...]:
    """count windows of `words` consecutive words (with their original spacing and punctuation)
    from the largest standard-library modules, each with word 5-gram Jaccard similarity below
    max_jaccard to every other: real documents that are truly distinct."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: (-p.stat().st_size, p.name))
    kept, shingle_sets = [], []
    for path in files:
        text = path.read_text(encoding="utf-8")
        spans = [m.span() for m in WORD.finditer(text)]
        for start in range(0, len(spans) - words + 1, words):
            window = text[spans[start][0]:spans[start + words - 1][1]]
            shingles = five_grams(window)
            if all(len(shingles & other) / len(shingles | other) < max_jaccard for other in shingle_sets):
                kept.append(window)
                shingle_sets.append(shingles)
                if len(kept) == count:
                    return tuple(kept)
    raise AssertionError(f"the standard library gave only {len(kept)} distinct {words}-word texts")


def five_grams(text: str) -> set[tuple[str, ...]]:
    words = WORD.findall(text.lower())
    return {tuple(words[i:i + 5]) for i in range(len(words) - 4)}


def edit_words(text: str, rate: float, rng: random.Random) -> str:
    """text with rate of its words substituted, deleted or followed by an inserted word, at random positions."""
    spans = [m.span() for m in WORD.finditer(text)]
    for i in sorted(rng.sample(range(len(spans)), max(1, round(rate * len(spans)))), reverse=True):
        start, end = spans[i]
        new = rng.choice(("zebra", "quantum", "marmalade", "fjord", "lantern"))
        text = text[:start] + rng.choice((new, text[start:end] + " " + new, "")) + text[end:]
    return text


def test_exact_duplicates_differing_only_in_case_and_whitespace_are_caught():
    text = distinct_texts()[0]
    variant = "\n  " + "\t".join(word.upper() if i % 3 == 0 else word for i, word in enumerate(text.split())) + "  \n"
    assert exact_key(variant) == exact_key(text)
    assert exact_key(text + " more") != exact_key(text)
    hasher, index = MinHasher(), DedupIndex()
    assert index.add(exact_key(text), hasher.signature(text)) is None
    assert index.add(exact_key(variant), hasher.signature(variant)) == "exact_duplicate"
    assert index.add(exact_key(variant), None) == "exact_duplicate"


def test_near_duplicates_with_two_percent_of_words_edited_are_caught():
    # At 2% of words edited, 5-gram Jaccard similarity is about 0.83, where 14 bands of 8
    # rows catch a copy with probability 1 - (1 - 0.83^8)^14 = 0.97; 36 of 40 allows for it.
    rng = random.Random(0)
    hasher, index = MinHasher(), DedupIndex()
    originals = distinct_texts()[:40]
    for text in originals:
        assert index.add(exact_key(text), hasher.signature(text)) is None
    copies = [edit_words(text, 0.02, rng) for text in originals]
    assert all(0.7 < len(five_grams(c) & five_grams(t)) / len(five_grams(c) | five_grams(t)) < 0.95
               for c, t in zip(copies, originals))
    verdicts = [index.add(exact_key(copy), hasher.signature(copy)) for copy in copies]
    assert set(verdicts) <= {"near_duplicate", None}
    assert verdicts.count("near_duplicate") >= 36


def test_distinct_documents_are_not_flagged():
    hasher, index = MinHasher(), DedupIndex()
    verdicts = [index.add(exact_key(text), hasher.signature(text)) for text in distinct_texts()]
    assert verdicts == [None] * len(distinct_texts())
    assert index.documents == len(distinct_texts())


def test_first_occurrence_wins():
    text = distinct_texts()[1]
    copy = edit_words(text, 0.01, random.Random(1))
    hasher = MinHasher()
    for first, second in ((text, copy), (copy, text)):
        index = DedupIndex()
        assert index.add(exact_key(first), hasher.signature(first)) is None
        assert index.add(exact_key(second), hasher.signature(second)) == "near_duplicate"
        assert index.add(exact_key(first), hasher.signature(first)) == "exact_duplicate"


def test_dropped_documents_are_not_remembered():
    """Only kept documents enter the index, so replaying the kept ones (resume) rebuilds it exactly."""
    text = distinct_texts()[2]
    copy = edit_words(text, 0.01, random.Random(2))
    hasher, index = MinHasher(), DedupIndex()
    assert index.add(exact_key(text), hasher.signature(text)) is None
    assert index.add(exact_key(copy), hasher.signature(copy)) == "near_duplicate"
    # The copy's exact key was not kept: seen again, it is still a near-duplicate of the original.
    assert index.add(exact_key(copy), hasher.signature(copy)) == "near_duplicate"
    assert index.documents == 1


def test_signatures_are_the_same_across_instances_and_processes():
    text = distinct_texts()[4]
    signature = MinHasher(seed=7).signature(text)
    assert signature.dtype == np.uint32 and signature.shape == (14 * 8,)
    assert np.array_equal(MinHasher(seed=7).signature(text), signature)
    assert not np.array_equal(MinHasher(seed=8).signature(text), signature)
    # A fresh interpreter (spawn) has its own salt for Python's hash(); the signature must not change.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert np.array_equal(pool.submit(MinHasher(seed=7).signature, text).result(), signature)
        assert pool.submit(exact_key, text).result() == exact_key(text)


def test_texts_without_words_are_only_exact_duplicates():
    hasher, index = MinHasher(), DedupIndex()
    assert index.add(exact_key("!!!"), hasher.signature("!!!")) is None
    assert index.add(exact_key("???"), hasher.signature("???")) is None
    assert index.add(exact_key(" !!! "), hasher.signature(" !!! ")) == "exact_duplicate"


def test_short_texts_are_compared_as_one_shingle():
    hasher, index = MinHasher(), DedupIndex()
    assert index.add(exact_key("Hello world"), hasher.signature("Hello world")) is None
    assert index.add(exact_key("hello, world!"), hasher.signature("hello, world!")) == "near_duplicate"
    assert index.add(exact_key("hello there"), hasher.signature("hello there")) is None


def test_index_survives_growth_and_pickling():
    rng = np.random.default_rng(0)
    signatures = rng.integers(0, 2**32 - 1, size=(20_000, 14 * 8), dtype=np.uint32)
    index = DedupIndex()
    assert all(index.add(exact_key(str(i)), sig) is None for i, sig in enumerate(signatures))
    index = pickle.loads(pickle.dumps(index))
    assert all(index.add(exact_key(str(i)), None) == "exact_duplicate" for i in range(len(signatures)))
    assert all(index.add(exact_key(f"new {i}"), sig) == "near_duplicate" for i, sig in enumerate(signatures))
    assert index.nbytes < 600 * len(signatures)


def test_signature_of_another_banding_is_refused():
    with pytest.raises(ValueError, match="bands=14, rows=8"):
        DedupIndex(14, 8).add(exact_key("x"), MinHasher(bands=20, rows=5).signature("some words here"))
    with pytest.raises(ValueError, match="bands"):
        MinHasher(bands=0)


def test_decontamination_catches_a_13_word_overlap_despite_case_and_punctuation():
    eval_text, other = distinct_texts()[5], distinct_texts()[6]
    words = WORD.findall(eval_text.replace("_", " "))
    decontaminator = Decontaminator([eval_text])
    passage = words[40:53]  # 13 words
    shouted = other[:400] + " " + ", ".join(w.upper() for w in passage) + "! " + other[400:800]
    assert decontaminator.contaminated(shouted)
    twelve = other[:400] + " " + ", ".join(w.upper() for w in passage[:12]) + " zebra " + other[400:800]
    assert not decontaminator.contaminated(twelve)
    assert not decontaminator.contaminated(other)


def test_decontamination_treats_a_short_eval_text_as_one_gram():
    decontaminator = Decontaminator(["What is the capital of France? Paris."])
    assert decontaminator.contaminated("Quiz: what is the CAPITAL of france -- paris, of course.")
    assert not decontaminator.contaminated("The capital of France is Paris.")
    assert not Decontaminator([]).contaminated("anything at all")
