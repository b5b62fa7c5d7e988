"""`prepare`: sources in, a data directory out, checked on small real corpora and real tokenizers."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import bos_tokenizer
from tokenizers import Tokenizer

from scaletrain.data import DataError
from scaletrain.data import prepare as _prepare
from scaletrain.data.shards import open_split, read_index, read_indexes

VOCAB = 300  # the smallest vocabularies keep training instant


def prepare(*args, **kwargs):
    """These tests are about reading, splitting and tokenizing: no curation (tests/test_curation.py
    covers it), and one process, which keeps each test to a fraction of a second."""
    kwargs.setdefault("filters", "none")
    kwargs.setdefault("workers", 1)
    return _prepare(*args, **kwargs)


def write_corpus(root):
    """A directory with text files, a .jsonl and a .parquet; returns its documents in reading order."""
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("The first text file.\nIt has two lines.\n")
    (root / "c.md").write_text("# A markdown file\n\nwith unicode: héllo wörld ✓\n")
    (root / "d.jsonl").write_text(json.dumps({"text": "jsonl one"}) + "\n" + json.dumps({"text": "jsonl two", "id": 2}) + "\n")
    pq.write_table(pa.table({"id": [1, 2], "text": ["parquet row one", "parquet row two"]}), root / "e.parquet")
    (root / "sub" / "b.txt").write_text("a file in a subdirectory")
    return ["The first text file.\nIt has two lines.\n", "# A markdown file\n\nwith unicode: héllo wörld ✓\n",
            "jsonl one", "jsonl two", "parquet row one", "parquet row two", "a file in a subdirectory"]


def decoded_documents(data_dir, split):
    """The documents of a split, decoded with the saved tokenizer, split at the end-of-document ids."""
    tokens = open_split(data_dir, split)
    ids = tokens.read(0, tokens.tokens)
    tokenizer = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    ends = np.flatnonzero(ids == tokens.eos_id)
    assert len(ids) == 0 or ends[-1] == len(ids) - 1, "every document, the last too, ends with eos"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


def file_times(data_dir):
    return {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}


def test_prepare_writes_a_data_dir_whose_tokens_decode_to_the_documents_in_order(tmp_path):
    documents = write_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    result = prepare([str(tmp_path / "corpus")], out, VOCAB, val_fraction=0)
    assert not result.reused and result.out == out
    for name in ("index.json", "tokenizer.json", "stats.json", "manifest.json", "shards/train_00000_00000.bin"):
        assert (out / name).is_file()
    assert read_index(out)["dtype"] == "uint16"
    assert open_split(out, "train").shards[0].dtype == np.uint16
    assert decoded_documents(out, "train") == documents
    assert json.loads((out / "stats.json").read_text()) == result.stats
    assert result.stats["documents"]["kept"] == len(documents)
    assert any(w.startswith("the validation split is empty (--val-fraction 0)") for w in result.warnings)


def test_validation_split_is_by_document_nonempty_and_disjoint_and_stats_count_the_index(tmp_path):
    documents = [f"document number {i} says {'many ' * i}things" for i in range(60)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    out = tmp_path / "data"
    result = prepare([str(tmp_path / "corpus.jsonl")], out, VOCAB, val_fraction=0.2)
    train, val = decoded_documents(out, "train"), decoded_documents(out, "val")
    assert val and train and not set(train) & set(val)
    assert sorted(train + val) == sorted(documents)
    assert train == [d for d in documents if d in set(train)], "each split keeps reading order"
    index = read_index(out)
    for split in ("train", "val"):
        assert result.stats["tokens"][split] == index["splits"][split]["tokens"]
        assert result.stats["documents"][split] == index["splits"][split]["documents"]


def test_a_tiny_val_fraction_still_holds_out_one_document(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"text {i}")
    result = prepare([str(tmp_path / "*.txt")], tmp_path / "data", VOCAB, val_fraction=1e-9)
    assert (result.stats["documents"]["train"], result.stats["documents"]["val"]) == (2, 1)


def test_rerun_on_unchanged_input_reuses_the_result_without_rewriting_it(tmp_path):
    write_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    first = prepare([str(tmp_path / "corpus")], out, VOCAB)
    before = file_times(out)
    again = prepare([str(tmp_path / "corpus")], out, VOCAB)
    assert again.reused and again.stats == first.stats
    assert file_times(out) == before


def test_changing_an_option_or_a_file_prepares_again(tmp_path):
    write_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    prepare([str(tmp_path / "corpus")], out, VOCAB)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # A finished prepare is not replaced by one of other options unless asked (a typo would lose it).
    with pytest.raises(DataError, match=f"holds a finished prepare of other sources or options \\(vocabulary {VOCAB}, "
                                        "made .*; seed 0 then, 1 now\\); give another output directory, or --overwrite "
                                        "to replace it"):
        prepare([str(tmp_path / "corpus")], out, VOCAB, seed=1)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    again = prepare([str(tmp_path / "corpus")], out, VOCAB, seed=1, overwrite=True)
    assert not again.reused
    assert any(f"{out} held a finished prepare that differs from this one (vocabulary {VOCAB}, made " in warning
               and "it was replaced" in warning for warning in again.warnings)
    (tmp_path / "corpus" / "a.txt").write_text("changed content")
    result = prepare([str(tmp_path / "corpus")], out, VOCAB, seed=1, overwrite=True)
    assert not result.reused
    assert "changed content" in decoded_documents(out, "train") + decoded_documents(out, "val")


def test_a_directory_without_its_manifest_is_prepared_again(tmp_path):
    # What an interrupted prepare leaves behind: everything but the manifest, written last.
    write_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    prepare([str(tmp_path / "corpus")], out, VOCAB)
    (out / "manifest.json").unlink()
    assert not prepare([str(tmp_path / "corpus")], out, VOCAB).reused
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("damage, words", [
    ("offsets-missing", "cannot be read"),
    ("offsets-truncated", "cannot be read"),
    ("offsets-wrong", "do not describe that shard's"),
    ("tokens-short", "is missing or not"),
])
def test_a_damaged_shard_is_reported_by_data_stats_and_prepared_again(tmp_path, damage, words):
    """data stats names the damaged file and what to do; data prepare does not take the damaged
    directory for a finished one."""
    from scaletrain.data.stats import describe

    write_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    prepare([str(tmp_path / "corpus")], out, VOCAB)
    assert describe(out)["mean_length"] > 0
    shard = read_index(out)["splits"]["train"]["shards"][0]
    docs, tokens = out / shard["docs"], out / shard["path"]
    if damage == "offsets-missing":
        docs.unlink()
    elif damage == "offsets-truncated":
        docs.write_bytes(docs.read_bytes()[:-5])
    elif damage == "offsets-wrong":
        np.save(docs, np.load(docs)[::-1])
    else:
        tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(DataError, match=words) as raised:
        describe(out)
    assert "prepare the data directory again" in str(raised.value)
    assert not prepare([str(tmp_path / "corpus")], out, VOCAB).reused
    assert describe(out)["mean_length"] > 0


def test_non_utf8_file_is_kept_with_replacement_characters_and_counted(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (tmp_path / "corpus" / "utf8.txt").write_text("plain text")
    result = prepare([str(tmp_path / "corpus")], tmp_path / "data", VOCAB, val_fraction=0)
    assert result.stats["files"]["not_utf8"] == 1
    assert result.stats["documents"]["kept"] == 2
    assert "caf\ufffd cr\ufffdme" in decoded_documents(tmp_path / "data", "train")
    assert any("latin1.txt" in w and "UTF-8" in w for w in result.warnings)


def test_a_double_star_glob_reads_each_file_once_in_sorted_order(tmp_path):
    write_corpus(tmp_path / "corpus")
    result = prepare([str(tmp_path / "corpus" / "**")], tmp_path / "data", VOCAB, val_fraction=0)
    assert result.stats["files"]["read"] == 5
    assert decoded_documents(tmp_path / "data", "train") == write_corpus(tmp_path / "again")


def test_binary_and_empty_files_are_dropped_with_their_reasons(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "image.bin").write_bytes(b"\x89PNG\x00\x00\x01binary")
    (tmp_path / "corpus" / "blank.txt").write_text("  \n")
    (tmp_path / "corpus" / "text.txt").write_text("kept")
    result = prepare([str(tmp_path / "corpus")], tmp_path / "data", VOCAB)
    documents = result.stats["documents"]
    assert (documents["read"], documents["kept"]) == (3, 1)
    assert documents["dropped"]["binary"] == 1 and documents["dropped"]["empty"] == 1


def test_bad_jsonl_lines_are_skipped_counted_and_reported_by_file_and_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"text": "good one"}\n{not json\n{"body": "no text field"}\n\n{"text": "good two"}\n[1, 2]\n')
    result = prepare([str(path)], tmp_path / "data", VOCAB, val_fraction=0)
    dropped = result.stats["documents"]["dropped"]
    assert (dropped["bad_json"], dropped["missing_field"]) == (1, 2)
    assert decoded_documents(tmp_path / "data", "train") == ["good one", "good two"]
    notes = "\n".join(result.warnings)
    assert f"{path}:2: not valid JSON" in notes
    assert f"{path}:3: has no 'text' field" in notes
    assert f"{path}:6:" in notes


def test_a_jsonl_that_begins_with_a_byte_order_mark_loses_no_record(tmp_path):
    (tmp_path / "bom.jsonl").write_text('{"text": "first"}\n{"text": "second"}\n', encoding="utf-8-sig")
    result = prepare([str(tmp_path / "bom.jsonl")], tmp_path / "data", VOCAB, val_fraction=0)
    assert decoded_documents(tmp_path / "data", "train") == ["first", "second"]
    assert not any("not valid JSON" in warning for warning in result.warnings)


def test_text_field_names_the_jsonl_field_and_parquet_column(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "from jsonl"}) + "\n")
    pq.write_table(pa.table({"content": ["from parquet"]}), tmp_path / "b.parquet")
    prepare([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], tmp_path / "data", VOCAB,
            text_field="content", val_fraction=0)
    assert decoded_documents(tmp_path / "data", "train") == ["from jsonl", "from parquet"]


def test_compressed_sources_and_json_lines_named_json_are_read_as_their_inner_format(tmp_path, monkeypatch):
    """gzip, bzip2, xz and zstandard files are read as what their names say without the
    compression suffix (C4's shards are .json.gz of JSON Lines, the Pile's .jsonl.zst); a .json
    is JSON Lines when its first line is a record with the text field, text otherwise (a code
    corpus's package.json); a compressed code file keeps its extension for curation; a
    truncated archive, or .zst without its package, is refused in one sentence."""
    import bz2
    import gzip
    import lzma

    import zstandard

    from scaletrain.data.curate import document_kind
    from scaletrain.data.sources import ReadStats, list_files, read_documents

    def records(*texts):
        return "".join(json.dumps({"text": t, "url": "x"}) + "\n" for t in texts).encode()

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.json.gz").write_bytes(gzip.compress(records("gzip one", "gzip two")))
    (corpus / "b.jsonl.bz2").write_bytes(bz2.compress(records("bzip2 one")))
    (corpus / "c.txt.xz").write_bytes(lzma.compress("xz text".encode()))
    (corpus / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(records("zstd one", "zstd two")))
    (corpus / "e.json").write_bytes(records("plain json lines"))
    (corpus / "f.py.gz").write_bytes(gzip.compress(b"def f(x):\n    return x\n"))
    package = '{\n  "name": "left as text"\n}\n'
    (corpus / "package.json").write_text(package)
    prepare([str(corpus)], tmp_path / "data", VOCAB, val_fraction=0)
    assert decoded_documents(tmp_path / "data", "train") == [  # (files in name order)
        "gzip one", "gzip two", "bzip2 one", "xz text", "zstd one", "zstd two", "plain json lines",
        "def f(x):\n    return x\n", package]
    names = [name for _, _, name in read_documents(list_files([str(corpus / "f.py.gz")]), "text", None, ReadStats())]
    assert names == ["f.py"] and document_kind(names[0]) == "code"
    # The reading of such files changed: the key of a prepare that lists one says so, not the others'.
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["options"]["reader"] == 2
    (tmp_path / "plain.txt").write_text("a text file, read as it always was")
    prepare([str(tmp_path / "plain.txt")], tmp_path / "plain", VOCAB, val_fraction=0)
    assert "reader" not in json.loads((tmp_path / "plain" / "manifest.json").read_text())["options"]
    # A .zst of two frames (as parallel compressors write) is read whole.
    two = zstandard.ZstdCompressor().compress(records("frame one")) + zstandard.ZstdCompressor().compress(
        records("frame two"))
    (tmp_path / "two.jsonl.zst").write_bytes(two)
    prepare([str(tmp_path / "two.jsonl.zst")], tmp_path / "two", VOCAB, val_fraction=0)
    assert decoded_documents(tmp_path / "two", "train") == ["frame one", "frame two"]
    whole = records("whole", "cut") * 50
    for name, damaged in (("cut.jsonl.gz", gzip.compress(whole)[:-12]),
                          ("cut.jsonl.zst", zstandard.ZstdCompressor().compress(whole)[:-12]),
                          ("cut.txt.zst", zstandard.ZstdCompressor().compress(b"text " * 500)[:-12]),
                          ("bad.jsonl.xz", lzma.compress(whole)[:20] + b"\0" * 40 + lzma.compress(whole)[60:])):
        (tmp_path / name).write_bytes(damaged)
        with pytest.raises(DataError, match=f"{name} could not be decompressed .*replace it with a whole copy"):
            prepare([str(tmp_path / name)], tmp_path / "cut", VOCAB)
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)  # (as where it is not installed)
    with pytest.raises(DataError, match="compressed with zstandard, which needs .*pip install zstandard"):
        prepare([str(corpus / "d.jsonl.zst")], tmp_path / "zst", VOCAB)


def test_one_long_text_is_cut_into_documents_at_its_paragraphs_or_lines(tmp_path):
    """A single text file (a book; here Python's licence) is one document whole: nothing for
    validation, and over the quality filters' length limit; the refusal and the warning say
    to cut it, and --split paragraph / line makes each paragraph or line a document (without
    its separators), the rest of the prepare as before; the split is one of the options a
    finished prepare was made with."""
    import re
    import sysconfig

    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    text = licence.read_text()
    whole = prepare([str(licence)], tmp_path / "whole", VOCAB, val_fraction=0.1)
    assert any("a text file is one document: --split paragraph, or line" in w for w in whole.warnings)
    filters = tmp_path / "filters.toml"
    filters.write_text("[gopher_quality]\nmax_words = 1000\n")  # (a book is over the default's 100,000)
    with pytest.raises(DataError, match="too_many_words.*cut long texts into documents .--split paragraph"):
        prepare([str(licence)], tmp_path / "refused", VOCAB, filters=str(filters))
    paragraphs = [p for p in re.split(r"\n[ \t]*\n\s*", text) if p]
    lines = [line for line in text.split("\n") if line]
    for split, documents in (("paragraph", paragraphs), ("line", lines)):
        out = tmp_path / split
        result = prepare([str(licence)], out, VOCAB, val_fraction=0.1, split=split)
        assert result.stats["documents"]["kept"] == len(documents) > 40
        assert result.stats["documents"]["val"] > 0
        held = decoded_documents(out, "train") + decoded_documents(out, "val")
        assert sorted(held) == sorted(documents)
    assert prepare([str(licence)], tmp_path / "line", VOCAB, val_fraction=0.1, split="line").reused
    with pytest.raises(DataError, match="holds a finished prepare of other sources or options .*split"):
        prepare([str(licence)], tmp_path / "line", VOCAB, val_fraction=0.1, split="paragraph")


def test_the_tokenizer_trains_on_a_sample_of_the_training_text_when_asked(tmp_path):
    """tokenizer_sample: about that many bytes of the training documents, drawn by hash (not the
    first files), train the tokenizer, which then tokenizes every document; stats say how many
    bytes trained it, and the sample is one of the options a finished prepare was made with."""
    documents = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(40)) for i in range(300)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    whole = prepare([str(tmp_path / "corpus.jsonl")], tmp_path / "whole", 400, val_fraction=0.1)
    sampled = prepare([str(tmp_path / "corpus.jsonl")], tmp_path / "sampled", 400, val_fraction=0.1,
                      tokenizer_sample=20_000)
    train_bytes = whole.stats["tokenizer"]["trained_on_bytes"]
    assert train_bytes == sum(len(d.encode()) for d in decoded_documents(tmp_path / "whole", "train"))
    assert 10_000 < sampled.stats["tokenizer"]["trained_on_bytes"] < 30_000 < train_bytes
    assert (tmp_path / "whole" / "tokenizer.json").read_bytes() != (tmp_path / "sampled" / "tokenizer.json").read_bytes()
    assert sorted(decoded_documents(tmp_path / "sampled", "train") + decoded_documents(tmp_path / "sampled", "val")) \
        == sorted(documents)
    with pytest.raises(DataError, match="holds a finished prepare of other sources or options .*tokenizer_sample"):
        prepare([str(tmp_path / "corpus.jsonl")], tmp_path / "sampled", 400, val_fraction=0.1, tokenizer_sample=40_000)
    with pytest.raises(DataError, match="no tokenizer to reuse"):
        prepare([str(tmp_path / "corpus.jsonl")], tmp_path / "given", 400, tokenizer=tmp_path / "whole",
                tokenizer_sample=1000)
    with pytest.raises(DataError, match="tokenizer_sample 1 bytes drew no training document"):
        prepare([str(tmp_path / "corpus.jsonl")], tmp_path / "tiny", 400, tokenizer_sample=1)


def test_documents_begin_with_a_given_tokenizers_beginning_of_sequence_token(tmp_path):
    """A given tokenizer whose post-processor begins texts with a special token (a Llama
    tokenizer's): every document begins with it, before its text and its end-of-document token
    (as torchtitan encodes them), and index.json says so; --no-bos keeps the documents without
    it; a tokenizer prepare trains has none."""
    documents = write_corpus(tmp_path / "corpus")
    plain = prepare([str(tmp_path / "corpus")], tmp_path / "plain", VOCAB, val_fraction=0)
    assert "bos_id" not in read_index(tmp_path / "plain") and "bos_id" not in plain.stats
    given, bos = bos_tokenizer(tmp_path / "plain", tmp_path / "bos.json")
    result = prepare([str(tmp_path / "corpus")], tmp_path / "bos", VOCAB, val_fraction=0, tokenizer=given)
    index = read_index(tmp_path / "bos")
    assert index["bos_id"] == result.stats["bos_id"] == bos
    tokens = open_split(tmp_path / "bos", "train")
    ids = tokens.read(0, tokens.tokens)
    starts = np.concatenate([[0], np.flatnonzero(ids == tokens.eos_id)[:-1] + 1])
    assert (ids[starts] == bos).all() and (ids == bos).sum() == len(documents)
    assert decoded_documents(tmp_path / "bos", "train") == documents  # (the token decodes to nothing)
    prepare([str(tmp_path / "corpus")], tmp_path / "no-bos", VOCAB, val_fraction=0, tokenizer=given, bos=False)
    assert "bos_id" not in read_index(tmp_path / "no-bos")
    unbegun = open_split(tmp_path / "no-bos", "train")
    assert not (unbegun.read(0, unbegun.tokens) == bos).any()
    # A mixture (or held-out set) of both would begin tasks and prompts as only one of them does: refused.
    with pytest.raises(DataError, match=r"begin documents differently \(beginning-of-sequence id by directory: "
                                        rf"{{'bos': {bos}, 'no-bos': None}}\); prepare them alike"):
        read_indexes({"bos": tmp_path / "bos", "no-bos": tmp_path / "no-bos"})


def test_end_of_text_written_inside_a_document_is_text_not_an_end_of_document(tmp_path):
    (tmp_path / "a.txt").write_text("before <|endoftext|> after")
    prepare([str(tmp_path / "a.txt")], tmp_path / "data", VOCAB)
    assert decoded_documents(tmp_path / "data", "train") == ["before <|endoftext|> after"]


@pytest.mark.parametrize("case, words", [
    ("missing path", ["does-not-exist", "does not exist"]),
    ("glob matching nothing", ["*.nothing", "matched no files"]),
    ("empty corpus", ["no documents", "2 empty"]),
    ("too small vocab", ["at least 257"]),
    ("unknown builtin", ["builtin:nope", "builtin:python-stdlib"]),
    ("parquet without the column", ["no column 'text'", "id, body"]),
    ("output inside a source directory", ["inside the folder that source", "read its files back"]),
    ("output inside a glob's folder", ["inside the folder that source", "read its files back"]),
    ("max_bytes below the first document", ["no documents", "1 over_max_bytes", "larger max_bytes"]),
    ("output among a user's files", ["holds other files (notes.txt)", "give a new or empty directory to prepare"]),
    ("a user's folder named as prepare's work", ["holds other files (work)"]),
])
def test_user_mistakes_raise_data_error_that_says_what_is_wrong(tmp_path, case, words):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.txt").write_text("\n\n")
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), tmp_path / "no_text.parquet")
    (tmp_path / "doc.txt").write_text("a document of some forty bytes of text..")
    out = tmp_path / "data"
    calls = {
        "missing path": lambda: prepare([str(tmp_path / "does-not-exist")], out, VOCAB),
        "glob matching nothing": lambda: prepare([str(tmp_path / "*.nothing")], out, VOCAB),
        "empty corpus": lambda: prepare([str(tmp_path / "empty")], out, VOCAB),
        "too small vocab": lambda: prepare([str(tmp_path / "doc.txt")], out, 200),
        "unknown builtin": lambda: prepare(["builtin:nope"], out, VOCAB),
        "parquet without the column": lambda: prepare([str(tmp_path / "no_text.parquet")], out, VOCAB),
        "output inside a source directory": lambda: prepare([str(tmp_path)], tmp_path / "data", VOCAB),
        # (refused the first time, as a directory is: the next run's glob would read the output)
        "output inside a glob's folder": lambda: prepare([str(tmp_path / "**")], tmp_path / "data", VOCAB),
        "max_bytes below the first document": lambda: prepare([str(tmp_path / "doc.txt")], out, VOCAB, max_bytes=10),
        "output among a user's files": lambda: prepare([str(tmp_path / "doc.txt")], tmp_path / "mine", VOCAB),
        "a user's folder named as prepare's work": lambda: prepare([str(tmp_path / "doc.txt")], tmp_path / "theirs",
                                                                   VOCAB),
    }
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "theirs" / "work").mkdir(parents=True)  # (not prepare's: no key; cleared, it would be lost)
    (tmp_path / "theirs" / "work" / "notes.txt").write_text("mine")
    (tmp_path / "theirs" / ".DS_Store").write_text("")  # (not counted)
    with pytest.raises(DataError) as error:
        calls[case]()
    for word in words:
        assert word in str(error.value)


def test_a_given_tokenizer_tokenizes_identically(tmp_path):
    write_corpus(tmp_path / "corpus")
    first, second = tmp_path / "first", tmp_path / "second"
    prepare([str(tmp_path / "corpus")], first, VOCAB)
    result = prepare([str(tmp_path / "corpus")], second, 12345, tokenizer=first / "tokenizer.json")
    assert not result.stats["tokenizer"]["trained"]
    assert read_index(second) == read_index(first)
    for split in ("train", "val"):
        a, b = open_split(first, split), open_split(second, split)
        assert np.array_equal(a.read(0, a.tokens), b.read(0, b.tokens))
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_a_tokenizer_that_is_not_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "data", VOCAB, tokenizer=tmp_path / "tokenizer.json")


def test_builtin_python_stdlib_prepares_within_max_bytes(tmp_path):
    result = prepare(["builtin:python-stdlib"], tmp_path / "data", 512, max_bytes=300_000)
    stats = result.stats
    assert 0 < stats["bytes"]["kept"] <= 300_000
    assert stats["documents"]["train"] > 0 and stats["documents"]["val"] >= 1
    assert stats["files"]["read"] < stats["files"]["listed"]
    assert open_split(tmp_path / "data", "train").tokens == stats["tokens"]["train"]


def test_builtin_python_packages_reads_the_installed_packages(tmp_path):
    result = prepare(["builtin:python-packages"], tmp_path / "data", 512, max_bytes=300_000, workers=1)
    assert 0 < result.stats["bytes"]["kept"] <= 300_000 and result.stats["documents"]["train"] > 0
    assert result.stats["files"]["listed"] > 1000  # numpy and torch alone have thousands of modules


def test_max_bytes_keeps_whole_documents_in_order_up_to_the_limit(tmp_path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " + "x" * 89)  # 100 bytes each
    result = prepare([str(tmp_path / "*.txt")], tmp_path / "data", VOCAB, max_bytes=450, val_fraction=0)
    assert result.stats["bytes"]["kept"] == 400
    assert [d[:10] for d in decoded_documents(tmp_path / "data", "train")] == [f"document {i}" for i in range(4)]


def test_token_bytes_are_the_utf8_bytes_each_token_stands_for(stdlib_data):
    """Bits per byte (train/trainer.py's evaluate) divides by these: the bytes of any text's
    tokens add up to its UTF-8 length, the end of a document holds none, and a tokenizer that is
    not byte-level gets none."""
    from tokenizers import models, pre_tokenizers

    from scaletrain.data.tokenizer import load_tokenizer, token_bytes

    tokenizer = load_tokenizer(stdlib_data)
    counts = token_bytes(tokenizer, 576)  # (the model's vocabulary, rounded up past the tokenizer's)
    text = "def naïve(x):\n    return '日本語 — café' * x  # ünïcode\n"
    assert counts[tokenizer.encode(text, add_special_tokens=False).ids].sum() == len(text.encode())
    assert counts[tokenizer.token_to_id("<|endoftext|>")] == 0 and counts[512:].sum() == 0
    assert counts[:512].min() == 0 and (counts[:512] > 0).sum() == 511
    # Added tokens that are not special (Qwen's "<tool_call>", a run of newlines) are matched as
    # their text, and stand for its bytes.
    from tokenizers import AddedToken
    tokenizer.add_tokens([AddedToken("<h1>", special=False, normalized=False),
                          AddedToken("\n\n", special=False, normalized=False)])
    counts = token_bytes(tokenizer, 576)
    text = "<h1>Título</h1>\n\nbody"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<h1>") in ids and counts[ids].sum() == len(text.encode())
    words = Tokenizer(models.WordLevel({"the": 0, "cat": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert token_bytes(words, 3) is None  # (no byte-level alphabet, no SentencePiece spaces: nothing to count)


def test_token_bytes_of_a_sentencepiece_style_tokenizer_count_its_spaces_and_byte_pieces():
    """Llama 2's / Mistral's kind: "▁" for a space, unknown characters as "<0xNN>" byte pieces. A
    text's pieces add up to its UTF-8 length plus the one space the tokenizer prepends."""
    from tokenizers import decoders, models, normalizers

    from scaletrain.data.tokenizer import token_bytes

    text = "the cat sat on the mat — naïve 日本"
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              *sorted(set("the cat sat on mat".replace(" ", "▁"))), "▁t", "▁th", "▁the", "at", "▁c", "▁cat"]
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("a", "t"), ("▁", "c"), ("▁c", "at")]
    tokenizer = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, merges, byte_fallback=True,
                                     unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text and tokenizer.token_to_id("▁cat") in ids
    assert any(tokenizer.id_to_token(i).startswith("<0x") for i in ids)  # (ï, 日, 本 and — fell back to bytes)
    counts = token_bytes(tokenizer, 300)
    assert counts[ids].sum() == len(text.encode()) + 1
    assert counts[tokenizer.token_to_id("</s>")] == 0 and counts[tokenizer.token_to_id("<0x0A>")] == 1


def test_a_vocabulary_larger_than_the_text_can_fill_is_the_tokenizers(tmp_path):
    """The data's vocabulary is what the tokenizer learned, not what was asked: a model built on it
    gets no embedding rows that no token can reach."""
    write_corpus(tmp_path / "corpus")
    result = prepare([str(tmp_path / "corpus")], tmp_path / "data", 5000)
    learned = Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json")).get_vocab_size()
    assert learned < 5000 and read_index(tmp_path / "data")["vocab_size"] == learned
    assert any(f"learned {learned:,} of the 5,000 ids asked for" in warning and f"vocabulary is {learned:,}" in warning
               for warning in result.warnings)
