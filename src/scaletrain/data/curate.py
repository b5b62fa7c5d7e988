"""Document curation: Unicode and whitespace normalisation, then published quality filters.

`curate(text, kind, cfg)` returns `(kept_text, None)` or `(None, reason)` for one document.
It reads no files and keeps no state, so prepare's worker processes call it freely. Stages,
in order, each a section of `FilterConfig` with its own switch:

    normalize          ftfy mojibake repair, newlines, trailing whitespace;         code, prose
                       NFC and fewer blank lines for prose
    gopher_quality     Rae et al. 2021 (Gopher), appendix A.1.1                     prose
    gopher_repetition  Rae et al. 2021, appendix A.1.1 and Table A1                 prose
    c4                 Raffel et al. 2020 (T5), section 2.2: line rules             prose
    code               line lengths and alphanumeric share (Codex, The Stack,       code
                       StarCoder) and generated-file headers (CodeParrot)

Prose rules never see code: they were tuned on web text, and source files fail them by
design (C4 drops any page with a "{"; most code lines end without punctuation; a test
module repeats its lines). `document_kind` tells the two apart by file extension.

Speed matters (hundreds of MB through two cores), so each rule is a str or bytes method, a
regex over the whole text or a numpy pass over word hashes; Python loops run at most once
per line (C4's line rules, ftfy on the few lines it could change), never per character.
"""

from __future__ import annotations

import re
import tomllib
import unicodedata
from collections import Counter
from itertools import filterfalse
from pathlib import Path
from typing import Annotated, Literal

import ftfy
import ftfy.chardata
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from .shards import DataError

# ---------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------

Off = Literal[False]  # TOML has no null, so `false` is how a file turns a single rule off
# Strict numbers tried before `false`, so that 0 stays the number 0 and `true` is refused.
Fraction = Annotated[Annotated[float, Field(ge=0, le=1), Strict()] | Off, Field(union_mode="left_to_right")]
Number = Annotated[Annotated[float, Field(ge=0), Strict()] | Off, Field(union_mode="left_to_right")]
Count = Annotated[Annotated[int, Field(ge=0), Strict()] | Off, Field(union_mode="left_to_right")]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = True
    """Run this stage at all; false skips every rule in it."""


class NormalizeConfig(_Section):
    """Unicode and whitespace normalisation, applied to code and prose before any filter."""

    fix_unicode: bool = True
    """Repair mojibake ("schÃ¶n" -> "schön") with ftfy, and drop a leading byte-order mark.
    Only fixes that keep a program's meaning run on code (see `_FTFY_CODE`)."""
    nfc: bool = True
    """Prose only: Unicode NFC, so that a letter and its combining accent become one code point,
    as most text is written. Code is left as written: NFC rewrites string literals (the
    standard library's test_ntpath compares the Ohm sign U+2126 with Ω U+03A9, which NFC
    merges), and Python normalises identifiers itself."""
    whitespace: bool = True
    """\\r\\n and \\r become \\n, trailing whitespace goes from every line, and blank lines at the
    start and end of the document go. Indentation is never touched."""
    max_blank_lines: Count = 2
    """Prose only, with whitespace on: longer runs of blank lines shrink to this many. Code
    keeps its blank lines."""


class GopherQualityConfig(_Section):
    """Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from Training
    Gopher", appendix A.1.1 ("Quality filters"); the thresholds are the paper's. Words are
    whitespace-separated tokens."""

    min_words: Count = 50
    """Fewer words than this drops the document (Gopher: 50)."""
    max_words: Count = 100_000
    """More words than this drops the document (Gopher: 100,000)."""
    min_mean_word_length: Number = 3.0
    """Mean word length in characters below this drops the document (Gopher: 3)."""
    max_mean_word_length: Number = 10.0
    """Mean word length in characters above this drops the document (Gopher: 10)."""
    max_hash_word_ratio: Number = 0.1
    """"#" symbols per word above this drops the document (Gopher: 0.1)."""
    max_ellipsis_word_ratio: Number = 0.1
    """Ellipses ("..." or "…") per word above this drops the document (Gopher: 0.1)."""
    max_bullet_lines_frac: Fraction = 0.9
    """Share of non-blank lines starting with a bullet (• ‣ ◦ ⁃ ▪ ● - *) above this drops
    the document (Gopher: 90%)."""
    max_ellipsis_lines_frac: Fraction = 0.3
    """Share of non-blank lines ending with an ellipsis above this drops the document (Gopher: 30%)."""
    min_alpha_words_frac: Fraction = 0.8
    """Share of words with at least one alphabetic character below this drops the document (Gopher: 80%)."""
    min_stop_words: Count = 2
    """Fewer occurrences than this of the English stop words the, be, to, of, and, that,
    have, with (any case) drops the document (Gopher: 2)."""


