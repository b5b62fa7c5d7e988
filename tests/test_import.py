"""`scaletrain data import`: token data other frameworks wrote, read into a data directory —
Megatron-LM's indexed datasets (written by megatron-core's own builder), nanoGPT's flat .bin
and NumPy files — holding the very documents, and training the very losses, of the data they came from."""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import bos_tokenizer, run_cli, tiny_config
from scaletrain.data import importer
from scaletrain.data.importer import import_tokens
from scaletrain.data.shards import DataError, document_offsets, open_split, read_index
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train


def documents(data_dir: Path, split: str = "train") -> list[np.ndarray]:
    """A split's documents, each with its end-of-document token."""
    tokens = open_split(data_dir, split)
    out = []
    for shard, memmap in zip(read_index(data_dir)["splits"][split]["shards"], tokens.shards):
        offsets = document_offsets(data_dir, shard)
        out += [np.asarray(memmap[a:b], dtype=np.int64) for a, b in zip(offsets, offsets[1:])]
    return out


def megatron_dataset(prefix: Path, docs: list[np.ndarray], dtype, append_eod: bool, eos: int) -> None:
    """docs written by megatron-core's IndexedDatasetBuilder, as preprocess_data.py writes them
    (with --append-eod: each ending with the end-of-document token; without: not), each document
    cut into two sequences (as --split-sentences cuts one into sentences)."""
    import torch
    with warnings.catch_warnings():
        # (its import says it found no Transformer Engine or Apex; numpy 2 warns of its array conversion)
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
        for doc in docs:
            body = doc[:-1] if doc[-1] == eos and not append_eod else doc
            half = len(body) // 2
            builder.add_document(torch.from_numpy(body.astype(np.int64)), [half, len(body) - half])
        builder.finalize(f"{prefix}.idx")


