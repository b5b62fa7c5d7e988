"""Hugging Face interop: `scaletrain export` loaded by transformers itself, and runs started from
Hugging Face models (checkpoint.init_from), compared with transformers' own forward."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil

import pytest
import torch
from tokenizers import Tokenizer

from conftest import run_cli, tiny_config
from scaletrain.data.tokenizer import load_tokenizer
from scaletrain.errors import UserError
from scaletrain.hf import export_hf, hf_name
from scaletrain.generate import load_model
from scaletrain.model.sample import generate
from scaletrain.train.trainer import train

transformers = pytest.importorskip("transformers", reason="the interop tests need transformers (pip install -e '.[test]')")

# Real text with the end-of-text token's spelling inside it: written in a document it is text, not an end.
TEXT = 'import os\n\ndef main(argv):\n    return "<|endoftext|>" if argv else os.sep\n'


@pytest.fixture(scope="module")
def runs(stdlib_data, tmp_path_factory):
    """Three trained runs: Llama (GQA, untied, muP), Qwen3 (QK-norm, tied embeddings) and Mistral
    (a sliding window), each with checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("runs")
    common = ["train.steps=6", "checkpoint.interval=3", "eval.interval=3", "model.rope_theta=500.0",
              "model.norm_eps=1e-6"]
    train(tiny_config(stdlib_data, root / "llama", *common, "model.mup_base_dim=32"))  # (plain weights after all)
    train(tiny_config(stdlib_data, root / "qwen3", *common, "model.qk_norm=true", "model.tie_embeddings=true",
                      "model.n_kv_heads=4"))
    # (a window of 8 tokens: the logits of 48 and the 24 tokens generated after 8 attend through it)
    train(tiny_config(stdlib_data, root / "mistral", *common, "model.sliding_window=8"))
    return root


@pytest.mark.parametrize("name, architecture", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                                ("mistral", "MistralForCausalLM")])
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
    assert ("trained under muP, base width | 32" in card) == (name == "llama")


def test_a_run_on_documents_begun_with_a_bos_token_scores_samples_and_exports_them_so(stdlib_data, next_line_task,
                                                                                       tmp_path):
    """Data prepared with a Llama-style tokenizer begins every document with its beginning-of-
    sequence token: the run's task rows, its samples and its export (whose tokenizer then adds
    the token to every text, and whose configs name it) begin texts with it too."""
    from tokenizers.processors import TemplateProcessing

    from scaletrain.data import prepare
    from scaletrain.data.shards import read_index
    from scaletrain.generate import data_bos_id, generate_text
    from scaletrain.train.tasks import load_task

    tokenizer = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|begin_of_text|>"])
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer.save(str(tmp_path / "bos.json"))
    data = tmp_path / "data"
    prepare(["builtin:python-stdlib"], data, 512, tokenizer=tmp_path / "bos.json", max_bytes=2_000_000,
            filters="none", workers=1)
    assert read_index(data)["bos_id"] == bos
    run_dir = tmp_path / "run"
    train(tiny_config(data, run_dir, "train.steps=2", "eval.interval=0", f"eval.tasks=['{next_line_task}']",
                      "eval.task_examples=4"))
    cfg = load_model(run_dir)[1]
    assert data_bos_id(run_dir, cfg) == bos
    data.rename(tmp_path / "moved")  # (the run says what its documents began with, wherever they went)
    assert data_bos_id(run_dir, cfg) == bos
    data = tmp_path / "moved"
    task = load_task(next_line_task, load_tokenizer(data), read_index(data)["eos_id"], 1024, 4, bos)  # (uncut)
    assert (task.inputs[:, 0] == bos).all()
    assert generate_text(run_dir, "def ", max_new_tokens=4, temperature=0).startswith("def ")
    export_hf(run_dir, tmp_path / "hf")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer("def f():")["input_ids"][0] == bos
    assert hf_tokenizer("def f():")["input_ids"][1:] == load_tokenizer(data).encode("def f():", add_special_tokens=False).ids
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] == bos and hf_tokenizer.bos_token_id == bos
    # Prepared with --no-bos, the documents begin without it: so do the export's texts (its
    # tokenizer's post-processor, which would add it, is left out).
    prepare(["builtin:python-stdlib"], tmp_path / "plain", 512, tokenizer=tmp_path / "bos.json", max_bytes=300_000,
            filters="none", workers=1, bos=False)
    train(tiny_config(tmp_path / "plain", tmp_path / "plain-run", "train.steps=1", "eval.interval=0"))
    export_hf(tmp_path / "plain-run", tmp_path / "plain-hf")
    plain = transformers.AutoTokenizer.from_pretrained(tmp_path / "plain-hf")
    assert plain("def f():")["input_ids"] == load_tokenizer(data).encode("def f():", add_special_tokens=False).ids


