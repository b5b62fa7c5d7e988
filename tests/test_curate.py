"""Curation (data/curate.py): normalisation and each published filter, on hand-made documents with known verdicts."""

import itertools
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import ftfy
import pytest

from scaletrain.data import DataError
from scaletrain.data.curate import (_FTFY_CODE, _FTFY_PROSE, REASONS, SECTIONS, FilterConfig, _fix_unicode,
                                    curate, document_kind, load_filters)

DEFAULT = load_filters("default")


def only(*stages: str, **settings: dict) -> FilterConfig:
    """Normalisation and the named stages on, every other stage off; settings override a stage's keys."""
    return FilterConfig(**{section: {"enabled": section in ("normalize", *stages), **settings.get(section, {})}
                           for section in SECTIONS})


def kept(text: str, kind: str, cfg: FilterConfig) -> str:
    result, reason = curate(text, kind, cfg)
    assert reason is None, f"dropped for {reason}"
    return result


def dropped(text: str, kind: str, cfg: FilterConfig) -> str:
    result, reason = curate(text, kind, cfg)
    assert result is None and reason in REASONS
    return reason


# Real prose: 8 distinct sentences, 116 words, one per line.
PROSE = """The history of the printing press is closely tied to the spread of literacy in Europe.
Before movable type, books were copied by hand, which made them rare and expensive.
Johannes Gutenberg combined a screw press with metal type and oil-based ink around 1450.
Within fifty years, printers were working in more than two hundred cities across the continent.
Cheaper books meant that merchants, artisans and students could own texts of their own.
Scholars have argued about how quickly reading habits changed, and the evidence is mixed.
What is clear is that pamphlets carried new ideas faster than any courier could.
Historians still study surviving copies to learn who bought them and how they were read."""
WORDS = PROSE.split()


def pseudo_words(count: int, length: int = 5) -> list[str]:
    """count distinct made-up words of the same length, so character shares are word shares."""
    spellings = itertools.product("bcdfgklmnprstvz", repeat=length)
    return ["".join(letters) for letters in itertools.islice(spellings, count)]


def lines_of(words: list[str], per_line: int = 10) -> str:
    return "\n".join(" ".join(words[i:i + per_line]) for i in range(0, len(words), per_line))


# ---------------------------------------------------------------------------------------
# load_filters and document_kind
# ---------------------------------------------------------------------------------------

def test_default_filters_turn_every_stage_on_and_none_turns_every_stage_off():
    assert DEFAULT == FilterConfig()
    assert all(getattr(DEFAULT, section).enabled for section in SECTIONS)
    none = load_filters("none")
    assert not any(getattr(none, section).enabled for section in SECTIONS)
    text = "schÃ¶n  \r\n\r\n\r\n\r\n\r\nshort"  # mojibake, CRLF, trailing spaces, blank lines: all left alone
    assert curate(text, "prose", none) == (text, None)


def test_a_toml_file_overrides_the_defaults_key_by_key_and_false_turns_a_rule_off(tmp_path):
    path = tmp_path / "filters.toml"
    path.write_text("[c4]\nmin_words_per_line = 3\n\n[gopher_repetition]\nmax_dup_5gram_char_frac = false\n"
                    "\n[code]\nenabled = false\n")
    cfg = load_filters(path)
    assert cfg.c4.min_words_per_line == 3 and cfg.c4.min_sentences == DEFAULT.c4.min_sentences
    assert cfg.gopher_repetition.max_dup_5gram_char_frac is False
    assert cfg.gopher_repetition.max_dup_6gram_char_frac == 0.14
    assert not cfg.code.enabled and cfg.gopher_quality == DEFAULT.gopher_quality


