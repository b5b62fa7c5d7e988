"""`scaletrain export`: a trained run as a Hugging Face model directory, loaded by transformers itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import run_cli, tiny_config
from scaletrain.data.tokenizer import load_tokenizer
from scaletrain.errors import UserError
from scaletrain.export import export_hf, hf_name
from scaletrain.generate import load_model
from scaletrain.model.sample import generate
from scaletrain.train.trainer import train

transformers = pytest.importorskip("transformers", reason="the interop tests need transformers (pip install -e '.[test]')")

# Real text with the end-of-text token's spelling inside it: written in a document it is text, not an end.
TEXT = 'import os\n\ndef main(argv):\n    return "<|endoftext|>" if argv else os.sep\n'


@pytest.fixture(scope="module")
def runs(stdlib_data, tmp_path_factory):
    """Two trained runs: Llama (GQA, untied) and Qwen3 (QK-norm, tied embeddings), each with
    checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("runs")
    common = ["train.steps=6", "checkpoint.interval=3", "eval.interval=3", "model.rope_theta=500.0",
              "model.norm_eps=1e-6"]
    train(tiny_config(stdlib_data, root / "llama", *common))
    train(tiny_config(stdlib_data, root / "qwen3", *common, "model.qk_norm=true", "model.tie_embeddings=true",
                      "model.n_kv_heads=4"))
    return root


@pytest.mark.parametrize("name, architecture", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_transformers_loads_the_export_and_computes_the_same_logits_and_text(runs, tmp_path, name, architecture):
    run_dir = runs / name
    exported = export_hf(run_dir, tmp_path / "hf")
    assert (exported.step, exported.architecture) == (6, architecture)
    ours, cfg, _ = load_model(run_dir)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = load_tokenizer(run_dir / "tokenizer.json").encode(TEXT, add_special_tokens=False).ids
    assert tokenizer(TEXT)["input_ids"] == ids  # the end-of-text spelling in the text stays text
    assert tokenizer.decode(ids) == TEXT

    tokens = torch.tensor([ids[:48], ids[-48:]])
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
        expected = generate(ours, tokens[:1, :8], 24, temperature=0)
        got = hf.generate(tokens[:1, :8], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got[0, 8:].tolist() == expected[0].tolist()

    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"{cfg.run.name}" in card and "step 6" in card and "validation loss at step 6" in card


def test_a_chosen_step_in_bfloat16_and_in_shards_loads_as_one_model(runs, tmp_path):
    run_dir = runs / "llama"
    (tmp_path / "hf").mkdir()  # an empty directory is a destination too
    exported = export_hf(run_dir, tmp_path / "hf", dtype="bfloat16", step=3, max_shard_bytes=40_000)
    assert exported.step == 3
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "hf" / "model.safetensors").exists()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == exported.bytes
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["rope_parameters"]["rope_theta"] == 500.0

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ours, _, step = load_model(run_dir, step=3)
    assert step == 3 and hf.dtype == torch.bfloat16
    for name, param in ours.state_dict().items():  # every tensor, rounded to bfloat16 once
        hf_param = hf.get_parameter(hf_name(name))
        assert torch.equal(hf_param, param.to(torch.bfloat16)), name


def test_bad_exports_are_refused_in_one_sentence_and_write_nothing(runs, tmp_path):
    run_dir = runs / "llama"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    cases = [
        (dict(run_dir=run_dir, out=taken), "already exists and is not an empty directory"),
        (dict(run_dir=run_dir, out=tmp_path / "a", step=4), "no checkpoint of step 4; it has steps: 6, 3"),
        (dict(run_dir=run_dir, out=tmp_path / "b", dtype="int8"), "is not one of float32, bfloat16, float16"),
        (dict(run_dir=tmp_path, out=tmp_path / "c"), "is not a run directory"),
    ]
    for kwargs, words in cases:
        with pytest.raises(UserError, match=words.replace("(", r"\(")):
            export_hf(**kwargs)
    assert (taken / "mine.txt").read_text() == "keep me" and [p.name for p in taken.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no partial export left behind

    result = run_cli("export", str(run_dir), "--out", str(taken))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "already exists" in result.stderr
    result = run_cli("export", str(run_dir), "--out", str(tmp_path / "hf"), "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    assert "LlamaForCausalLM from step 6" in result.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_damaged_newest_checkpoint_is_passed_over_and_a_damaged_chosen_one_refused(runs, tmp_path):
    run_dir = tmp_path / "llama"
    shutil.copytree(runs / "llama", run_dir)
    newest = run_dir / "checkpoints" / "step_0000006"
    damaged = next(newest.glob("*.distcp"))
    damaged.write_bytes(bytes(len(damaged.read_bytes())))  # same size, other bytes: only the checksum tells
    assert export_hf(run_dir, tmp_path / "hf").step == 3
    with pytest.raises(UserError, match="step_0000006 is not usable: file .* does not match the checksum"):
        export_hf(run_dir, tmp_path / "hf6", step=6)
    assert not (tmp_path / "hf6").exists()