MIXTURES = {  # the first block dense, and one expert per token (weighted by its probability)
    "Qwen3MoeForCausalLM": ["model.qk_norm=true", "model.moe_experts=4", "model.moe_top_k=1", "model.moe_ffn_dim=48",
                            "model.moe_dense_layers=1", "model.sliding_window=8"],  # (its window over every block)
    "MixtralForCausalLM": ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=48",
                           "model.sliding_window=8"]}  # (Mixtral's window, over logits of 40)


@pytest.mark.parametrize("architecture", MIXTURES)
def test_a_mixture_of_experts_exports_as_qwen3_moe_or_mixtral_with_the_same_logits(stdlib_data, tmp_path,
                                                                                  architecture):
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=2", "eval.interval=0", *MIXTURES[architecture]))
    exported = export_hf(run_dir, tmp_path / "hf")
    assert exported.architecture == architecture
    ours, cfg, _ = load_model(run_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
    ids = load_tokenizer(run_dir / "tokenizer.json").encode(TEXT, add_special_tokens=False).ids
    tokens = torch.tensor([ids[:40], ids[-40:]])
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
    assert "| experts (each token to)" in (tmp_path / "hf" / "README.md").read_text()


@pytest.mark.parametrize("overrides, words", [
    (["model.moe_shared_experts=1"], "model.moe_shared_experts = 1: neither Qwen3-MoE nor Mixtral has shared experts"),
    (["model.moe_dense_layers=1"], "Mixtral .a mixture of experts without QK-norm. has no dense blocks"),
    (["model.moe_top_k=1"], "model.moe_top_k = 1: Mixtral weights a single expert's output by 1"),
    (["model.qk_norm=true", "model.moe_bias_update=0.001"], "routing biases have no place in Qwen3-MoE or Mixtral"),
    (["model.qk_norm=true", "model.moe_score=sigmoid"], "model.moe_score = 'sigmoid': Qwen3-MoE and Mixtral route by a"),
    (["model.qk_norm=true", "model.sliding_window=8", "model.full_attention_layers=[1]"],
     r"model.full_attention_layers = \[1\]: of the architectures .* only Qwen3's .dense, with QK-norm.*; Qwen3-MoE's "
     "and Mixtral's window covers every block"),
], ids=["shared", "dense-mixtral", "top1-mixtral", "biased", "sigmoid", "local-and-global"])
def test_a_mixture_no_architecture_computes_is_refused_before_any_weight_is_read(stdlib_data, tmp_path, overrides,
                                                                                 words):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = tiny_config(stdlib_data, run_dir, "model.moe_experts=4", *overrides)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    with pytest.raises(UserError, match=words):
        export_hf(run_dir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_chosen_step_in_bfloat16_and_in_shards_loads_as_one_model(runs, tmp_path):
    run_dir = runs / "llama"
    (tmp_path / "hf").mkdir()  # an empty directory is a destination too
    exported = export_hf(run_dir, tmp_path / "hf", dtype="bfloat16", step=3, max_shard_bytes=40_000)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~umask  # not a private temporary directory
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


def test_a_damaged_newest_checkpoint_is_passed_over_and_a_damaged_chosen_one_refused(runs, tmp_path, caplog):
    from scaletrain.evaluate import chosen_checkpoints

    run_dir = tmp_path / "llama"
    shutil.copytree(runs / "llama", run_dir)
    newest = run_dir / "checkpoints" / "step_0000006"
    damaged = next(newest.glob("*.distcp"))
    damaged.write_bytes(bytes(len(damaged.read_bytes())))  # same size, other bytes: only the checksum tells
    assert export_hf(run_dir, tmp_path / "hf").step == 3
    with pytest.raises(UserError, match="step_0000006 is not usable: file .* does not match the checksum"):
        export_hf(run_dir, tmp_path / "hf6", step=6)
    assert not (tmp_path / "hf6").exists()
    # Cut short (which the sizes in its marker tell without reading it): eval passes over it, saying so.
    damaged.write_bytes(damaged.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        assert chosen_checkpoints(run_dir) == [run_dir / "checkpoints" / "step_0000003"]
    assert f"checkpoint {newest} is damaged (file {damaged.name} is 100 bytes" in caplog.text and "passed over" in caplog.text
    with pytest.raises(UserError, match=f"checkpoint {str(newest)!r} is damaged: file {damaged.name} is 100 bytes.*; its "
                                        "run's complete checkpoints are of steps: 3"):
        chosen_checkpoints(run_dir, [6])


def test_a_run_starts_from_an_exported_model_and_trains_on(runs, stdlib_data, tmp_path):
    """checkpoint.init_from: the new run's step-0 weights are the exported ones; with a checkpoint
    of its own it resumes from that instead."""
    from scaletrain.train.trainer import Trainer

    export_hf(runs / "qwen3", tmp_path / "hf")
    ours, cfg, _ = load_model(runs / "qwen3")
    new = tiny_config(stdlib_data, tmp_path / "continued", "train.steps=2", "eval.interval=0",
                      "model.qk_norm=true", "model.tie_embeddings=true", "model.n_kv_heads=4", "model.rope_theta=500.0",
                      "model.norm_eps=1e-6", f"checkpoint.init_from={tmp_path / 'hf'}")
    trainer = Trainer(new)
    start = trainer.model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(start[name], tensor), name
    trainer.loader.close()
    result = train(new)
    fresh = train(tiny_config(stdlib_data, tmp_path / "fresh", "train.steps=2", "eval.interval=0",
                              "model.qk_norm=true", "model.tie_embeddings=true", "model.n_kv_heads=4"))
    assert result.train_loss < fresh.train_loss  # it starts from a trained model
    shutil.rmtree(tmp_path / "hf")  # resuming takes the run's own checkpoint: the model directory may go
    Trainer(new).loader.close()


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "yarn_rope", "linear_rope", "mistral", "qwen3", "qwen3_moe",
                                  "mixtral", "qwen3_local_global"])
def test_a_model_saved_by_transformers_computes_the_same_logits_here(tmp_path, kind):
    from scaletrain.config import ModelConfig
    from scaletrain.hf import hf_config, load_hf_weights, model_settings
    from scaletrain.model.llama import Transformer

    shape = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if kind == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, rope_theta=1e4, tie_word_embeddings=False))
    elif kind == "llama3_rope":  # Llama 3.1's scaling, its original length short enough to matter at 24 tokens
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}))
    elif kind == "yarn_rope":  # DeepSeek's mscale pair sets the attention factor (1.0 when equal: not these)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False, rope_scaling={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5}))
    elif kind == "linear_rope":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False, rope_scaling={
            "rope_type": "linear", "rope_theta": 1e4, "factor": 3.0}))
    elif kind == "mistral":  # a window spanning the whole context
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, tie_word_embeddings=False,
                                                                        sliding_window=128))
    elif kind == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=16, tie_word_embeddings=True))
    elif kind == "qwen3_local_global":  # the first block within a window of 8 (over 24 tokens), the second whole
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **shape, head_dim=16, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"]))
    elif kind == "qwen3_moe":  # a dense first block, then 4 experts of width 32, 2 per token
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, head_dim=16, tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]))
    else:
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **shape, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2))
    with torch.no_grad():  # norms initialised to ones would hide a mix-up of norm weights
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            if "gate" in name and "proj" not in name:  # a router initialised to zeros routes by index
                param.normal_(0, 0.5)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="50KB")  # several shards and an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    cfg = ModelConfig(**model_settings(tmp_path / "hf"))
    assert (cfg.qk_norm, cfg.tie_embeddings) == (kind.startswith("qwen3"), kind.startswith("qwen3"))
    assert (cfg.moe_experts, cfg.moe_dense_layers) == {"qwen3_moe": (4, 1), "mixtral": (4, 0)}.get(kind, (0, 0))
    ours = Transformer(cfg)
    ours.load_state_dict(load_hf_weights(tmp_path / "hf", cfg))
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf.eval()(tokens).logits, rtol=1e-4, atol=1e-4)
    scaled = {"llama3_rope": {"factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_seq_len": 16},
              "yarn_rope": {"type": "yarn", "factor": 4, "original_max_seq_len": 16, "beta_fast": 16,
                            "attention_factor": (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)},
              "linear_rope": {"type": "linear", "factor": 3}}

    def exported_again() -> dict:
        """The settings of the config.json export writes for cfg, read back, after transformers
        has computed hf's logits from it."""
        config = hf_config(cfg, "float32", 0)
        again = type(hf)(type(hf.config)(**config)).eval()
        again.load_state_dict(hf.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, rtol=1e-5, atol=1e-5)
        (tmp_path / "again").mkdir()
        (tmp_path / "again" / "config.json").write_text(json.dumps(config))
        return model_settings(tmp_path / "again")

    if kind == "qwen3_local_global":
        assert (cfg.sliding_window, cfg.full_attention_layers) == (8, [1])
        for window, full in ((None, None), (8, None), (8, [0])):  # (each matters at these positions)
            other = Transformer(cfg.model_copy(update={"sliding_window": window, "full_attention_layers": full}))
            other.load_state_dict(ours.state_dict())
            with torch.no_grad():
                assert (other(tokens) - ours(tokens)).abs().max() > 1e-3
        # and goes back out as transformers reads it: the same logits from what export writes
        assert ModelConfig(**exported_again()) == cfg
        from scaletrain.hf import export_problem
        assert "Mistral's window covers every block" in export_problem(cfg.model_copy(update={"qk_norm": False}))
    if kind in scaled:
        assert cfg.rope_scaling == pytest.approx(scaled[kind])
        plain = Transformer(cfg.model_copy(update={"rope_scaling": None}))
        plain.load_state_dict(ours.state_dict())
        with torch.no_grad():  # the scaling matters at these positions
            assert (plain(tokens) - ours(tokens)).abs().max() > 1e-3  # (the comparison above is to 1e-4)
        # and goes back out as transformers reads it: the same logits from what export writes
        assert exported_again()["rope_scaling"] == cfg.rope_scaling