class GopherRepetitionConfig(_Section):
    """Rae et al. 2021, appendix A.1.1 ("Repetition removal") and Table A1; thresholds are
    Table A1's. Lines are the non-blank lines; paragraphs are separated by blank lines. A
    duplicate line or paragraph is a copy of an earlier one (the first copy is not counted),
    and line and paragraph character shares are of the whole text. N-gram shares are of the
    characters of all words (spaces not counted)."""

    max_dup_line_frac: Fraction = 0.30
    """Share of lines that are copies of an earlier line (Table A1: 0.30)."""
    max_dup_line_char_frac: Fraction = 0.20
    """Share of characters in lines that are copies of an earlier line (Table A1: 0.20)."""
    max_dup_para_frac: Fraction = 0.30
    """Share of paragraphs that are copies of an earlier paragraph (Table A1: 0.30)."""
    max_dup_para_char_frac: Fraction = 0.20
    """Share of characters in paragraphs that are copies of an earlier one (Table A1: 0.20)."""
    max_top_2gram_char_frac: Fraction = 0.20
    """Characters of the most frequent word 2-gram times its count, as a share (Table A1: 0.20).
    Only an n-gram that occurs more than once can be the most frequent; ties go to the longest."""
    max_top_3gram_char_frac: Fraction = 0.18
    """As max_top_2gram_char_frac, for 3-grams (Table A1: 0.18)."""
    max_top_4gram_char_frac: Fraction = 0.16
    """As max_top_2gram_char_frac, for 4-grams (Table A1: 0.16)."""
    max_dup_5gram_char_frac: Fraction = 0.15
    """Share of characters inside any occurrence of a word 5-gram that occurs more than once,
    each character counted once however many such n-grams overlap it (Table A1: 0.15)."""
    max_dup_6gram_char_frac: Fraction = 0.14
    """As max_dup_5gram_char_frac, for 6-grams (Table A1: 0.14)."""
    max_dup_7gram_char_frac: Fraction = 0.13
    """As max_dup_5gram_char_frac, for 7-grams (Table A1: 0.13)."""
    max_dup_8gram_char_frac: Fraction = 0.12
    """As max_dup_5gram_char_frac, for 8-grams (Table A1: 0.12)."""
    max_dup_9gram_char_frac: Fraction = 0.11
    """As max_dup_5gram_char_frac, for 9-grams (Table A1: 0.11)."""
    max_dup_10gram_char_frac: Fraction = 0.10
    """As max_dup_5gram_char_frac, for 10-grams (Table A1: 0.10)."""


class C4Config(_Section):
    """Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
    Text-to-Text Transformer" (T5), section 2.2, as its reference implementation applies them
    (tensorflow_datasets c4_utils.clean_page): each line is stripped and checked in order;
    the kept lines, joined by newlines, are the document. Document-level rules ("lorem
    ipsum", "{") look only at lines that passed the line rules before them, as there."""

    remove_citations: bool = True
    """Delete Wikipedia-style markers "[1]", "[edit]", "[citation needed]" from lines, and strip the line again (the reference does not, so a line that ended in a marker, "... in it. [1]", ends in a space there and fails the terminal punctuation rule; here it passes)."""
    terminal_punctuation: bool = True
    """Drop lines not ending in C4's . ! ? " (or the typographic ”), and lines ending in an
    ellipsis ("..." or "…")."""
    min_words_per_line: Count = 5
    """Drop lines with fewer words (C4: "only retained lines that contained at least 5 words")."""
    max_word_length: Count = 1000
    """Drop lines holding a word longer than this many characters (tensorflow_datasets
    c4_utils, not in the paper)."""
    lorem_ipsum: bool = True
    """Drop the document if a line says "lorem ipsum" (placeholder text)."""
    javascript: bool = True
    """Drop lines containing "javascript" ("please enable JavaScript" notices)."""
    curly_bracket: bool = True
    """Drop the document if a line holds "{" (C4's sign of code in a web page)."""
    policy: bool = True
    """Drop lines with "terms of use", "privacy policy", "cookie policy", "uses cookies",
    "use of cookies" or "use cookies"."""
    min_sentences: Count = 3
    """Drop the document if its kept lines hold fewer sentences (C4: 3). Sentences are counted
    as terminal punctuation followed by the end of the line or by a word not in lower case;
    C4 used NLTK's punkt, which also knows abbreviations."""


