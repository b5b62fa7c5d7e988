"""Fill-in-the-middle (data prepare --fim-rate; Bavarian et al. 2022): training documents cut
at two characters and written prefix, suffix, middle between sentinel tokens, in PSM or SPM
order, the rest of the data as it would be without; and a model trained on them asked to infill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from conftest import tiny_config
from scaletrain.data import prepare
from scaletrain.data.shards import DataError, document_offsets, open_split, read_index
from scaletrain.data.tokenizer import FIM_TOKENS, fim_ids, load_tokenizer
from scaletrain.generate import GenerateError, generate_text
from scaletrain.train.trainer import train

CORPUS = dict(vocab_size=512, max_bytes=150_000, val_fraction=0.05, workers=1)


def documents(data_dir: Path, split: str) -> list[list[int]]:
    tokens = open_split(data_dir, split)
    out = []
    for shard, memmap in zip(read_index(data_dir)["splits"][split]["shards"], tokens.shards):
        offsets = document_offsets(data_dir, shard)
        out += [memmap[a:b - 1].tolist() for a, b in zip(offsets, offsets[1:])]  # (without the end)
    return out


@pytest.fixture(scope="module")
def fim_data(tmp_path_factory) -> tuple[Path, Path]:
    """The same text prepared without and with every training document rearranged (half in SPM order)."""
    root = tmp_path_factory.mktemp("fim")
    prepare(["builtin:python-stdlib"], root / "plain", **CORPUS)
    prepare(["builtin:python-stdlib"], root / "fim", **CORPUS, fim_rate=1.0, fim_spm_rate=0.5)
    return root / "plain", root / "fim"


def test_every_training_document_is_its_text_cut_in_three_and_rearranged_between_sentinels(fim_data):
    plain_dir, fim_dir = fim_data
    tok = load_tokenizer(fim_dir)
    pre, suf, mid = fim_ids(tok)
    assert [tok.id_to_token(i) for i in (pre, suf, mid)] == list(FIM_TOKENS[0])  # (the tokenizer prepare trained)
    assert fim_ids(load_tokenizer(plain_dir)) is None  # (none without --fim-rate)
    plain = load_tokenizer(plain_dir)
    texts = [plain.decode(ids) for ids in documents(plain_dir, "train")]
    rearranged = documents(fim_dir, "train")
    assert len(rearranged) == len(texts) > 5
    orders = []
    for ids, text in zip(rearranged, texts):
        assert [ids.count(s) for s in (pre, suf, mid)] == [1, 1, 1]
        if ids[1] == suf:  # SPM: <prefix> <suffix> suffix <middle> prefix middle
            orders.append("spm")
            suffix, rest = ids[2:ids.index(mid)], ids[ids.index(mid) + 1:]
            assert tok.decode(rest) + tok.decode(suffix) == text
        else:  # PSM: <prefix> prefix <suffix> suffix <middle> middle
            orders.append("psm")
            assert ids[0] == pre
            prefix, suffix = ids[1:ids.index(suf)], ids[ids.index(suf) + 1:ids.index(mid)]
            middle = ids[ids.index(mid) + 1:]
            assert tok.decode(prefix) + tok.decode(middle) + tok.decode(suffix) == text
    assert {"psm", "spm"} == set(orders)
    # The validation split stays in order: a plain language model's loss.
    assert [tok.decode(ids) for ids in documents(fim_dir, "val")] == \
        [plain.decode(ids) for ids in documents(plain_dir, "val")]
    stats = json.loads((fim_dir / "stats.json").read_text())
    assert stats["fim"] == {"rate": 1.0, "spm_rate": 0.5, "documents": len(texts)}


def test_a_share_of_documents_is_rearranged_and_a_given_tokenizer_needs_the_sentinels(fim_data, tmp_path):
    plain_dir, _ = fim_data
    # Half the documents, by a hash of (seed, text): the same draw again in chunks of another size.
    prepare(["builtin:python-stdlib"], tmp_path / "half", **CORPUS, fim_rate=0.5)
    pre = fim_ids(load_tokenizer(tmp_path / "half"))[0]
    train_docs = documents(tmp_path / "half", "train")
    share = sum(pre in ids for ids in train_docs) / len(train_docs)
    assert 0.2 < share < 0.8, share
    prepare(["builtin:python-stdlib"], tmp_path / "chunked", **CORPUS, fim_rate=0.5, chunk_bytes=20_000)
    assert documents(tmp_path / "chunked", "train") == train_docs
    with pytest.raises(DataError, match="has no fill-in-the-middle tokens .*<fim_prefix>.*give one that has them"):
        prepare(["builtin:python-stdlib"], tmp_path / "given", **CORPUS, tokenizer=plain_dir, fim_rate=0.5)
    with pytest.raises(DataError, match="fim_rate 1.5 is not a share: give one between 0 and 1"):
        prepare(["builtin:python-stdlib"], tmp_path / "bad", **CORPUS, fim_rate=1.5)
    with pytest.raises(DataError, match="vocab_size 257 is too small .* at least 260 .* fill-in-the-middle tokens"):
        prepare(["builtin:python-stdlib"], tmp_path / "bad", **{**CORPUS, "vocab_size": 257}, fim_rate=0.5)
    # Qwen2.5's tokenizer adds its sentinels as ordinary added tokens, which any text would produce:
    # loaded, they are special, and a document's literal "<|fim_prefix|>" stays text.
    qwen = Tokenizer.from_file(str(plain_dir / "tokenizer.json"))
    qwen.add_tokens(list(FIM_TOKENS[0]))
    qwen.save(str(tmp_path / "qwen.json"))
    loaded = load_tokenizer(tmp_path / "qwen.json")
    sentinels = fim_ids(loaded)
    assert sentinels is not None and not set(sentinels) & set(loaded.encode("x <|fim_prefix|> y").ids)
    # A code model's tokenizer (StarCoder's names): accepted, its sentinels used.
    starcoder = Tokenizer.from_file(str(plain_dir / "tokenizer.json"))
    starcoder.add_special_tokens(list(FIM_TOKENS[1]))
    starcoder.save(str(tmp_path / "starcoder.json"))
    prepare(["builtin:python-stdlib"], tmp_path / "given", **CORPUS, tokenizer=tmp_path / "starcoder.json",
            fim_rate=1.0)
    ids = fim_ids(load_tokenizer(tmp_path / "starcoder.json"))
    assert all(doc[0] == ids[0] for doc in documents(tmp_path / "given", "train"))


def test_a_model_trained_on_rearranged_documents_fills_in_the_middle(fim_data, tmp_path, caplog):
    plain_dir, fim_dir = fim_data
    run = tmp_path / "run"
    train(tiny_config(fim_dir, run, "train.steps=2", "eval.interval=0"))
    texts = generate_text(run, "def f(x):\n", suffix="\n    return y\n", max_new_tokens=8, temperature=1.0,
                          samples=2)
    assert all(t.startswith("def f(x):\n") and t.endswith("\n    return y\n") for t in texts)
    assert "the middle was cut at 8 new tokens, before the model ended it" in caplog.text  # (2 steps: no end yet)
    # Exported, its tokenizer takes the sentinels written in a prompt's text, as infilling clients write them.
    from scaletrain.hf import export_hf
    export_hf(run, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["split_special_tokens"] is False
    plain_run = tmp_path / "plain"
    train(tiny_config(plain_dir, plain_run, "train.steps=1", "eval.interval=0"))
    with pytest.raises(GenerateError, match="tokenizer has no fill-in-the-middle tokens, so its model never learned "
                                            "to infill; train on data prepared with --fim-rate"):
        generate_text(plain_run, "def f(x):\n", suffix="\n    return y\n")