def test_megatron_datasets_and_flat_token_files_import_as_the_documents_they_hold(stdlib_data, tmp_path, monkeypatch):
    monkeypatch.setattr(importer, "BLOCK_TOKENS", 1000)  # (read and written in many blocks, as a large corpus is)
    originals = documents(stdlib_data)
    eos = read_index(stdlib_data)["eos_id"]
    tokenizer = stdlib_data / "tokenizer.json"
    # Megatron-LM's, in its default int32 and in uint16, with and without the end-of-document token:
    # the same documents, each ended once, in order; none held out.
    for dtype, append_eod in ((np.int32, True), (np.uint16, False)):
        prefix = tmp_path / f"megatron-{np.dtype(dtype).name}" / "corpus_text_document"
        prefix.parent.mkdir()
        megatron_dataset(prefix, originals, dtype, append_eod, eos)
        out = tmp_path / f"imported-{np.dtype(dtype).name}"
        result = import_tokens([str(prefix)], out, tokenizer, val_fraction=0)
        got = documents(out)
        assert len(got) == len(originals) and all(np.array_equal(a, b) for a, b in zip(got, originals))
        assert result.stats["imported"] == [{"path": str(prefix), "format": "megatron", "dtype": np.dtype(dtype).name,
                                             "documents": len(originals)}]
        assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes() and "bos_id" not in read_index(out)
    # nanoGPT's train.bin (raw uint16, each document ended) and a NumPy .npy of uint32: the same.
    flat = np.concatenate(originals)
    flat.astype(np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "tokens.npy", flat.astype(np.uint32))
    for name in ("train.bin", "tokens.npy"):
        out = tmp_path / f"imported-{name}"
        import_tokens([str(tmp_path / name)], out, tokenizer, val_fraction=0)
        assert all(np.array_equal(a, b) for a, b in zip(documents(out), originals, strict=True))
    # Hugging Face datasets' tokenized Parquet (input_ids beside attention_mask), ended or not: the same.
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [d[:-1] if i % 2 else d for i, d in enumerate(originals)]
    pq.write_table(pa.table({"input_ids": [r.tolist() for r in rows], "attention_mask": [[1] * len(r) for r in rows]}),
                   tmp_path / "tokenized.parquet", row_group_size=7)
    result = import_tokens([str(tmp_path / "tokenized.parquet")], tmp_path / "imported-parquet", tokenizer,
                           val_fraction=0)
    assert all(np.array_equal(a, b) for a, b in zip(documents(tmp_path / "imported-parquet"), originals, strict=True))
    assert result.stats["imported"][0]["format"] == "parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6], None, [7], None]}), tmp_path / "holes.parquet", row_group_size=2)
    with pytest.raises(DataError, match="'input_ids' has 2 null value.s., rows or token ids in them; fill or drop them"):
        import_tokens([str(tmp_path / "holes.parquet")], tmp_path / "holes", tokenizer)
    pq.write_table(pa.table({"input_ids": [[5, None, 6], [7]]}), tmp_path / "inside.parquet")  # (a null id in a row)
    with pytest.raises(DataError, match="'input_ids' has 1 null value.s., rows or token ids in them"):
        import_tokens([str(tmp_path / "inside.parquet")], tmp_path / "holes", tokenizer)
    assert not (tmp_path / "holes" / "work").exists()  # (the copy made on the way: gone)
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "text.parquet")
    for column, words in (("input_ids", r"has no column 'input_ids' \(it has text\); give the column of token ids"),
                          ("text", "holds string, not lists of token ids")):
        with pytest.raises(DataError, match=words):
            import_tokens([str(tmp_path / "text.parquet")], tmp_path / "text", tokenizer, column=column)
    # Several sources, a share held out: every document in one split or the other, in order, the
    # draw the seed's (the same again; another seed, another draw).
    out = tmp_path / "split"
    result = import_tokens([str(tmp_path / "train.bin"), str(tmp_path / "megatron-int32" / "corpus_text_document")],
                           out, tokenizer, val_fraction=0.2, seed=3)
    train_docs, val_docs = documents(out), documents(out, "val")
    assert len(train_docs) + len(val_docs) == 2 * len(originals) and 0 < len(val_docs) < len(originals)
    both = sorted(map(tuple, train_docs + val_docs))
    assert both == sorted(map(tuple, originals + originals))
    assert result.stats["documents"] == {"read": 2 * len(originals), "kept": 2 * len(originals),
                                         "dropped": {"empty": 0}, "train": len(train_docs), "val": len(val_docs)}
    again = import_tokens([str(tmp_path / "train.bin"), str(tmp_path / "megatron-int32" / "corpus_text_document")],
                          out, tokenizer, val_fraction=0.2, seed=3)
    assert again.reused
    held = {}
    for seed in (3, 4):
        import_tokens([str(tmp_path / "train.bin")], tmp_path / f"seed{seed}", tokenizer, val_fraction=0.2, seed=seed)
        held[seed] = [tuple(d) for d in documents(tmp_path / f"seed{seed}", "val")]
    assert held[3] == [tuple(d) for d in val_docs[:len(held[3])]] and held[3] != held[4]


def test_training_on_imported_tokens_gives_the_losses_of_the_data_they_came_from(stdlib_data, tmp_path):
    """The training split written out as nanoGPT writes train.bin and imported (the original
    validation split's shards copied in beside it): a run trains and evaluates the same losses."""
    eos = read_index(stdlib_data)["eos_id"]
    tokenizer = stdlib_data / "tokenizer.json"
    np.concatenate(documents(stdlib_data)).astype(np.uint16).tofile(tmp_path / "train.bin")
    imported = tmp_path / "imported"
    import_tokens([str(tmp_path / "train.bin")], imported, tokenizer, val_fraction=0)
    # (the validation split as the original's: its shards copied in, as import writes them)
    index = read_index(imported)
    original = read_index(stdlib_data)
    for shard in original["splits"]["val"]["shards"]:
        for key in ("path", "docs"):
            shutil.copyfile(stdlib_data / shard[key], imported / shard[key])
    index["splits"]["val"] = original["splits"]["val"]
    (imported / "index.json").write_text(json.dumps(index))
    assert index["eos_id"] == eos
    losses = {}
    for name, data in (("original", stdlib_data), ("imported", imported)):
        run = tmp_path / f"run-{name}"
        train(tiny_config(data, run, "train.steps=3", "eval.interval=3"))
        losses[name] = ([r["loss"] for r in read_metrics(run, "train")], [r["loss"] for r in read_metrics(run, "eval")])
    assert losses["imported"] == losses["original"]