@pytest.mark.parametrize("toml, message", [
    ("[c4]\nmin_word_per_line = 3\n", r"unknown key c4\.min_word_per_line .* min_words_per_line"),
    ("[gopher]\nmin_words = 3\n", r"unknown section \[gopher\] .* gopher_quality, gopher_repetition"),
    ("[c4]\nmin_sentences = true\n", r"c4\.min_sentences = True .* whole number .* or false"),
    ("[gopher_repetition]\nmax_dup_line_frac = 1.5\n", r"max_dup_line_frac = 1\.5 .* from 0 to 1, or false"),
    ("[c4]\ncurly_bracket = 3\n", r"c4\.curly_bracket = 3 .* true or false"),
    ("[c4\n", r"not valid TOML"),
])
def test_a_bad_filters_file_is_a_data_error_naming_the_key_and_what_is_valid(tmp_path, toml, message):
    path = tmp_path / "filters.toml"
    path.write_text(toml)
    with pytest.raises(DataError, match=message):
        load_filters(path)


def test_a_filters_spec_that_is_no_name_and_no_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="neither 'default', 'none' nor an existing TOML file"):
        load_filters(tmp_path / "missing.toml")


@pytest.mark.parametrize("name, kind", [
    ("json/__init__.py", "code"), ("src/main.RS", "code"), ("include/x.h", "code"), ("web/app.ts", "code"),
    ("build.sh", "code"), ("pyproject.toml", "code"), ("ci.yaml", "code"), ("data.json", "code"),
    ("Makefile", "code"), ("CMakeLists.txt", "code"), ("page.html", "code"),
    ("notes.txt", "prose"), ("README.md", "prose"), ("docs/index.rst", "prose"), ("LICENSE", "prose"),
    ("web.jsonl", "prose"), ("rows.parquet", "prose"), ("archive.unknown", "prose"),
])
def test_document_kind_is_decided_by_the_file_extension_or_name(name, kind):
    assert document_kind(name) == kind


def test_reasons_are_unique_and_named_by_stage():
    assert len(set(REASONS)) == len(REASONS)
    assert all(reason == "empty_after_normalize" or reason.split(":")[0] in SECTIONS for reason in REASONS)


# ---------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["code", "prose"])
def test_normalisation_repairs_mojibake_newlines_trailing_space_and_edges_in_both_kinds(kind):
    assert kept("# schÃ¶n", kind, only()) == "# schön"
    assert kept("a\r\nb\rc", kind, only()) == "a\nb\nc"
    assert kept("\ufeffx = 1   \t\ny = 2 \n", kind, only()) == "x = 1\ny = 2"
    assert kept("\n\n   \n    indented = 1\n\n\n", kind, only()) == "    indented = 1"


def test_code_keeps_indentation_blank_lines_and_every_character_a_program_can_see():
    code = "def f():\n\tif x:\n        return '’&amp;\x1b[31m\u2028ﬁ'\n\n\n\n\n\n    # e\u0301 \u2126\n"
    assert kept(code, "code", only()) == code.rstrip("\n")


def test_prose_gets_nfc_fewer_blank_lines_and_loses_escapes_and_ligatures_but_keeps_curly_quotes():
    assert kept("cafe\u0301 \u2126", "prose", only()) == "caf\u00e9 \u03a9"
    assert kept("one\n\n\n\n\n\ntwo\n\n\nthree", "prose", only()) == "one\n\n\ntwo\n\n\nthree"
    assert kept("Red \x1b[31mtext\x1b[0m, a \ufb01ne \u201cquote\u201d.", "prose", only()) \
        == "Red text, a fine \u201cquote\u201d."


def test_a_document_left_empty_by_normalisation_is_dropped():
    assert dropped("\ufeff \x00\x01 \n\t\n", "prose", only()) == "empty_after_normalize"
    assert dropped("\r\n  \r\n", "code", only()) == "empty_after_normalize"


def stdlib_lines_with_non_ascii() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for name in ("test/test_unicode_identifiers.py", "test/test_utf8source.py", "test/test_exceptions.py",
                 "test/test_getpass.py", "test/test_shelve.py", "test/test_ntpath.py", "re/_casefix.py"):
        if (root / name).is_file():
            lines += [line for line in (root / name).read_text(encoding="utf-8").split("\n") if not line.isascii()]
    return lines


