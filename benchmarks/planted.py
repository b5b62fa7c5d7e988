"""What the deduplication benchmarks plant: near-copies of real documents with a share of words edited."""

from __future__ import annotations

import random
import re

WORD = re.compile(r"\w+")


def edit(text: str, rate: float, vocabulary: list[str], rng: random.Random) -> str:
    """text with round(rate * words) of its words (at least one) substituted, deleted or followed by an insertion."""
    spans = [m.span() for m in WORD.finditer(text)]
    positions = sorted(rng.sample(range(len(spans)), max(1, round(rate * len(spans)))), reverse=True)
    for i in positions:  # from the end, so earlier spans stay valid
        start, end = spans[i]
        op = rng.choice(("substitute", "insert", "delete"))
        word = rng.choice(vocabulary)
        replacement = {"substitute": word, "insert": text[start:end] + " " + word, "delete": ""}[op]
        text = text[:start] + replacement + text[end:]
    return text