class CodeConfig(_Section):
    """Source-file rules of code corpora: Codex's line-length rules (Chen et al. 2021, section
    3.1) with the thresholds and alphanumeric floor the BigCode project applied to The Stack
    (Kocetkov et al. 2022) for SantaCoder and StarCoder (Li et al. 2023; bigcode-dataset
    preprocessing `basic_filters`: 1000, 100, 0.25), and CodeParrot's generated-file check
    (Tunstall et al. 2022) with more markers. No repetition rule: code repeats lines by
    nature (11% of the standard library's modules repeat over 30% of their lines), and
    copies of whole files are what deduplication removes."""

    max_line_length: Count = 1000
    """Drop files with a line longer than this many characters (The Stack: 1000)."""
    max_mean_line_length: Number = 100.0
    """Drop files whose mean line length exceeds this (The Stack: 100)."""
    min_alphanumeric_frac: Fraction = 0.25
    """Drop files in which fewer than this share of all characters are letters or digits (The Stack: 0.25)."""
    autogenerated: bool = True
    """Drop files whose first 5 lines say they were generated (CodeParrot: "auto-generated",
    "autogenerated", "automatically generated"; added here: "generated automatically", "do not
    edit", "this file is/was generated", "generated from", and a line opening with "generated by")."""


class FilterConfig(BaseModel):
    """Every curation stage and rule, on by default with its published threshold.

    `load_filters` builds one from "default", "none" or a TOML file whose sections
    ([normalize], [gopher_quality], [gopher_repetition], [c4], [code]) override the defaults
    key by key; a threshold set to `false` turns that one rule off.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    normalize: NormalizeConfig = NormalizeConfig()
    """Unicode and whitespace normalisation (code and prose)."""
    gopher_quality: GopherQualityConfig = GopherQualityConfig()
    """Gopher quality rules (prose)."""
    gopher_repetition: GopherRepetitionConfig = GopherRepetitionConfig()
    """Gopher repetition rules (prose)."""
    c4: C4Config = C4Config()
    """C4 line rules (prose)."""
    code: CodeConfig = CodeConfig()
    """Source-file rules (code)."""


SECTIONS = tuple(FilterConfig.model_fields)


def load_filters(spec: str | Path) -> FilterConfig:
    """The filters named by spec: "default", "none" (every stage off, normalisation too) or a TOML file."""
    if str(spec) == "default":
        return FilterConfig()
    if str(spec) == "none":
        return FilterConfig(**{section: {"enabled": False} for section in SECTIONS})
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"filters {str(spec)!r} is neither 'default', 'none' nor an existing TOML file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"filters file {path} is not valid TOML ({e})") from None
    try:
        return FilterConfig.model_validate(data)
    except ValidationError as e:
        raise DataError(_explain(e, path)) from None


def _explain(error: ValidationError, path: Path) -> str:
    """One sentence for the first mistake in a filters file: the key, and what would be right."""
    first = error.errors()[0]
    loc = [part for part in first["loc"] if isinstance(part, str)]
    section = loc[0]
    if first["type"] == "extra_forbidden" and len(loc) == 1:
        return f"unknown section [{section}] in filters file {path}; the sections are: {', '.join(SECTIONS)}"
    if section not in SECTIONS or len(loc) == 1:
        return f"[{section}] in filters file {path} must be a table of settings, not {first['input']!r}"
    key = loc[1]
    fields = FilterConfig.model_fields[section].annotation.model_fields
    if first["type"] == "extra_forbidden":
        return (f"unknown key {section}.{key} in filters file {path}; "
                f"the keys of [{section}] are: {', '.join(fields)}")
    default = fields[key].default
    if isinstance(default, bool):
        expected = "true or false"
    elif key.endswith("_frac"):  # every share is named *_frac
        expected = "a number from 0 to 1, or false to turn the rule off"
    else:
        kind = "a whole number" if isinstance(default, int) else "a number"
        expected = f"{kind} of at least 0, or false to turn the rule off"
    return f"{section}.{key} = {first['input']!r} in filters file {path} is not valid; give {expected}"


# ---------------------------------------------------------------------------------------
# Document kinds
# ---------------------------------------------------------------------------------------

# Extensions of source, build and data-format files. Markup that is mostly code (HTML,
# XML, TeX) is code too: C4's "{" rule and punctuation rule would drop nearly all of it.
CODE_EXTENSIONS = frozenset("""
    py pyi pyx pxd ipynb c h cc cpp cxx hpp hh hxx cu cuh m mm rs go java kt kts scala groovy
    gradle swift cs fs fsx vb js mjs cjs jsx ts tsx vue svelte rb php pl pm lua r jl hs ml mli
    ex exs erl hrl clj cljs dart zig nim d f f90 f95 for asm s v sv vhd sh bash zsh fish ps1
    bat cmd sql cmake mk make mak toml yaml yml json jsonc xml xsd xsl svg ini cfg conf
    properties proto thrift graphql gql css scss sass less html htm xhtml tex sty cls bib el
    vim lisp scm rkt tf hcl nix dockerfile