@pytest.mark.parametrize("kind, config", [("code", _FTFY_CODE), ("prose", _FTFY_PROSE)])
def test_running_ftfy_only_on_lines_it_could_change_gives_what_ftfy_gives(kind, config):
    lines = ["schÃ¶n", "Ã©tÃ© â€” nice", "voilÃ le travail", "â€œquotedâ€\x9d", "cafÃ©\x85", "x\x80y",
             "plain ’ quote", "Œuvre", "Â ", "\ud83d\ude00 pair", "\ud800 lone", "ﬁne ﬂat Ĳ", "a\u2028b\u2029c",
             "ctl\x00\x07\x1b[1m\x7f\r", "zero\u200bwidth\ufeff", "中文文本。日本語のテキスト", "Ελληνικά Кириллица",
             "РґРѕР±СЂС‹Р№", "ÐŸÑ€Ð¸Ð²ÐµÑ‚", "â€", "×²", "\u00a0\u00ad", *stdlib_lines_with_non_ascii()]
    text = "\n".join(lines)
    assert _fix_unicode(text, kind) == ftfy.fix_text(text, config)


# ---------------------------------------------------------------------------------------
# Gopher quality (prose)
# ---------------------------------------------------------------------------------------

def test_real_prose_passes_every_default_filter_and_c4_keeps_its_lines():
    assert kept(PROSE, "prose", DEFAULT) == PROSE


@pytest.mark.parametrize("reason, text, settings", [
    ("too_few_words", " ".join(WORDS[:49]), {}),
    ("too_many_words", PROSE, {"max_words": 100}),
    ("short_mean_word", "I am a ox to be or it is an " * 6, {}),
    ("long_mean_word", " ".join(["internationalisation"] * 50 + ["the", "of"]), {}),
    ("hash_ratio", PROSE + " #tag" * 13, {}),
    ("ellipsis_ratio", PROSE + " ..." * 13, {}),
    ("bullet_lines", "\n".join("• " + " ".join(WORDS[i:i + 8]) for i in range(0, 80, 8)), {}),
    ("ellipsis_lines", "\n".join(" ".join(WORDS[i:i + 8]) + ("..." if i < 32 else "") for i in range(0, 80, 8)), {}),
    ("alpha_words", PROSE + " 2024" * 30, {}),
    ("stop_words", "Bright sunny mornings bring happy people outside for long walks. " * 7, {}),
])
def test_each_gopher_quality_rule_drops_what_it_should(reason, text, settings):
    assert dropped(text, "prose", only("gopher_quality", gopher_quality=settings)) == f"gopher_quality:{reason}"


@pytest.mark.parametrize("text", [
    " ".join(WORDS[:50]),  # exactly 50 words
    PROSE + " #tag" * 11,  # 11 hashes in 127 words: 0.087
    "\n".join(("• " if i < 72 else "") + " ".join(WORDS[i:i + 8]) for i in range(0, 80, 8)),  # 9 of 10 bulleted
    "\n".join(" ".join(WORDS[i:i + 8]) + ("..." if i < 24 else "") for i in range(0, 80, 8)),  # 3 of 10 end in ...
    PROSE + " 2024" * 25,  # 115 of 141 words with a letter: 0.816
    "Bright sunny mornings bring the happy people outside for long walks with dogs. " * 5,
])
def test_prose_just_inside_the_gopher_quality_thresholds_is_kept(text):
    kept(text, "prose", only("gopher_quality"))


# ---------------------------------------------------------------------------------------
# Gopher repetition (prose)
# ---------------------------------------------------------------------------------------

def repeated_phrase(phrase_words: int, total_words: int) -> str:
    """total_words 5-letter words, all distinct but for one phrase of phrase_words that occurs twice."""
    distinct = pseudo_words(total_words - phrase_words)
    copy_at = len(distinct) - 4  # the first occurrence starts at word 3, the copy 4 words before the end
    return lines_of(distinct[:copy_at] + distinct[3:3 + phrase_words] + distinct[copy_at:])


