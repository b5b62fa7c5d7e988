"""Train or load a byte-level BPE tokenizer (Hugging Face `tokenizers`).

Byte-level BPE (GPT-2, Radford et al. 2019) starts from the 256 byte values, so every
string encodes without an unknown token and decodes back to exactly the same string.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from .shards import DataError

EOS_TOKEN = "<|endoftext|>"  # id 0 in the tokenizers we train; appended after every document
# End-of-text tokens of tokenizers people commonly bring (GPT-2/NeoX, Llama 2, Llama 3, Gemma).
KNOWN_EOS_TOKENS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
MIN_VOCAB_SIZE = 256 + 1  # every byte, plus EOS_TOKEN
# Fill-in-the-middle sentinels (prefix, suffix, middle) as the tokenizers people bring name them:
# Qwen2.5-Coder's (which prepare's own tokenizers take), StarCoder's and SantaCoder's, and
# DeepSeek-Coder's (begin, hole, end: its prefix, suffix and middle markers).
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
# 16x the largest vocabulary of a released model we know of (Gemma 3's 262,144); the tokenizers
# library aborts the process (not an exception) on sizes beyond its 32-bit ids.
MAX_VOCAB_SIZE = 1 << 22


def train_tokenizer(texts: Iterable[str], vocab_size: int, fim: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` ids (fewer if the text has too few pairs to
    merge); `fim`: with fill-in-the-middle's three sentinels as special tokens (FIM_TOKENS' first)."""
    check_vocab_size(vocab_size, fim)
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: it would add a space to the start of every document and break the
    # exact round trip decode(encode(text)) == text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, *(FIM_TOKENS[0] if fim else ())],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # the library never prints; prepare reports progress
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.encode_special_tokens = True  # why: see load_tokenizer
    return tokenizer


def check_vocab_size(vocab_size: int, fim: bool = False) -> None:
    least = MIN_VOCAB_SIZE + (len(FIM_TOKENS[0]) if fim else 0)
    if vocab_size < least:
        raise DataError(f"vocab_size {vocab_size} is too small for byte-level BPE; it must be at least "
                        f"{least} (256 byte tokens plus {EOS_TOKEN}" + (" and the three fill-in-the-middle tokens)"
                                                                       if fim else ")"))
    if vocab_size > MAX_VOCAB_SIZE:
        raise DataError(f"vocab_size {vocab_size:,} is beyond what a tokenizer is trained to; give at most "
                        f"{MAX_VOCAB_SIZE:,} (released models use 32,000-262,144)")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved at path (a tokenizer.json, or a directory holding one), ready to encode documents."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        if path.name == "tokenizer.json" and (path.parent / "metrics.jsonl").is_file():  # a run's, copied from its data
            raise DataError(f"the run {str(path.parent)!r} has no tokenizer.json; copy its data directory's "
                            f"tokenizer.json into it")
        raise DataError(f"tokenizer {str(path)!r} does not exist; give the tokenizer.json of a prepared data "
                        "directory or of a Hugging Face tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every kind of bad file
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({e})") from None
    eos_id(tokenizer, path)
    # A document that happens to contain the text "<|endoftext|>" must not gain an end of
    # document in the middle: encode special tokens' text as ordinary text. This setting is
    # not saved in tokenizer.json, so every load sets it. Fill-in-the-middle's sentinels, which
    # some tokenizers (Qwen2.5's, CodeGemma's) add as ordinary added tokens, matched in any text,
    # are made special first, so that no document's text produces one.
    plain = {token.content for token in tokenizer.get_added_tokens_decoder().values() if not token.special}
    sentinels = [name for names in FIM_TOKENS for name in names if name in plain]
    if sentinels:
        tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in sentinels])
    tokenizer.encode_special_tokens = True
    return tokenizer


def eos_id(tokenizer: Tokenizer, path: str | Path = "the tokenizer") -> int:
    """The id appended after every document."""
    for token in KNOWN_EOS_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError(f"{path} has no end-of-text token; it needs one of {', '.join(KNOWN_EOS_TOKENS)}")


def fim_ids(tokenizer: Tokenizer) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's fill-in-the-middle sentinels (prefix, suffix, middle), by any
    of FIM_TOKENS' names; None where it has none."""
    for names in FIM_TOKENS:
        ids = tuple(tokenizer.token_to_id(name) for name in names)
        if all(i is not None for i in ids):
            return ids
    return None


def bos_id(tokenizer: Tokenizer) -> int | None:
    """The special token a tokenizer's post-processor puts before a text (a Llama tokenizer's
    <s> or <|begin_of_text|>, which its models saw at the start of every document), unless it is
    the end-of-text token; None for tokenizers without one (GPT-2's, those `data prepare` trains)."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    if len(full) <= len(plain) or full[1:1 + len(plain)] != plain:
        return None
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    if tokenizer.id_to_token(full[0]) not in special or full[0] == eos_id(tokenizer):
        return None
    return full[0]


def vocab_size(tokenizer: Tokenizer) -> int:
    """One more than the largest id, so that every id the tokenizer produces is below it."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


# SentencePiece's word boundary, which stands for a space, and its byte-fallback pieces (Llama 2,
# Mistral, Gemma): "<0x0A>" is the one byte 0x0A.
METASPACE = "\u2581"
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def token_bytes(tokenizer: Tokenizer, size: int) -> np.ndarray | None:
    """The bytes of text each of `size` ids stands for — 0 for special tokens (the end of a
    document is no text) and for ids past the tokenizer's; an added token that is not special
    stands for its text. Byte-level tokenizers (the tokenizers
    `data prepare` trains, GPT-2's, Llama 3's, Qwen's): one byte per character of a token.
    SentencePiece-style ones (Llama 2's, Mistral's, Gemma's: a vocabulary that marks spaces with
    U+2581, bytes it has no piece for as byte-fallback pieces "<0xNN>"): the UTF-8 length of the
    piece with its U+2581 read as spaces, one byte for a byte piece — counting the space such a
    tokenizer prepends to each text it encodes (one byte a document more than the text holds).
    None for others (a vocabulary that says neither)."""
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    if _byte_level(tokenizer) and all(alphabet.issuperset(token) for token in vocab):
        def length(token: str) -> int:
            return len(token)
    elif any(METASPACE in token for token in vocab):
        def length(token: str) -> int:
            return 1 if BYTE_PIECE.fullmatch(token) else len(token.replace(METASPACE, " ").encode("utf-8"))
    else:
        return None
    counts = np.zeros(size, dtype=np.int64)
    for token, token_id in vocab.items():
        if token_id < size:
            counts[token_id] = length(token)
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if token_id < size:  # (an added token that is not special is matched as its text, whole: e.g. Qwen's "<tool_call>")
            counts[token_id] = 0 if added.special else len(added.content.encode("utf-8"))
    return counts


def _byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer maps bytes to characters (a ByteLevel pre-tokenizer or decoder)."""
    saved = json.loads(tokenizer.to_str())

    def has(part) -> bool:
        if isinstance(part, dict):
            return part.get("type") == "ByteLevel" or any(has(value) for value in part.values())
        return isinstance(part, list) and any(has(value) for value in part)
    return has(saved.get("pre_tokenizer")) or has(saved.get("decoder"))

