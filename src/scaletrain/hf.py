"""A run's checkpoint as a Hugging Face model directory, and such a directory as a run's start.

`export_hf(run_dir, out)` writes what `transformers.AutoModelForCausalLM.from_pretrained(out)`
and `AutoTokenizer.from_pretrained(out)` load: `config.json`, the weights as safetensors
(`model.safetensors`, or shards of at most `max_shard_bytes` with `model.safetensors.index.json`),
`generation_config.json`, the run's `tokenizer.json` with `tokenizer_config.json`, and a
`README.md` model card. The decoder of `model/llama.py` is Hugging Face's `LlamaForCausalLM`
(its rotary embeddings already use the "rotate half" pairing, so no weight is permuted); with
QK-norm it is `Qwen3ForCausalLM`, Llama plus a per-head RMSNorm of queries and keys before the
rotation, as ours. Nothing is written to `out` until every file is ready: the files go to a
sibling directory that is renamed to `out` last.

The other way, `model_settings(hf_dir)` reads a Llama or Qwen3 config.json as model.* settings
and `load_hf_weights(hf_dir, cfg)` its safetensors as our state dict (`checkpoint.init_from`:
continued pre-training from a published or exported model), refusing what the decoder of
`model/llama.py` does not compute (biases, rotary scaling, sliding windows, another activation).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import ConfigError, ModelConfig, load_config
from scaletrain.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")
# Hugging Face's own default shard size (`save_pretrained(max_shard_size="5GB")`).
MAX_SHARD_BYTES = 5 * 10**9

# Our parameter names (Meta's Llama / torchtitan) -> Hugging Face's, for block `{}`.
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


class ExportError(UserError, ValueError):
    """An export that cannot be written (bad destination or settings)."""


@dataclass
class Exported:
    out: Path
    step: int
    architecture: str
    files: list[str]
    bytes: int  # of the weight files


def hf_name(name: str) -> str:
    """Hugging Face's name of one of our parameters, e.g. layers.3.attention.wq.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    prefix, index, rest = name.split(".", 2)
    if prefix != "layers" or rest not in _BLOCK_NAMES:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{index}.{_BLOCK_NAMES[rest]}"