def blocks(block: list[str], copies: int, fillers_per_block: int) -> str:
    """copies of block, each followed by fillers_per_block distinct words."""
    fillers = iter(pseudo_words(copies * fillers_per_block, length=6))
    words = [w for _ in range(copies) for w in (*block, *itertools.islice(fillers, fillers_per_block))]
    return lines_of(words, per_line=7)


paragraphs = [" ".join(WORDS[i:i + 12]) for i in range(0, 96, 12)]
long_line, short_lines = " ".join(WORDS[:40]), [" ".join(WORDS[i:i + 3]) for i in range(40, 55, 3)]


@pytest.mark.parametrize("reason, text", [
    ("dup_para_frac", "\n\n".join(paragraphs[:3] + paragraphs[:2])),  # 2 copies in 5 paragraphs
    ("dup_para_char_frac", "\n\n".join([long_line, long_line, *short_lines[:3]])),  # 1 of 5, 44% of characters
    ("dup_line_frac", "\n".join(paragraphs[:4] + paragraphs[:2])),  # 2 copies in 6 lines
    ("dup_line_char_frac", "\n".join([long_line, long_line, *short_lines])),  # 1 of 7, 42% of characters
    ("top_2gram", blocks(["xxaaa", "xxbbb"], 30, 1)),  # 62%
    ("top_3gram", blocks(["xxaaa", "xxbbb", "xxccc"], 10, 9)),  # 22%, its 2-grams 14%
    ("top_4gram", blocks(["xxaaa", "xxbbb", "xxccc", "xxddd"], 10, 16)),  # 17%, its 3-grams 13%
    ("dup_5gram", repeated_phrase(5, 55)),  # 10 of 55 words: 18%
    ("dup_6gram", repeated_phrase(6, 82)),  # 12 of 82: 14.6%
    ("dup_7gram", repeated_phrase(7, 104)),  # 14 of 104: 13.5%
    ("dup_8gram", repeated_phrase(8, 128)),  # 16 of 128: 12.5%
    ("dup_9gram", repeated_phrase(9, 156)),  # 18 of 156: 11.5%
    ("dup_10gram", repeated_phrase(10, 190)),  # 20 of 190: 10.5%
])
def test_each_gopher_repetition_rule_drops_what_it_should(reason, text):
    assert dropped(text, "prose", only("gopher_repetition")) == f"gopher_repetition:{reason}"


@pytest.mark.parametrize("text", [
    PROSE,
    blocks(["xxaaa", "xxbbb", "xxccc"], 10, 12),  # top 3-gram 17%
    repeated_phrase(10, 210),  # 20 of 210 words: 9.5%
])
def test_prose_inside_the_gopher_repetition_thresholds_is_kept(text):
    kept(text, "prose", only("gopher_repetition"))


def test_gopher_repetition_verdicts_do_not_depend_on_the_per_process_string_hash_salt():
    script = ("import sys; sys.path.insert(0, 'tests'); from test_curate import *; "
              "docs = [repeated_phrase(n, t) for n in range(5, 11) for t in range(40, 220, 15)]; "
              "print([curate(d, 'prose', only('gopher_repetition'))[1] for d in docs])")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, cwd=Path(__file__).parents[1]).stdout
               for seed in ("1", "2")}
    assert len(outputs) == 1 and "dup_" in outputs.pop()


# ---------------------------------------------------------------------------------------
# C4 (prose)
# ---------------------------------------------------------------------------------------