def test_a_model_of_another_shape_or_kind_is_refused_with_the_settings_to_use(runs, stdlib_data, tmp_path):
    from scaletrain.config import ConfigError, ModelConfig
    from scaletrain.hf import check_matches, model_settings
    from scaletrain.train.trainer import Trainer

    export_hf(runs / "llama", tmp_path / "hf")
    cfg = tiny_config(stdlib_data, tmp_path / "run", "train.steps=2", f"checkpoint.init_from={tmp_path / 'hf'}",
                      "model.n_layers=3")
    with pytest.raises(ConfigError, match=r"model.n_layers is 3, the model's is 2.*model.rope_theta is 10000.0, "
                                          r"the model's is 500.0.*; set model.n_layers=2 .*model.rope_theta=500.0"):
        Trainer(cfg)
    shutil.copytree(tmp_path / "hf", tmp_path / "other")
    other = Tokenizer.from_file(str(tmp_path / "other" / "tokenizer.json"))
    other.add_tokens(["<|another|>"])
    other.save(str(tmp_path / "other" / "tokenizer.json"))
    with pytest.raises(ConfigError, match="its tokenizer is not the one the data was prepared with .*--tokenizer"):
        Trainer(tiny_config(stdlib_data, tmp_path / "run", "train.steps=2", f"checkpoint.init_from={tmp_path / 'other'}",
                            "model.rope_theta=500.0", "model.norm_eps=1e-6"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_parameters": llama3}))
    with pytest.raises(ConfigError, match=r"model.rope_scaling is None, the model's is \{'factor': 32.0.*; set "
                                          r"model.rope_scaling=\{factor = 32.0, low_freq_factor = 1.0, high_freq_factor"
                                          r" = 4.0, original_max_seq_len = 32.0\}"):
        Trainer(tiny_config(stdlib_data, tmp_path / "run", "train.steps=2", f"checkpoint.init_from={tmp_path / 'hf'}",
                            "model.rope_theta=500.0", "model.norm_eps=1e-6"))
    config.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 32.0}, attention_bias=True)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="does not compute: attention_bias true .*; rotary scaling 'dynamic' .*"
                                          "changes with each input's length"):
        model_settings(tmp_path / "hf")
    config.update(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "truncate": False},
                  attention_bias=False)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="does not compute: YaRN's ramp without truncation"):
        model_settings(tmp_path / "hf")
    # transformers' defaults: the original length is the model's; a default beta is not restated
    config.update(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "beta_fast": 32},
                  max_position_embeddings=256)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert model_settings(tmp_path / "hf")["rope_scaling"] == {"type": "yarn", "factor": 4.0,
                                                              "original_max_seq_len": 256.0}
    # ... and a run that restates a default starts from the model: the same scaling.
    from scaletrain.hf import check_matches
    wanted = model_settings(tmp_path / "hf")
    restated = ModelConfig(**{**wanted, "max_seq_len": 256, "rope_scaling": {**wanted["rope_scaling"], "beta_fast": 32.0,
                                                                            "beta_slow": 1.0}})
    check_matches(restated, tmp_path / "hf")
    with pytest.raises(ConfigError, match="model.rope_scaling is"):
        check_matches(restated.model_copy(update={"rope_scaling": {**wanted["rope_scaling"], "beta_fast": 16.0}}),
                      tmp_path / "hf")
    config.update(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0}, attention_bias=False)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rotary scaling 'llama3' without low_freq_factor, high_freq_factor, orig"):
        model_settings(tmp_path / "hf")
    with pytest.raises(ConfigError, match="has no readable config.json"):
        model_settings(tmp_path)
    mixture = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
               "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "mlp_only_layers": [1], "decoder_sparse_step": 2, "norm_topk_prob": False}
    (tmp_path / "config.json").write_text(json.dumps(mixture))
    with pytest.raises(ConfigError, match=r"mlp_only_layers \[1\] .dense blocks must come first.; decoder_sparse_step 2 "
                                          r".*; norm_topk_prob False with 2 experts per token"):
        model_settings(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**mixture, "model_type": "mixtral", "num_experts_per_tok": 1}))
    with pytest.raises(ConfigError, match="one expert per token weighted by 1"):
        model_settings(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**mixture, "mlp_only_layers": [0], "decoder_sparse_step": 1,
                                                      "norm_topk_prob": True}))
    with pytest.raises(ConfigError, match="model.moe_experts is 0, the model's is 4.*model.moe_dense_layers=1"):
        Trainer(tiny_config(stdlib_data, tmp_path / "run", "train.steps=2", f"checkpoint.init_from={tmp_path}"))
    mistral = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
               "max_position_embeddings": 128}
    for window, context, expected in ((64, 128, 64), (None, 8192, 4096), (128, 128, 128)):
        # (MistralConfig's default window: 4,096 tokens; one spanning a run's sequences is causal
        # attention there, which check_matches takes for none)
        config = {**mistral, "max_position_embeddings": context, **({"sliding_window": window} if window else {})}
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert model_settings(tmp_path).get("sliding_window") == expected
    # A window that spans the run's sequences (a run exported with one as long as its context): as none.
    for ours in (None, 128):
        check_matches(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=128,
                                  sliding_window=ours), tmp_path)
    with pytest.raises(ConfigError, match="model.sliding_window is None, the model's is 128; set "
                                          "model.sliding_window=128"):
        check_matches(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=256), tmp_path)
    # Qwen3's windows: over the blocks from max_window_layers on (before transformers wrote
    # layer_types; its default 28: every block of 2 whole), or as layer_types say.
    qwen3_window = {**mistral, "model_type": "qwen3", "head_dim": 16, "use_sliding_window": True, "sliding_window": 16}
    for extra, expected in (({}, (None, None)), ({"max_window_layers": 1}, (16, [0])), ({"max_window_layers": 0}, (16, None)),
                            ({"layer_types": ["sliding_attention", "full_attention"]}, (16, [1]))):
        (tmp_path / "config.json").write_text(json.dumps({**qwen3_window, **extra}))
        got = model_settings(tmp_path)
        assert (got.get("sliding_window"), got.get("full_attention_layers")) == expected, extra
    with pytest.raises(ConfigError, match=r"model.full_attention_layers is None, the model's is \[1\]; set "
                                          r"model.full_attention_layers=\[1\]"):
        check_matches(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, qk_norm=True, sliding_window=16),
                      tmp_path)
    # No window (null) whatever layer_types say, and a run whose blocks are all whole: causal attention.
    (tmp_path / "config.json").write_text(json.dumps({**qwen3_window, "sliding_window": None,
                                                      "layer_types": ["sliding_attention", "full_attention"]}))
    assert "sliding_window" not in model_settings(tmp_path) and "full_attention_layers" not in model_settings(tmp_path)
    check_matches(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, qk_norm=True, sliding_window=16,
                              full_attention_layers=[0, 1]), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**qwen3_window, "layer_types": ["linear_attention"] * 2}))
    with pytest.raises(ConfigError, match=r"layer_types \['linear_attention'\]"):
        model_settings(tmp_path)
    qwen3 = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(qwen3))  # no head_dim: Qwen3's default 128, not 64 / 4
    with pytest.raises(ConfigError, match="head_dim 128 x 4 heads, not its hidden_size 64"):
        model_settings(tmp_path)


