"""Config loading: TOML, dotted overrides, and errors that name the key, the value and the fix."""

import tomllib

import pytest

from scaletrain.config import ConfigError, load_config, validate_config


def test_overrides_are_parsed_as_toml_values(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 5\n[run]\nname = "x"\n')
    cfg = load_config(path, ["train.lr=3e-4", "model.qk_norm=true", "run.name=other", "train.schedule=wsd"])
    assert cfg.train.lr == 3e-4 and cfg.model.qk_norm is True and cfg.run.name == "other"
    assert cfg.train.schedule == "wsd" and cfg.train.steps == 5


def test_resolved_config_round_trips_through_toml():
    cfg = load_config(None, ["train.steps=10", "model.n_kv_heads=2", "train.eps=1e-10", "model.document_mask=true",
                             "log.profile_steps=[2, 3]", "model.rope_scaling={factor = 8, low_freq_factor = 1, "
                             "high_freq_factor = 4, original_max_seq_len = 8192}"])
    assert validate_config(tomllib.loads(cfg.to_toml())) == cfg


@pytest.mark.parametrize("overrides, words", [
    (["train.steps=10", "train.stepz=3"], ["train.stepz", "unknown key", "steps, tokens"]),
    (["train.steps=ten"], ["train.steps", "'ten'", "integer"]),
    (["train.steps=10", "train.micro_batch=3"], ["global_batch_tokens", "not divisible", "multiple of 768"]),
    (["train.steps=10", "data.seq_len=4096"], ["data.seq_len = 4096", "model.max_seq_len = 1024"]),
    (["train.steps=10", "train.tokens=100"], ["exactly one of train.steps and train.tokens"]),
    (["train.steps=10", "model.n_kv_heads=3"], ["n_kv_heads = 3", "not divisible"]),
    (["train.steps=10", "train.schedule=linear"], ["train.schedule", "'linear'", "cosine", "wsd"]),
    (["train.steps=10", "bogus.x=1"], ["bogus", "unknown key", "model, data, train"]),
    (["train.steps=10", "train.lr=-1"], ["train.lr = -1", "greater than 0"]),
    (["trainsteps10"], ["section.key=value"]),
    (["train.steps=10", "data.mix={a = inf, b = 1}"], ["data.mix.a = inf: Input should be a finite number"]),
    (["train.steps=10", "data.mix={a = 0, b = 1}"], ["data.mix weights must be positive finite"]),
    (["train.steps=10", "train.lr=inf"], ["train.lr = inf: Input should be a finite number"]),  # (not trained)
    (["train.steps=10", "model.rope_theta=nan"], ["model.rope_theta = nan: Input should be a finite number"]),
    (["train.steps=10", "model.rope_scaling={factor = 8}"], ["model.rope_scaling", "high_freq_factor, low_freq_factor"]),
    (["train.steps=10", 'model.rope_scaling={type = "yarn", factor = 4}'],
     ["factor, original_max_seq_len (and may give attention_factor, beta_fast, beta_slow) for YaRN scaling",
      'e.g. {type = "yarn", factor = 4, original_max_seq_len = 4096}']),
    (["train.steps=10", 'model.rope_scaling={type = "ntk", factor = 4}'],
     ["type 'ntk' is not one of 'llama3', 'yarn', 'linear'"]),
    (["train.steps=10", 'model.rope_scaling={type = "linear", factor = 4, low_freq_factor = 1}'],
     ["must give positive factor for linear scaling"]),
    (["train.steps=10", 'model.rope_scaling={type = "yarn", factor = 4, original_max_seq_len = 64, beta_fast = 1}'],
     ["beta_fast 1.0 must exceed beta_slow 1.0"]),
    (["train.steps=10", "log.profile_steps=[5, 3]"], ["log.profile_steps = [5, 3]", "[first, last]", "e.g. [10, 12]"]),
    (["train.steps=10", "model.rope_scaling={factor = nan, low_freq_factor = 1, high_freq_factor = 4, "
                        "original_max_seq_len = 8192}"], ["model.rope_scaling.factor = nan: Input should be a finite "
                                                          "number"]),
    (["train.steps=10", "model.rope_scaling={factor = -8, low_freq_factor = 1, high_freq_factor = 4, "
                        "original_max_seq_len = 8192}"], ["model.rope_scaling", "must give positive"]),
    (["train.steps=10", "model.rope_scaling={factor = 8, low_freq_factor = 1, high_freq_factor = 4, "
                        "original_max_seq_len = 8192.5}"], ["original_max_seq_len 8192.5", "whole number"]),
    (["train.steps=10", 'log.wandb_project=""'], ["log.wandb_project", "at least 1 character"]),
    (["train.steps=10", "checkpoint.interval=0", "checkpoint.keep_every=1000"],
     ["checkpoint.keep_every = 1000 keeps nothing with checkpoint.interval = 0"]),
    (["train.steps=10", "train.batch_ramp=[[16384, 100000]]"],
     ["train.batch_ramp's batch_tokens = 16384 is not below train.global_batch_tokens = 16384"]),
    (["train.steps=10", "eval.tasks=['a/test.jsonl', 'b/test.jsonl']"], ["more than one task 'test'"]),
    (["train.steps=10", "checkpoint.interval=300", "checkpoint.keep_every=1000"],
     ["checkpoint.keep_every = 1000 is not a multiple of checkpoint.interval = 300"]),
    (["train.steps=10", "checkpoint.interval=often"], ["checkpoint.interval = 'often'", "valid integer", "or be 'auto'"]),
    (["train.steps=10", "checkpoint.init_from=runs/a", "checkpoint.resume=runs/b/checkpoints/step_0000004"],
     ["continues a run from its checkpoint, and checkpoint.init_from = 'runs/a' starts a new run from one"]),
    (["train.steps=10", "checkpoint.interval=-1"],  # (one key, not pydantic's tags of the union's members)
     ["checkpoint.interval = -1: Input should be greater than or equal to 0, or be 'auto'"]),
    (["train.steps=10", "checkpoint.interval=auto", "checkpoint.failures_per_device_hour=-1"],
     ["checkpoint.failures_per_device_hour", "greater than or equal to 0"]),
    (["train.steps=10", "train.batch_ramp=[[4096, 100], [8192, 50]]"],
     ["train.batch_ramp = [[4096, 100], [8192, 50]]", "until_tokens increasing"]),
    (["train.steps=10", "train.batch_ramp=[[1000, 100000]]"],
     ["train.batch_ramp's batch_tokens = 1000 is not divisible by train.micro_batch x data.seq_len", "e.g. 2048"]),
])
def test_bad_configs_name_the_key_the_value_and_what_is_valid(overrides, words):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    for word in words:
        assert word in str(error.value)


def test_missing_and_malformed_files_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_steps_follow_from_a_token_budget():
    cfg = load_config(None, ["train.tokens=100000", "train.global_batch_tokens=16384"])
    assert cfg.total_steps == 7


def test_a_batch_ramp_sets_each_steps_batch_and_the_steps_a_token_budget_takes():
    """[[128, 1000], [256, 2000]] then 512 (seq_len 64, micro_batch 2): 8 steps of 128 reach
    1024 >= 1000 tokens, 4 of 256 reach 2048 >= 2000, then 6 of 512 the 5000 asked for (5120);
    a pair whose until_tokens is already passed is never trained."""
    ramp = ["train.micro_batch=2", "train.global_batch_tokens=512", "data.seq_len=64", "model.max_seq_len=64"]
    cfg = load_config(None, [*ramp, "train.tokens=5000", "train.batch_ramp=[[128, 1000], [256, 2000]]"])
    assert [cfg.step_batch_tokens(step) for step in range(18)] == [128] * 8 + [256] * 4 + [512] * 6
    assert [cfg.tokens_before(step) for step in (0, 8, 9, 12, 13, 18)] == [0, 1024, 1280, 2048, 2560, 5120]
    assert (cfg.total_steps, cfg.total_tokens) == (18, 5120)
    assert load_config(None, [*ramp, "train.tokens=1000", "train.batch_ramp=[[128, 1000], [256, 2000]]"]).total_steps == 8
    passed = load_config(None, [*ramp, "train.steps=4", "train.batch_ramp=[[384, 600], [256, 700]]"])
    assert [passed.step_batch_tokens(step) for step in range(4)] == [384, 384, 512, 512]  # 768 >= 700 already
    assert passed.total_tokens == 1792
    plain = load_config(None, [*ramp, "train.tokens=5000"])
    assert (plain.total_steps, plain.total_tokens, plain.step_batch_tokens(3)) == (10, 5120, 512)


def test_readme_config_reference_is_the_fields_docstrings():
    from pathlib import Path

    from scaletrain.config import reference_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert reference_markdown() in readme, "regenerate README's config reference from config.reference_markdown()"


def test_a_config_without_a_length_is_refused():
    with pytest.raises(ConfigError, match="train: required"):
        load_config(None, [])


def test_a_length_override_replaces_the_files_other_length(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\ntokens = 1000000\n")
    assert load_config(path, ["train.steps=30"]).train.tokens is None
    assert load_config(path, ["train.steps=30"]).total_steps == 30
    with pytest.raises(ConfigError, match="exactly one"):
        load_config(path, ["train.steps=30", "train.tokens=5"])


def test_a_compile_mode_without_compile_is_refused():
    with pytest.raises(ConfigError, match="has no effect without train.compile = true"):
        load_config(None, ["train.steps=1", "train.compile_mode=reduce-overhead"])
    assert load_config(None, ["train.steps=1", "train.compile=true", "train.compile_mode=max-autotune"]).train.compile