def test_documents_that_begin_with_the_tokenizers_beginning_of_sequence_token_are_recorded_so(stdlib_data, tmp_path):
    """Tokens made with a Llama-style tokenizer (its post-processor begins every text with its
    beginning-of-sequence token): index.json says so, as data prepare's does, for tasks and prompts."""
    tokenizer, bos = bos_tokenizer(stdlib_data, tmp_path / "bos.json")
    docs = [np.concatenate([[bos], d]) for d in documents(stdlib_data)[:20]]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "with.bin")
    np.concatenate(documents(stdlib_data)[:20]).astype(np.uint16).tofile(tmp_path / "without.bin")
    import_tokens([str(tmp_path / "with.bin")], tmp_path / "with", tokenizer, val_fraction=0)
    import_tokens([str(tmp_path / "without.bin")], tmp_path / "without", tokenizer, val_fraction=0)
    assert read_index(tmp_path / "with")["bos_id"] == bos and "bos_id" not in read_index(tmp_path / "without")


def test_token_data_that_cannot_be_imported_is_refused_in_a_sentence(stdlib_data, tmp_path):
    tokenizer = stdlib_data / "tokenizer.json"
    flat = np.concatenate(documents(stdlib_data))
    flat.astype(np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "fake.idx").write_bytes(b"not an index at all, no" * 3)
    (tmp_path / "fake.bin").write_bytes(b"\x00\x00")
    (tmp_path / "newer.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 2, 4, 0, 0))
    (tmp_path / "newer.bin").write_bytes(b"")
    beyond = flat.astype(np.uint16)
    beyond[5] = 4000  # (the tokenizer has 512 ids)
    beyond.tofile(tmp_path / "other.bin")
    prefix = tmp_path / "cut" / "data"
    prefix.parent.mkdir()
    megatron_dataset(prefix, documents(stdlib_data)[:10], np.uint16, True, read_index(stdlib_data)["eos_id"])
    Path(f"{prefix}.idx").write_bytes(Path(f"{prefix}.idx").read_bytes()[:60])
    # A pair that was not written together (a stale .idx beside a new .bin), or a .bin grown since.
    stale, grown, other = (tmp_path / name / "data" for name in ("stale", "grown", "other"))
    for where, docs in ((stale, documents(stdlib_data)[:10]), (grown, documents(stdlib_data)[:10]),
                        (other, documents(stdlib_data)[10:19])):
        where.parent.mkdir()
        megatron_dataset(where, docs, np.uint16, True, read_index(stdlib_data)["eos_id"])
    Path(f"{stale}.bin").write_bytes(Path(f"{other}.bin").read_bytes())
    Path(f"{grown}.bin").write_bytes(Path(f"{grown}.bin").read_bytes() + b"\x05\x00\x06\x00")
    cases = [
        ([str(stale)], {}, r"laid end to end, are not the [\d,]+ tokens data.bin holds; give the .bin and .idx that "
                           "Megatron-LM's preprocess_data.py wrote together"),
        ([str(grown)], {}, r"are not the [\d,]+ tokens data.bin holds"),
        ([str(tmp_path / "other.bin")], {}, "holds token id 4000, not one of the 512 ids of .* give the tokenizer "
                                            r"the data was made with \(or, for a raw file, the --dtype it was written in\)"),
        ([str(tmp_path / "cut")], {}, "is a directory; give a file of tokens"),
        ([str(tmp_path / "train.bin")], {"out": tmp_path / "cut"}, r"holds other files \(data.bin, data.idx\); give "
                                                                   "a new or empty directory to import the data into"),
        ([str(tmp_path / "train.bin")], {"column": "ids"}, "--column names a Parquet file's column of token ids, "
                                                           "and no source is a Parquet file: drop it"),
        ([str(tmp_path / "train.bin")], {"out": tmp_path / "cut" / "data.bin"}, "is a file"),
        ([str(tmp_path / "odd.bin")], {}, "is 3 bytes, not a whole number of uint16 tokens; give its --dtype"),
        ([str(tmp_path / "fake")], {}, "is not a Megatron indexed dataset's index .it does not begin with MMIDIDX."),
        ([str(tmp_path / "newer")], {}, "is version 2 with dtype code 4, where this reads version 1 with integer tokens"),
        ([str(prefix)], {}, "shorter than the .* its counts need .cut short.."),
        ([str(prefix)], {"dtype": "uint32"}, "a Megatron dataset's index names its own: drop it"),
        ([str(tmp_path / "missing.bin")], {}, "does not exist; give a file of tokens"),
        ([str(tmp_path / "train.bin")], {"eos": 9999}, "--eos-id 9999 is not one of the tokenizer's 512 ids"),
        ([str(tmp_path / "train.bin")], {"val_fraction": 1.0}, r"validation fraction must be in \[0, 1\)"),
    ]
    for sources, options, words in cases:
        with pytest.raises(DataError, match=words):
            import_tokens(sources, options.pop("out", tmp_path / "out"), tokenizer, **options)
        assert not (tmp_path / "out" / "index.json").exists()
    import_tokens([str(tmp_path / "train.bin")], tmp_path / "out", tokenizer)
    with pytest.raises(DataError, match="holds a data directory already .or an unfinished prepare or import of another one.; give "
                                        "another output directory, or --overwrite"):
        import_tokens([str(tmp_path / "train.bin")], tmp_path / "out", tokenizer, seed=1)
    import_tokens([str(tmp_path / "train.bin")], tmp_path / "out", tokenizer, seed=1, overwrite=True)
    train(tiny_config(stdlib_data, tmp_path / "run", "train.steps=1", "eval.interval=0"))
    with pytest.raises(DataError, match="is a run directory; give a new directory to import the data into"):
        import_tokens([str(tmp_path / "train.bin")], tmp_path / "run", tokenizer)
    # The command: a table of what it read, or the refusal's one line (status 2).
    result = run_cli("data", "import", str(tmp_path / "train.bin"), "--out", str(tmp_path / "cli"),
                     "--tokenizer", str(tokenizer))
    assert result.returncode == 0 and "documents kept / read" in result.stdout, result.stderr
    refused = run_cli("data", "import", str(tmp_path / "odd.bin"), "--out", str(tmp_path / "cli2"),
                      "--tokenizer", str(tokenizer))
    assert refused.returncode == 2 and "not a whole number of uint16 tokens" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_an_import_splits_small_corpora_resumes_when_interrupted_and_copies_long_documents_in_slices(
        stdlib_data, tmp_path, monkeypatch):
    tokenizer = stdlib_data / "tokenizer.json"
    eos = read_index(stdlib_data)["eos_id"]
    originals = documents(stdlib_data)
    # Ten documents at the default 0.5%: one is still held out (train needs a validation split),
    # and empty documents (an end token after an end token, three here) are dropped and counted.
    np.concatenate([[eos], originals[0], [eos, eos], *originals[1:10]]).astype(np.uint16).tofile(tmp_path / "ten.bin")
    result = import_tokens([str(tmp_path / "ten.bin")], tmp_path / "ten", tokenizer)
    assert result.stats["documents"] == {
        "read": 13, "kept": 10, "dropped": {"empty": 3}, "train": 9, "val": 1}
    assert sorted(map(tuple, documents(tmp_path / "ten") + documents(tmp_path / "ten", "val"))) == \
        sorted(map(tuple, originals[:10]))
    # The document held out is one that holds something, where the last ones read are empty.
    np.concatenate([originals[0], originals[1], [eos, eos]]).astype(np.uint16).tofile(tmp_path / "trailing.bin")
    result = import_tokens([str(tmp_path / "trailing.bin")], tmp_path / "trailing", tokenizer)
    assert [d.tolist() for d in documents(tmp_path / "trailing", "val")] == [originals[1].tolist()]
    assert result.stats["documents"] == {"read": 4, "kept": 2, "dropped": {"empty": 2}, "train": 1, "val": 1}
    # uint32 tokens read as uint16 would pass every id check: refused, and read as --dtype says.
    np.concatenate(originals[:10]).astype(np.uint32).tofile(tmp_path / "wide.bin")
    with pytest.raises(DataError, match="has a 0 at every other position: it holds uint32 .* give --dtype uint32"):
        import_tokens([str(tmp_path / "wide.bin")], tmp_path / "wide", tokenizer)
    import_tokens([str(tmp_path / "wide.bin")], tmp_path / "wide", tokenizer, dtype="uint32", val_fraction=0)
    assert all(np.array_equal(a, b) for a, b in zip(documents(tmp_path / "wide"), originals[:10], strict=True))
    # One document with no end in it (a wrong --eos-id, say): copied a slice at a time, with a warning.
    monkeypatch.setattr(importer, "BLOCK_TOKENS", 1000)
    body = np.concatenate([d[:-1] for d in originals[:20]])
    body.astype(np.uint16).tofile(tmp_path / "long.bin")
    result = import_tokens([str(tmp_path / "long.bin")], tmp_path / "long", tokenizer)
    assert [d.tolist() for d in documents(tmp_path / "long")] == [[*body.tolist(), eos]]
    assert any(f"is one document of {len(body):,} tokens" in w for w in result.warnings)
    assert any("the validation split is empty (a single document)" in w for w in result.warnings)
    # Interrupted (here as index.json is written): unfinished, which train refuses, and the same
    # command run again finishes it without --overwrite; an unfinished prepare is not taken over.
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(importer, "write_index", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_tokens([str(tmp_path / "ten.bin")], tmp_path / "cut", tokenizer)
    with pytest.raises(DataError, match="holds a prepare or import that did not finish"):
        read_index(tmp_path / "cut")
    monkeypatch.undo()
    assert not import_tokens([str(tmp_path / "ten.bin")], tmp_path / "cut", tokenizer).reused
    assert import_tokens([str(tmp_path / "ten.bin")], tmp_path / "cut", tokenizer).reused
    (tmp_path / "preparing" / "work").mkdir(parents=True)
    (tmp_path / "preparing" / "work" / "key").write_text("a prepare's key")
    with pytest.raises(DataError, match="holds a data directory already .or an unfinished prepare or import of another one."):
        import_tokens([str(tmp_path / "ten.bin")], tmp_path / "preparing", tokenizer)
    # data prepare into an import's directory: refused, saying what it holds.
    from scaletrain.data import prepare
    with pytest.raises(DataError, match="holds a finished prepare of other sources or options .tokens `data import` "
                                        "wrote"):
        prepare(["builtin:python-stdlib"], tmp_path / "ten", 512, max_bytes=50_000, workers=1)
    # ... or into another one's unfinished work: refused too, that work kept.
    with pytest.raises(DataError, match="holds the unfinished work of a prepare or import of other sources or options; "
                                        "run that command again to finish it, .* or --overwrite to discard it"):
        prepare(["builtin:python-stdlib"], tmp_path / "preparing", 512, max_bytes=50_000, workers=1)
    assert (tmp_path / "preparing" / "work" / "key").read_text() == "a prepare's key"