""".split())
CODE_FILENAMES = frozenset({"makefile", "gnumakefile", "dockerfile", "cmakelists.txt", "rakefile", "gemfile",
                            "vagrantfile", "jenkinsfile", "build", "workspace", "meson.build"})


def document_kind(name: str) -> Literal["code", "prose"]:
    """"code" for a source file, by its extension or name; "prose" for anything else.

    name is the source file's name (a .jsonl or .parquet file's documents are prose: their
    records are whatever text the file collects, and the file's own extension says nothing).
    """
    base = name.replace("\\", "/").rsplit("/", 1)[-1].lower()
    if base in CODE_FILENAMES:
        return "code"
    _, dot, extension = base.rpartition(".")
    return "code" if dot and extension in CODE_EXTENSIONS else "prose"


# ---------------------------------------------------------------------------------------
# Reasons
# ---------------------------------------------------------------------------------------

_GOPHER_QUALITY = ("too_few_words", "too_many_words", "short_mean_word", "long_mean_word", "hash_ratio",
                   "ellipsis_ratio", "bullet_lines", "ellipsis_lines", "alpha_words", "stop_words")
_GOPHER_REPETITION = ("dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac",
                      *(f"top_{n}gram" for n in (2, 3, 4)), *(f"dup_{n}gram" for n in range(5, 11)))
_C4 = ("lorem_ipsum", "curly_bracket", "too_few_sentences")
_CODE = ("max_line_length", "mean_line_length", "alphanumeric", "autogenerated")

# Every reason curate can return, "stage:rule", in the order the rules run; stats.json
# counts each, zeros too, so its shape does not depend on the data.
REASONS: tuple[str, ...] = ("empty_after_normalize",
                            *(f"gopher_quality:{r}" for r in _GOPHER_QUALITY),
                            *(f"gopher_repetition:{r}" for r in _GOPHER_REPETITION),
                            *(f"c4:{r}" for r in _C4),
                            *(f"code:{r}" for r in _CODE))


def curate(text: str, kind: str, cfg: FilterConfig) -> tuple[str | None, str | None]:
    """Normalise and filter one document: (kept text, None), or (None, the reason it was dropped).

    kind is "code" or "prose" (see `document_kind`). The kept text is the normalised text;
    for prose with C4 on, only the lines C4 keeps.
    """
    if kind not in ("code", "prose"):
        raise ValueError(f"kind must be 'code' or 'prose', not {kind!r}")
    if cfg.normalize.enabled:
        text = normalize(text, kind, cfg.normalize)
    if not text or text.isspace():
        return None, "empty_after_normalize"
    if kind == "code":
        reason = _code_reason(text, cfg.code) if cfg.code.enabled else None
        return (None, reason) if reason else (text, None)
    words = text.split()
    if cfg.gopher_quality.enabled and (reason := _gopher_quality_reason(text, words, cfg.gopher_quality)):
        return None, reason
    if cfg.gopher_repetition.enabled and (reason := _gopher_repetition_reason(text, words, cfg.gopher_repetition)):
        return None, reason
    if cfg.c4.enabled:
        return _c4_lines(text, cfg.c4)
    return text, None


# ---------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------

# ftfy's mojibake repair, and nothing that changes what a program does: no HTML unescaping
# ("&amp;" in a string literal or in a page about HTML is content), no uncurling (’ inside
# '...' would end the literal), no ligature or width folding (they change literals), no
# line-break folding (U+2028 in a literal would become a real newline; \r\n is handled
# below), no deletion of escape or control characters (a string literal may hold them),
# and NFC separately, under its own switch.
_FTFY_CODE = ftfy.TextFixerConfig(
    unescape_html=False, fix_encoding=True, fix_c1_controls=True, fix_surrogates=True,
    fix_latin_ligatures=False, fix_character_width=False, uncurl_quotes=False, fix_line_breaks=False,
    remove_terminal_escapes=False, remove_control_chars=False, normalization=None, explain=False)
# Prose also loses terminal escapes and invisible control characters, gets U+2028/U+2029/
# U+0085 as newlines and "ﬁ" as "fi" (PDF extraction). Curly quotes and full-width forms
# stay: they are typography (and the norm in CJK text), not damage.
_FTFY_PROSE = _FTFY_CODE._replace(remove_terminal_escapes=True, remove_control_chars=True,
                                  fix_line_breaks=True, fix_latin_ligatures=True)
# ftfy works line by line, and most lines it leaves as they are; finding those is cheaper
# than asking ftfy (its mojibake detector alone runs at a few MB/s). ftfy repairs an
# encoding only where ftfy.badness.is_bad fires, and every pattern of is_bad needs two
# non-ASCII characters in a row, a C1 control or one of Ã Â Œ œ; its other fixers act
# only on ligatures, line and paragraph separators, surrogates and control characters.
# A line with none of these goes past ftfy untouched (a test checks this against ftfy).
_FTFY_MIGHT_CHANGE = re.compile(
    r"[^\x00-\x7f]{2}|[\x00-\x08\x0b\x0d-\x1f\x7f-\x9fÃÂŒœ\u2028\u2029\ud800-\udfff%s]"
    % "".join(re.escape(chr(c)) for c in sorted({*ftfy.chardata.LIGATURES, *ftfy.chardata.CONTROL_CHARS}) if c >= 0x80))
_NOT_CONTROL = b"\t\n\x0c" + bytes(range(0x20, 0x7f)) + bytes(range(0x80, 0x100))  # as UTF-8 bytes


def normalize(text: str, kind: str, cfg: NormalizeConfig) -> str:
    """The normalised text (the first stage of `curate`, exposed for deduplication keys and tests)."""
    if cfg.whitespace and "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cfg.fix_unicode:
        text = _fix_unicode(text.removeprefix("\ufeff"), kind)  # a byte-order mark is encoding metadata
    if cfg.nfc and kind == "prose" and not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if cfg.whitespace:
        text = "\n".join(map(str.rstrip, text.split("\n"))).strip("\n")
        if kind == "prose" and cfg.max_blank_lines is not False and "\n" * (cfg.max_blank_lines + 2) in text:
            text = re.sub("\n{%d,}" % (cfg.max_blank_lines + 2), "\n" * (cfg.max_blank_lines + 1), text)
    return text


def _fix_unicode(text: str, kind: str) -> str:
    """ftfy.fix_text(text, the settings for kind), with ftfy run only on lines it could change."""
    # Prose settings delete ASCII control characters too, so ASCII lines need a look when there are any.
    controls = kind == "prose" and bool(text.encode("utf-8", errors="surrogatepass").translate(None, _NOT_CONTROL))
    if text.isascii() and not controls:  # isascii is O(1): CPython records whether a string is ASCII
        return text
    config = _FTFY_CODE if kind == "code" else _FTFY_PROSE
    lines = text.split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if (controls or not line.isascii()) and _FTFY_MIGHT_CHANGE.search(line):
            # With its newline, as fix_text cuts text, so that a "\r\n" ending reaches ftfy whole.
            fixed = ftfy.fix_text(line + "\n" if i < last else line, config)
            lines[i] = fixed.removesuffix("\n") if i < last else fixed
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Gopher quality
# ---------------------------------------------------------------------------------------

_BULLETS = "•‣◦⁃▪●*-"
_BULLET_LINE = re.compile(r"\n[^\S\n]*[%s]" % _BULLETS)  # a literal first character keeps the scan fast
_BULLET_FIRST_LINE = re.compile(r"[^\S\n]*[%s]" % _BULLETS)
_ELLIPSIS_LINE = re.compile(r"(?:\.\.\.|…)[^\S\n]*$", re.MULTILINE)
_LETTER = re.compile(r"[^\W\d_]")  # \w less digits and underscore: str.isalpha
_STOP_WORD = re.compile(r"\b(?:the|be|to|of|and|that|have|with)\b", re.IGNORECASE)


def _gopher_quality_reason(text: str, words: list[str], cfg: GopherQualityConfig) -> str | None:
    n_words = len(words)
    if cfg.min_words is not False and n_words < cfg.min_words:
        return "gopher_quality:too_few_words"
    if cfg.max_words is not False and n_words > cfg.max_words:
        return "gopher_quality:too_many_words"
    mean_length = sum(map(len, words)) / n_words
    if cfg.min_mean_word_length is not False and mean_length < cfg.min_mean_word_length:
        return "gopher_quality:short_mean_word"
    if cfg.max_mean_word_length is not False and mean_length > cfg.max_mean_word_length:
        return "gopher_quality:long_mean_word"
    if cfg.max_hash_word_ratio is not False and text.count("#") / n_words > cfg.max_hash_word_ratio:
        return "gopher_quality:hash_ratio"
    ellipses = text.count("...") + text.count("…")
    if cfg.max_ellipsis_word_ratio is not False and ellipses / n_words > cfg.max_ellipsis_word_ratio:
        return "gopher_quality:ellipsis_ratio"
    lines = text.split("\n")
    n_lines = len(lines) - lines.count("") - sum(map(str.isspace, lines))  # non-blank lines
    if cfg.max_bullet_lines_frac is not False:
        bullets = len(_BULLET_LINE.findall(text)) + bool(_BULLET_FIRST_LINE.match(text))
        if bullets / n_lines > cfg.max_bullet_lines_frac:
            return "gopher_quality:bullet_lines"
    if cfg.max_ellipsis_lines_frac is not False and ellipses \
            and len(_ELLIPSIS_LINE.findall(text)) / n_lines > cfg.max_ellipsis_lines_frac:
        return "gopher_quality:ellipsis_lines"
    if cfg.min_alpha_words_frac is not False:
        # Most words are all letters (str.isalpha, in C); only the others need a search.
        others = list(filterfalse(str.isalpha, words))
        with_letter = n_words - len(others) + sum(map(bool, map(_LETTER.search, others)))
        if with_letter / n_words < cfg.min_alpha_words_frac:
            return "gopher_quality:alpha_words"
    if cfg.min_stop_words is not False and cfg.min_stop_words > 0:
        found = 0
        for _ in _STOP_WORD.finditer(text):
            found += 1
            if found >= cfg.min_stop_words:
                break
        else:
            return "gopher_quality:stop_words"
    return None


# ---------------------------------------------------------------------------------------
# Gopher repetition
# ---------------------------------------------------------------------------------------

_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")
# An odd 64-bit multiplier for the polynomial hash of an n-gram's word hashes (any large odd
# constant does; this one is 2^64 / golden ratio).
_NGRAM_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def _gopher_repetition_reason(text: str, words: list[str], cfg: GopherRepetitionConfig) -> str | None:
    n_chars = len(text)
    if cfg.max_dup_para_frac is not False or cfg.max_dup_para_char_frac is not False:
        paragraphs = [p for p in _PARAGRAPH_BREAK.split(text.strip()) if p]
        copies, copy_chars = _copies(paragraphs)
        if cfg.max_dup_para_frac is not False and copies / max(len(paragraphs), 1) > cfg.max_dup_para_frac:
            return "gopher_repetition:dup_para_frac"
        if cfg.max_dup_para_char_frac is not False and copy_chars / n_chars > cfg.max_dup_para_char_frac:
            return "gopher_repetition:dup_para_char_frac"
    if cfg.max_dup_line_frac is not False or cfg.max_dup_line_char_frac is not False:
        lines = [line for line in text.split("\n") if line and not line.isspace()]
        copies, copy_chars = _copies(lines)
        if cfg.max_dup_line_frac is not False and copies / max(len(lines), 1) > cfg.max_dup_line_frac:
            return "gopher_repetition:dup_line_frac"
        if cfg.max_dup_line_char_frac is not False and copy_chars / n_chars > cfg.max_dup_line_char_frac:
            return "gopher_repetition:dup_line_char_frac"
    top = {n: getattr(cfg, f"max_top_{n}gram_char_frac") for n in (2, 3, 4)}
    dup = {n: getattr(cfg, f"max_dup_{n}gram_char_frac") for n in range(5, 11)}
    top = {n: limit for n, limit in top.items() if limit is not False}
    dup = {n: limit for n, limit in dup.items() if limit is not False}
    if len(words) < 2 or not (top or dup):
        return None
    return _ngram_reason(words, top, dup)


def _copies(items: list[str]) -> tuple[int, int]:
    """How many items repeat an earlier item, and their characters."""
    counts = Counter(items)
    if len(counts) == len(items):
        return 0, 0
    return len(items) - len(counts), sum(len(item) * (c - 1) for item, c in counts.items() if c > 1)


def _ngram_reason(words: list[str], top: dict[int, float], dup: dict[int, float]) -> str | None:
    """Table A1's n-gram rules, on 64-bit hashes of words rather than on the strings.

    Python's str hash is salted per process, but only which n-grams are equal matters, so
    verdicts do not depend on the salt (up to a 64-bit hash collision).
    """
    n_words = len(words)
    word_hashes = np.fromiter(map(hash, words), dtype=np.int64, count=n_words).view(np.uint64)
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=n_words)
    starts = np.zeros(n_words + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])  # starts[i]: characters before word i
    total = int(starts[-1])
    ngram_hashes = word_hashes
    for n in range(2, max((*top, *dup)) + 1):
        if n > n_words:
            break
        ngram_hashes = ngram_hashes[:-1] * _NGRAM_MULTIPLIER + word_hashes[n - 1:]  # (n_words - n + 1,)
        if n not in top and n not in dup:
            continue
        order = np.argsort(ngram_hashes)
        ordered = ngram_hashes[order]
        same_as_next = ordered[1:] == ordered[:-1]
        if n in top:
            group_starts = np.flatnonzero(np.concatenate(([True], ~same_as_next)))
            counts = np.diff(np.append(group_starts, len(ordered)))
            most = counts.max()
            if most > 1:  # a document without a repeated n-gram has no most frequent one
                # Of equally frequent n-grams the longest, a choice no hash value decides.
                first = order[group_starts[counts == most]]
                top_chars = int(most) * int((starts[first + n] - starts[first]).max())
                if top_chars / total > top[n]:
                    return f"gopher_repetition:top_{n}gram"
        if n in dup:
            repeated = np.zeros(len(ordered), dtype=bool)
            repeated[1:] |= same_as_next
            repeated[:-1] |= same_as_next
            positions = order[repeated]
            # +1 where a repeated n-gram starts, -1 where it ends; a running sum > 0 is covered.
            depth = np.cumsum(np.bincount(positions, minlength=n_words + 1)[:n_words]
                              - np.bincount(positions + n, minlength=n_words + 1)[:n_words])
            share = int(lengths[depth > 0].sum()) / total
            if share > dup[n]:
                return f"gopher_repetition:dup_{n}gram"
            # Coverage only shrinks as n grows (the two n-grams inside a repeated (n+1)-gram
            # repeat too), so once it is under every longer n-gram's limit, none can fail.
            if all(n >= m for m in top) and all(share <= limit for m, limit in dup.items() if m > n):
                break
    return None


# ---------------------------------------------------------------------------------------
# C4 line rules
# ---------------------------------------------------------------------------------------

_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_TERMINAL = (".", "!", "?", '"', "”")
_ELLIPSES = ("...", "…")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
# A sentence ends at terminal punctuation (and closing quotes or brackets) before the end
# of the line or before a word that does not start in lower case ("e.g. the" is one sentence).
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?:$|\s+(?![a-z]))")


def _c4_lines(text: str, cfg: C4Config) -> tuple[str | None, str | None]:
    kept: list[str] = []
    sentences = 0
    for line in text.split("\n"):
        line = line.strip()
        if not line:
            continue
        if cfg.max_word_length is not False and len(line) > cfg.max_word_length \
                and max(map(len, line.split())) > cfg.max_word_length:
            continue
        if cfg.remove_citations and "[" in line:
            line = _CITATION.sub("", line).strip()
        if cfg.terminal_punctuation and (not line.endswith(_TERMINAL) or line.endswith(_ELLIPSES)):
            continue
        if cfg.min_words_per_line is not False and len(line.split()) < cfg.min_words_per_line:
            continue
        lower = line.lower()
        if cfg.lorem_ipsum and "lorem ipsum" in lower:
            return None, "c4:lorem_ipsum"
        if cfg.javascript and "javascript" in lower:
            continue
        if cfg.curly_bracket and "{" in line:
            return None, "c4:curly_bracket"
        if cfg.policy and any(phrase in lower for phrase in _POLICY):
            continue
        if line:
            kept.append(line)
            sentences += max(1, len(_SENTENCE_END.findall(line)))
    if not kept or (cfg.min_sentences is not False and sentences < cfg.min_sentences):
        return None, "c4:too_few_sentences"
    return "\n".join(kept), None


# ---------------------------------------------------------------------------------------
# Code
# ---------------------------------------------------------------------------------------

_ALPHANUMERIC_ASCII = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NOT_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")
_AUTOGENERATED = re.compile(r"auto-?generated|automatically generated|generated automatically|do not edit"
                            r"|this file (?:is|was) generated|generated from|^[\W_]*generated by",
                            re.IGNORECASE | re.MULTILINE)
AUTOGENERATED_SCAN_LINES = 5  # CodeParrot's is_autogenerated(scan_width=5)


def _code_reason(text: str, cfg: CodeConfig) -> str | None:
    lines = text.split("\n")
    if cfg.max_line_length is not False and max(map(len, lines)) > cfg.max_line_length:
        return "code:max_line_length"
    if cfg.max_mean_line_length is not False \
            and (len(text) - (len(lines) - 1)) / len(lines) > cfg.max_mean_line_length:
        return "code:mean_line_length"
    if cfg.min_alphanumeric_frac is not False:
        # str.isalnum counted in C: ASCII characters as bytes, the (usually few) others one by one.
        ascii_bytes = text.encode("ascii", errors="ignore")
        alphanumeric = len(ascii_bytes) - len(ascii_bytes.translate(None, _ALPHANUMERIC_ASCII))
        if not text.isascii():
            alphanumeric += sum(map(str.isalnum, "".join(_NOT_ASCII_RUN.findall(text))))
        if alphanumeric / len(text) < cfg.min_alphanumeric_frac:
            return "code:alphanumeric"
    if cfg.autogenerated:
        end = -1
        for _ in range(AUTOGENERATED_SCAN_LINES):
            end = text.find("\n", end + 1)
            if end < 0:
                end = len(text)
                break
        if _AUTOGENERATED.search(text, 0, end):
            return "code:autogenerated"
    return None