def architecture(cfg: ModelConfig) -> str:
    """The transformers class that computes what our model with this shape computes."""
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def hf_config(cfg: ModelConfig, dtype: str, eos_id: int) -> dict:
    """config.json for the model `cfg` describes: LlamaForCausalLM, or Qwen3ForCausalLM with QK-norm.

    RoPE's base is written both ways transformers has read it (`rope_theta` before v5,
    `rope_parameters` since), and the dtype under both of its names, for the same reason."""
    config = {
        "architectures": [architecture(cfg)],
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        # Documents are separated by the end-of-text token and none starts with another, so the
        # same token begins a generation (as `scaletrain generate` does for an empty prompt).
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if cfg.qk_norm:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    return config


def export_hf(run_dir: str | Path, out: str | Path, dtype: str = "float32", step: int | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> Exported:
    """Write the run's newest complete checkpoint (or the one of `step`) to `out` as a Hugging
    Face model directory; `out` must not exist or be empty. float32 keeps the trained weights
    exactly; bfloat16 or float16 halve the files."""
    out = Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if max_shard_bytes < 1:
        raise ExportError(f"the largest shard must be at least 1 byte, got {max_shard_bytes}")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"{str(out)!r} already exists and is not an empty directory; give a new path "
                          "(an export never overwrites files)")
    tokenizer_json = Path(run_dir) / "tokenizer.json"
    if (Path(run_dir) / "config.toml").is_file():  # before loading any weights
        model_cfg = load_config(Path(run_dir) / "config.toml").model
        if model_cfg.moe:
            raise ExportError(f"{str(run_dir)!r} is a mixture of experts (model.moe_experts = "
                              f"{model_cfg.moe_experts}); export writes Llama and Qwen3 dense models only so far")
    if (Path(run_dir) / "config.toml").is_file() and not tokenizer_json.is_file():
        raise ConfigError(f"run directory {str(run_dir)!r} has no tokenizer.json; it is copied there when "
                          "training starts, so this run never trained")

    import torch
    from safetensors.torch import save_file

    from scaletrain.data.tokenizer import eos_id as find_eos, load_tokenizer
    from scaletrain.generate import load_model
    from scaletrain.model.flops import param_counts

    model, cfg, step = load_model(run_dir, step=step)
    tokenizer = load_tokenizer(tokenizer_json)
    eos_id = find_eos(tokenizer)
    eos = tokenizer.id_to_token(eos_id)
    weights = {hf_name(name): tensor.detach().to(getattr(torch, dtype)).contiguous()
               for name, tensor in model.state_dict().items()
               if not (cfg.model.tie_embeddings and name == "output.weight")}  # tied: one tensor, in the embedding

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shards = _shards(weights, max_shard_bytes)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        for file, names in shards.items():
            save_file({name: weights[name] for name in names}, staging / file, metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: file for file, names in shards.items() for name in names}}
            _write_json(staging / "model.safetensors.index.json", index)
        _write_json(staging / "config.json", hf_config(cfg.model, dtype, eos_id))
        _write_json(staging / "generation_config.json",
                    {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": True, "temperature": 0.8,
                     "top_k": 50})
        shutil.copyfile(tokenizer_json, staging / "tokenizer.json")
        # split_special_tokens: "<|endoftext|>" written in a text is encoded as text, as in training
        # (data/tokenizer.py); only the token appended between documents ends one.
        _write_json(staging / "tokenizer_config.json",
                    {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos,
                     "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                     "split_special_tokens": True, "model_max_length": cfg.model.max_seq_len})
        (staging / "README.md").write_text(_model_card(Path(run_dir), cfg, step, param_counts(cfg.model)["total"],
                                                       dtype))
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would keep the export from everyone else
        os.replace(staging, out)  # rename(2) replaces an empty directory
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Exported(out=out, step=step, architecture=architecture(cfg.model), files=sorted(p.name for p in out.iterdir()),
                    bytes=total)


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it for every thread meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)  # no /proc (not Linux): set and restore, briefly
    os.umask(umask)
    return umask


def _shards(weights: dict, max_shard_bytes: int) -> dict[str, list[str]]:
    """File name -> tensor names, in order, each file at most max_shard_bytes unless one tensor is larger."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": names for i, names in enumerate(groups, 1)}


def _model_card(run_dir: Path, cfg, step: int, params: int, dtype: str) -> str:
    from scaletrain.train.metrics import read_metrics

    evals = [r for r in read_metrics(run_dir, "eval") if r["step"] <= step] if (run_dir / "metrics.jsonl").is_file() else []
    m = cfg.model
    lines = [
        f"# {cfg.run.name}",
        "",
        f"A {params:,}-parameter decoder pre-trained with scaletrain (run `{cfg.run.name}`, step {step:,}), "
        f"exported in {dtype}.",
        "",
        "| | |",
        "|---|---|",
        f"| layers, width, heads (key/value) | {m.n_layers}, {m.dim}, {m.n_heads} ({m.kv_heads}) |",
        f"| MLP width, vocabulary, context | {m.hidden_dim}, {m.vocab}, {m.max_seq_len} |",
        f"| QK-norm, tied embeddings | {'yes' if m.qk_norm else 'no'}, {'yes' if m.tie_embeddings else 'no'} |",
    ]
    if evals:
        last = evals[-1]
        lines.append(f"| validation loss at step {last['step']:,} ({last['tokens']:,} tokens) | {last['loss']:.4f} |")
    lines += ["", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH)",
              "tokenizer = AutoTokenizer.from_pretrained(PATH)", "```", ""]
    return "\n".join(lines)


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


# Our ModelConfig field -> Hugging Face config.json key, for the settings that must agree.
_SETTINGS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
             "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}


def _hf_config(hf_dir: Path) -> dict:
    path = Path(hf_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} has no readable config.json ({e}); give a Hugging "
                          "Face model directory (config.json and *.safetensors)") from None


def model_settings(hf_dir: str | Path) -> dict:
    """The model.* settings (as `model.KEY=value` would set them) of the Hugging Face model in
    hf_dir; ConfigError for a model our decoder does not compute."""
    hf = _hf_config(Path(hf_dir))
    kind = hf.get("model_type")
    problems = []
    if kind not in ("llama", "qwen3"):
        problems.append(f"model_type {kind!r} (supported: llama, qwen3)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (SwiGLU needs silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key} true (the decoder has no biases)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"rotary scaling {rope.get('rope_type', rope.get('type'))!r} (only plain RoPE)")
    if hf.get("use_sliding_window"):
        problems.append("sliding-window attention")
    if problems:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} holds a model scaletrain's decoder does not "
                          f"compute: {'; '.join(problems)}")
    head_dim = hf.get("head_dim", 128 if kind == "qwen3" else None)  # Qwen3Config's default is 128, not width/heads
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} has head_dim {head_dim} x "
                          f"{hf['num_attention_heads']} heads, not its hidden_size {hf['hidden_size']}; "
                          "scaletrain's heads split the width exactly")
    settings = {ours: hf[theirs] for ours, theirs in _SETTINGS.items() if theirs in hf}
    settings.setdefault("tie_embeddings", False)  # transformers' default for both architectures
    settings["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    settings["max_seq_len"] = hf.get("max_position_embeddings", 2048)
    settings["qk_norm"] = kind == "qwen3"
    return settings


def check_matches(cfg: ModelConfig, hf_dir: str | Path) -> None:
    """ConfigError naming every model.* setting that differs from the Hugging Face model's and the
    values to set (max_seq_len may differ: the rotary tables are computed, not loaded)."""
    want = model_settings(hf_dir)
    if cfg.moe:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} is a dense model; model.moe_experts = "
                          f"{cfg.moe_experts} asks for a mixture of experts (set model.moe_experts = 0)")
    have = {"vocab_size": cfg.vocab, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.kv_heads, "ffn_dim": cfg.hidden_dim, "norm_eps": cfg.norm_eps,
            "tie_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta, "qk_norm": cfg.qk_norm}
    wrong = [key for key in have if key in want and have[key] != want[key]]
    if wrong:
        fix = " ".join(f"model.{key}={json.dumps(want[key])}" for key in wrong)
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} holds another shape: "
                          + ", ".join(f"model.{key} is {have[key]}, the model's is {want[key]}" for key in wrong)
                          + f"; set {fix}")


def check_tokenizer(hf_dir: str | Path, data_tokenizer: str | Path) -> None:
    """ConfigError when the model directory's tokenizer.json (if it has one) maps tokens to other ids
    than the tokenizer the data was prepared with: the model would read the data as other words."""
    from scaletrain.data.tokenizer import load_tokenizer

    model_tokenizer = Path(hf_dir) / "tokenizer.json"
    if not model_tokenizer.is_file():
        return
    if load_tokenizer(model_tokenizer).get_vocab() != load_tokenizer(data_tokenizer).get_vocab():
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r}: its tokenizer is not the one the data was "
                          f"prepared with ({data_tokenizer}); prepare the data with `scaletrain data prepare "
                          f"--tokenizer {model_tokenizer}`")


def init_source(cfg) -> Path | None:
    """The Hugging Face model directory a run `cfg` (a resolved RunConfig) starts from, checked
    against its model and data (ConfigError if they do not fit); None when the run takes no
    weights from one: no checkpoint.init_from, or a run that resumes from a checkpoint (its own,
    or the one checkpoint.resume names) and needs the directory no more."""
    from scaletrain.train.checkpoint import committed_checkpoints

    hf_dir = cfg.checkpoint.init_from
    if (not hf_dir or cfg.checkpoint.resume not in ("auto", "never")
            or committed_checkpoints(cfg.run_dir / "checkpoints")):
        return None
    check_matches(cfg.model, hf_dir)
    check_tokenizer(hf_dir, next(iter(cfg.data.sources.values())) / "tokenizer.json")
    return Path(hf_dir)


def load_hf_weights(hf_dir: str | Path, cfg: ModelConfig) -> dict:
    """The Hugging Face model's weights (model.safetensors, or the shards its index names) as the
    state dict of `Transformer(cfg)`, in float32; checked against cfg first."""
    import torch
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    check_matches(cfg, hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    wanted = {hf_name(name): name for name in _our_names(cfg)
              if not (cfg.tie_embeddings and name == "output.weight")}  # tied: the embedding's tensor
    ours = {}
    for file in files:
        if not (hf_dir / file).is_file():
            raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} lacks {file}; give a directory with the "
                              "model's safetensors weights")
        with safe_open(hf_dir / file, framework="pt") as f:  # one tensor at a time, not whole shards
            for key in f.keys():
                if key in wanted:
                    ours[wanted[key]] = f.get_tensor(key).to(torch.float32)
    missing = [key for key, name in wanted.items() if name not in ours]
    if missing:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} has no tensor {missing[0]}"
                          + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if cfg.tie_embeddings:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


def _our_names(cfg: ModelConfig) -> list[str]:
    """The names of Transformer(cfg)'s parameters, without building it."""
    optional = ("attention.q_norm.weight", "attention.k_norm.weight")
    return ["tok_embeddings.weight", "norm.weight", "output.weight",
            *(f"layers.{i}.{rest}" for i in range(cfg.n_layers) for rest in _BLOCK_NAMES
              if cfg.qk_norm or rest not in optional)]