def test_c4_keeps_only_lines_that_end_a_sentence_have_five_words_and_are_no_boilerplate():
    text = "\n".join([
        "The first sentence here is long enough to keep.",
        "Too short a line.",
        "This line has no terminal punctuation at all",
        "Please enable JavaScript to view this page properly.",
        "By using this site you agree to our Terms of Use today.",
        "Wikipedia says that the sky is blue[1] on most days.[citation needed]",
        "This line trails off into an ellipsis and is dropped...",
        "A word of " + "x" * 1001 + " characters is too long.",
        "  She asked: \u201cis this the third sentence of the page?\u201d  ",
    ])
    assert kept(text, "prose", only("c4")) == "\n".join([
        "The first sentence here is long enough to keep.",
        "Wikipedia says that the sky is blue on most days.",
        "She asked: \u201cis this the third sentence of the page?\u201d",
    ])


@pytest.mark.parametrize("reason, text", [
    ("lorem_ipsum", PROSE + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."),
    ("curly_bracket", PROSE + "\nThe body of the function goes between { and } here."),
    ("too_few_sentences", "\n".join(PROSE.split("\n")[:2])),
])
def test_each_c4_document_rule_drops_what_it_should(reason, text):
    assert dropped(text, "prose", only("c4")) == f"c4:{reason}"


def test_c4_keeps_a_document_of_three_sentences():
    assert kept("\n".join(PROSE.split("\n")[:3]), "prose", only("c4"))


def test_c4_looks_for_a_curly_bracket_only_in_lines_its_line_rules_kept_as_its_reference_code_does():
    assert kept(PROSE + "\nint main() {", "prose", only("c4")) == PROSE


# ---------------------------------------------------------------------------------------
# Code
# ---------------------------------------------------------------------------------------

CODE = 'import os\n\n\ndef home() -> str:\n    """The home directory."""\n    return os.path.expanduser("~")\n'


@pytest.mark.parametrize("reason, text", [
    ("max_line_length", CODE + "x = '" + "a" * 1000 + "'\n"),
    ("mean_line_length", "\n".join(f"value_{i} = '{'abc ' * 36}'" for i in range(10))),
    ("alphanumeric", CODE + "# " + "=-" * 200 + "\n" + "#" * 80 + "\n"),
    ("autogenerated", "# -*- coding: utf-8 -*-\n# Generated by the protocol buffer compiler.\n" + CODE),
    ("autogenerated", '"""Codec generated from \'CP1252.TXT\' with gencodec.py."""\n' + CODE),
    ("autogenerated", "// Code generated by stringer. DO NOT EDIT.\npackage main\n"),
])
def test_each_code_rule_drops_what_it_should(reason, text):
    assert dropped(text, "code", only("code")) == f"code:{reason}"


@pytest.mark.parametrize("text", [
    CODE,
    CODE * 3 + "x = '" + "a" * 994 + "'\n",  # a line of exactly 1000 characters
    "\n".join(["x = 1"] * 5) + "\n# This auto-generated remark is on line 6, past the header.\n",
    "# Parser for the grammar tables generated by pgen.\n" + CODE,  # "generated by" inside a sentence
])
def test_ordinary_code_passes_the_code_rules(text):
    kept(text, "code", only("code"))


def test_a_standard_library_module_passes_the_defaults_changed_only_in_whitespace_and_still_compiles():
    path = Path(json.__file__)
    text = path.read_text(encoding="utf-8")
    result = kept(text, "code", DEFAULT)
    assert result.split() == text.split()
    compile(result, str(path), "exec")


def test_code_never_meets_the_prose_rules():
    program = "int main(void) {\n    return 0;\n}\n"  # 6 words, no sentences, a curly bracket
    assert kept(program, "code", DEFAULT) == program.rstrip("\n")
    assert dropped(program, "prose", DEFAULT) == "gopher_quality:too_few_words"


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_odd_input_gets_a_verdict_never_an_exception(kind):
    for text in ["\x00" * 100, "a" * 2_000_000, "\ud800 lone surrogate from JSON", "é" * 50_000 + "\n" * 3,
                 "\n".join(["same line here"] * 500), "?" * 10_000, "Ã" * 1000]:
        result, reason = curate(text, kind, DEFAULT)
        assert (result is None) == (reason in REASONS)