LM_EVAL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

model, tasks = sys.argv[1:]
result = simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32,add_bos_token=True",
                         tasks=["interop"], task_manager=TaskManager(include_path=tasks), log_samples=True,
                         batch_size=8, device="cpu")
print(json.dumps({"results": result["results"]["interop"],
                  "scores": {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in result["samples"]["interop"]}}))
"""


def test_lm_evaluation_harness_scores_the_export_as_training_scores_its_tasks(runs, next_line_task, tmp_path):
    """eval.tasks against lm-evaluation-harness itself, on the exported model: the same
    log-likelihood of every choice, so the same accuracies, where the two are set to split the
    text alike (train/tasks.py says where they differ by design): the context is next_line's last
    line with its newline moved into the choices (the harness moves a context's trailing
    whitespace there), and the harness begins each text with the end-of-text token as training's
    documents begin (the export's tokenizer adds none by itself: here a post-processor adds it,
    with the harness's add_bos_token). Some rows fit the 64-token context, the others lose their
    start alike."""
    pytest.importorskip("lm_eval", reason="the harness test needs lm-eval (pip install -e '.[test]')")
    import subprocess
    import sys

    from tokenizers import processors

    from scaletrain.evaluate import chosen_checkpoints, evaluation_config
    from scaletrain.train.trainer import Trainer

    task = tmp_path / "interop.jsonl"
    examples = [json.loads(line) for line in next_line_task.read_text().splitlines()]
    task.write_text("".join(json.dumps({"context": e["context"].removesuffix("\n").split("\n")[-1],
                                        "choices": ["\n" + choice for choice in e["choices"]],
                                        "label": e["label"]}) + "\n" for e in examples))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "interop.yaml").write_text(
        "task: interop\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {task}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    export_hf(runs / "llama", tmp_path / "hf")
    tokenizer = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                             special_tokens=[("<|endoftext|>", eos)])
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", LM_EVAL, str(tmp_path / "hf"), str(tmp_path / "tasks")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    harness = json.loads(done.stdout.strip().splitlines()[-1])

    [newest] = chosen_checkpoints(runs / "llama")
    trainer = Trainer(evaluation_config(runs / "llama", newest, None, [str(task)], ["eval.task_examples=100"], 1,
                                        tmp_path / "scratch"))
    trainer.load_weights(newest)
    rows = trainer.tasks[0]
    assert (rows.lengths < 64).sum() >= 24 and (rows.lengths == 64).sum() >= 8  # both kinds of row
    ours = trainer.task_scores(rows)
    theirs = [score for doc in range(len(examples)) for score in harness["scores"][str(doc)]]
    assert ours == pytest.approx(theirs, rel=1e-6, abs=2e-4)
    metrics = trainer.evaluation()
    assert metrics["task_accuracy"]["interop"] == pytest.approx(harness["results"]["acc,none"], abs=1e-6)
    assert metrics["task_accuracy_norm"]["interop"] == pytest.approx(harness["results"]["acc_norm,none"], abs=1e-6)


def test_eval_measures_a_hugging_face_model_as_the_run_it_was_exported_from(runs, stdlib_data, tmp_path):
    """`scaletrain eval HF_DIR --data DIR`: a published model as a baseline on your data; here
    the export of a run, which must measure what the run's own checkpoint measures."""
    from scaletrain.config import ConfigError
    from scaletrain.evaluate import evaluate_run

    export_hf(runs / "llama", tmp_path / "hf")
    [run] = evaluate_run(runs / "llama")
    [model] = evaluate_run(tmp_path / "hf", data=str(stdlib_data),
                           overrides=["eval.tokens=1024", "train.micro_batch=4"])  # (the run's: tiny.toml's)
    assert (model["step"], model["checkpoint"]) == (None, str(tmp_path / "hf"))
    for key in ("loss", "bits_per_byte"):
        assert model[key] == pytest.approx(run[key], rel=1e-6), key
    with pytest.raises(ConfigError, match="has no data of its own; give --data"):
        next(evaluate_run(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="no checkpoints to choose"):
        next(evaluate_run(tmp_path / "hf", data=str(stdlib_data), every=True))
    result = run_cli("eval", str(tmp_path / "hf"), "--data", str(stdlib_data), "eval.tokens=1024")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bits/byte" in result.stdout and "│    - │" in result.stdout
