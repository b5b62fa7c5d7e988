"""A run's checkpoint as a Hugging Face model directory, and such a directory as a run's start.

`export_hf(run_dir, out)` writes what `transformers.AutoModelForCausalLM.from_pretrained(out)`
and `AutoTokenizer.from_pretrained(out)` load: `config.json`, the weights as safetensors
(`model.safetensors`, or shards of at most `max_shard_bytes` with `model.safetensors.index.json`),
`generation_config.json`, the run's `tokenizer.json` with `tokenizer_config.json`, and a
`README.md` model card. The decoder of `model/llama.py` is Hugging Face's `LlamaForCausalLM`
(its rotary embeddings already use the "rotate half" pairing, so no weight is permuted); with
QK-norm it is `Qwen3ForCausalLM`, Llama plus a per-head RMSNorm of queries and keys before the
rotation, as ours; with a sliding window (model.sliding_window) `MistralForCausalLM`, Llama's
layers under the same names with a window over every layer's attention, or with QK-norm
Qwen3's `layer_types`, which also say which blocks attend over the whole sequence
(model.full_attention_layers: local and global blocks). A mixture of experts (model/moe.py) is `Qwen3MoeForCausalLM` with QK-norm
(dense first blocks as its `mlp_only_layers`; the top-k weights renormalised when k > 1, as
its `norm_topk_prob`) and `MixtralForCausalLM` without; both route in float32 by a softmax
over every expert and keep the top k, which is what ours computes. Neither has shared
experts, Mixtral neither dense blocks nor the router probability as the weight of a single
expert: those models are refused in one sentence. Expert weights are written one expert at a
time, as the published checkpoints of both are. Nothing is written to `out` until every file
is ready: the files go to a sibling directory that is renamed to `out` last.

The other way, `model_settings(hf_dir)` reads a Llama, Mistral, Qwen3, Qwen3-MoE or Mixtral
config.json as model.* settings (Mistral is Llama with the same weight names and, shorter than
its context, a sliding window: model.sliding_window, as Mistral 7B v0.1's 4,096) and
`load_hf_weights(hf_dir, cfg)` its safetensors as our state dict (`checkpoint.init_from`:
continued pre-training from a published or exported model), refusing what the decoder of
`model/llama.py` does not compute (biases, dynamic rotary scaling, another activation, dense
blocks between expert blocks).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import (ROPE_SCALING, YARN_BETA_FAST, YARN_BETA_SLOW, ConfigError, ModelConfig, effective_window,
                               load_config, toml_value, yarn_attention_factor)
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
# A mixture-of-experts block's MLP: the module's name, then each stacked expert weight's name
# per expert (w1: gate, w3: up, w2: down), in Qwen3-MoE and in Mixtral.
_MOE_NAMES = {"Qwen3MoeForCausalLM": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
              "MixtralForCausalLM": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"})}


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


def hf_names(cfg: ModelConfig, name: str) -> list[str]:
    """Hugging Face's names of one of our parameters in the model `cfg` describes: one name, or
    for a block's stacked expert weights one per expert (layers.3.feed_forward.experts.w1 ->
    model.layers.3.mlp.experts.E.gate_proj.weight for E = 0, 1, ...)."""
    if name.startswith("layers.") and ".feed_forward." in name and cfg.is_moe_layer(int(name.split(".")[1])):
        index, rest = name.split(".", 2)[1:]
        module, experts = _MOE_NAMES[architecture(cfg)]
        if rest == "feed_forward.router.weight":
            return [f"model.layers.{index}.{module}.gate.weight"]
        kind = rest.removeprefix("feed_forward.experts.")
        if kind not in experts:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        return [f"model.layers.{index}.{module}.experts.{e}.{experts[kind]}.weight" for e in range(cfg.moe_experts)]
    return [hf_name(name)]


def architecture(cfg: ModelConfig) -> str:
    """The transformers class that computes what our model with this shape computes (with a sliding
    window, Mistral: Llama's layers and weights' names, a window over every layer's attention)."""
    if cfg.moe:
        return "Qwen3MoeForCausalLM" if cfg.qk_norm else "MixtralForCausalLM"
    if cfg.sliding_window is not None and not cfg.qk_norm:
        return "MistralForCausalLM"
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def export_problem(cfg: ModelConfig) -> str | None:
    """Why no Hugging Face architecture computes the model `cfg` describes, or None."""
    if cfg.full_attention_layers is not None and (cfg.moe or not cfg.qk_norm):
        return (f"model.full_attention_layers = {cfg.full_attention_layers}: of the architectures with these blocks "
                "only Qwen3's (dense, with QK-norm: model.qk_norm = true) has blocks without the window beside windowed "
                "ones; " + ("Qwen3-MoE's and Mixtral's" if cfg.moe else "Mistral's") + " window covers every block")
    return moe_problem(cfg)


def moe_problem(cfg: ModelConfig) -> str | None:
    """Why no Hugging Face architecture computes the mixture of experts `cfg` describes, or None."""
    if not cfg.moe:
        return None
    if cfg.moe_shared_experts:
        return (f"model.moe_shared_experts = {cfg.moe_shared_experts}: neither Qwen3-MoE nor Mixtral has shared "
                "experts")
    if cfg.moe_bias_update:
        return (f"model.moe_bias_update = {cfg.moe_bias_update}: the experts' routing biases have no place in "
                "Qwen3-MoE or Mixtral")
    if cfg.moe_score != "softmax":
        return f"model.moe_score = {cfg.moe_score!r}: Qwen3-MoE and Mixtral route by a softmax"
    if cfg.group_limit < cfg.moe_groups:
        return (f"model.moe_group_limit = {cfg.moe_group_limit} of model.moe_groups = {cfg.moe_groups}: Qwen3-MoE "
                "and Mixtral route among all experts")
    if not cfg.qk_norm and cfg.moe_dense_layers:
        return (f"model.moe_dense_layers = {cfg.moe_dense_layers}: Mixtral (a mixture of experts without QK-norm) has "
                "no dense blocks; Qwen3-MoE (model.qk_norm = true) has")
    if not cfg.qk_norm and cfg.moe_top_k == 1:
        return ("model.moe_top_k = 1: Mixtral weights a single expert's output by 1, scaletrain by its router "
                "probability; Qwen3-MoE (model.qk_norm = true) computes it")
    return None


def _hf_rope_scaling(cfg: ModelConfig) -> dict:
    """model.rope_scaling as transformers names it (empty for plain RoPE). Only the keys given:
    transformers' defaults for YaRN's are ours."""
    if cfg.rope_scaling is None:
        return {}
    scaling = {_ROPE_SCALING.get(key, key): value for key, value in cfg.rope_scaling.items() if key != "type"}
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return {"rope_type": cfg.rope_scaling.get("type", "llama3"), **scaling}


_ROPE_SCALING = {"original_max_seq_len": "original_max_position_embeddings"}  # ours -> transformers'
# The keys transformers' rotary scalings must give, by rope_type (model.rope_scaling's, renamed);
# YaRN may also give beta_fast, beta_slow and attention_factor (or DeepSeek's mscale and
# mscale_all_dim, which set the last).
_ROPE_KEYS = {kind: tuple(_ROPE_SCALING.get(key, key) for key in required)
              for kind, (required, _) in ROPE_SCALING.items()}


def _yarn_defaults(factor: float) -> dict:
    """YaRN's settings that transformers and model/llama.py take by default."""
    return {"beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW, "attention_factor": yarn_attention_factor(factor)}


def _without_defaults(scaling: dict | None) -> dict | None:
    """model.rope_scaling without the YaRN settings given at their defaults, as _our_rope_scaling
    reads a model's: the same scaling either way."""
    if not scaling or scaling.get("type") != "yarn":
        return scaling
    defaults = _yarn_defaults(scaling["factor"])
    return {key: value for key, value in scaling.items() if not (key in defaults and value == defaults[key])}


def _our_rope_scaling(rope_type: str, rope: dict, max_positions: int) -> dict:
    """transformers' rope_parameters of a scaled kind (checked complete) as model.rope_scaling."""
    theirs = {value: key for key, value in _ROPE_SCALING.items()}
    ours = {} if rope_type == "llama3" else {"type": rope_type}
    ours.update({theirs.get(key, key): float(rope[key]) for key in _ROPE_KEYS[rope_type] if rope.get(key) is not None})
    if rope_type == "yarn":
        ours.setdefault("original_max_seq_len", float(max_positions))
        ours.setdefault("factor", max_positions / ours["original_max_seq_len"])
        defaults = _yarn_defaults(ours["factor"])
        ours.update({key: float(rope[key]) for key in defaults if rope.get(key) and rope[key] != defaults[key]})
        if "attention_factor" not in ours and rope.get("mscale") and rope.get("mscale_all_dim"):
            def magnitude(scale):  # transformers' (and DeepSeek's) get_mscale
                return 0.1 * scale * math.log(ours["factor"]) + 1.0 if ours["factor"] > 1 else 1.0
            ours["attention_factor"] = magnitude(rope["mscale"]) / magnitude(rope["mscale_all_dim"])
    return ours


def hf_config(cfg: ModelConfig, dtype: str, eos_id: int, bos_id: int | None = None) -> dict:
    """config.json for the model `cfg` describes: LlamaForCausalLM, or Qwen3ForCausalLM with QK-norm
    (their mixtures of experts: MixtralForCausalLM, Qwen3MoeForCausalLM); `bos_id`: the token the
    data began documents with, if any.

    RoPE's base is written both ways transformers has read it (`rope_theta` before v5,
    `rope_parameters` since), and the dtype under both of its names, for the same reason."""
    config = {
        "architectures": [architecture(cfg)],
        "model_type": "qwen3" if cfg.qk_norm else "llama",  # the mixtures' below
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **_hf_rope_scaling(cfg)},
        "rope_scaling": _hf_rope_scaling(cfg) or None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        # Documents are separated by the end-of-text token and, unless the data begins each with a
        # beginning-of-sequence token (`bos_id`: a Llama tokenizer's), none starts with another, so
        # the same token begins a generation (as `scaletrain generate` does for an empty prompt).
        "bos_token_id": eos_id if bos_id is None else bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if cfg.qk_norm and cfg.sliding_window is not None:
        # Each block's kind (layer_types, transformers >= 4.53); max_window_layers, what earlier
        # versions read, counts the whole blocks before the first windowed one.
        kinds = ["full_attention" if cfg.window_of(i) is None else "sliding_attention" for i in range(cfg.n_layers)]
        config.update(use_sliding_window=True, sliding_window=cfg.sliding_window, layer_types=kinds,
                      max_window_layers=kinds.index("sliding_attention") if "sliding_attention" in kinds else cfg.n_layers)
    elif cfg.qk_norm:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    elif cfg.sliding_window is not None and not cfg.moe:
        config.update(model_type="mistral", sliding_window=cfg.sliding_window)
        config.pop("mlp_bias")
    if cfg.moe and cfg.qk_norm:
        # The expert count under both names transformers has read it (num_experts before v5).
        config.update(model_type="qwen3_moe", num_experts=cfg.moe_experts, num_local_experts=cfg.moe_experts,
                      num_experts_per_tok=cfg.moe_top_k, moe_intermediate_size=cfg.expert_dim,
                      norm_topk_prob=cfg.moe_top_k > 1, decoder_sparse_step=1,
                      mlp_only_layers=list(range(cfg.moe_dense_layers)), router_aux_loss_coef=cfg.moe_aux_loss,
                      output_router_logits=False)
    elif cfg.moe:
        config.update(model_type="mixtral", num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                      intermediate_size=cfg.expert_dim, router_aux_loss_coef=cfg.moe_aux_loss,
                      router_jitter_noise=0.0, output_router_logits=False, sliding_window=cfg.sliding_window)
        config.pop("mlp_bias")
    return config


def export_hf(run_dir: str | Path, out: str | Path, dtype: str = "float32", step: int | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES, average: int = 1, ema: bool = False) -> Exported:
    """Write the run's newest complete checkpoint (or the one of `step`; with `average`, the mean
    of its weights and those of the average - 1 complete checkpoints before it; with `ema`, the
    moving average of the weights it holds, train.ema_decay's; with both, the mean of those
    checkpoints' moving averages) to `out` as a
    Hugging Face model directory; `out` must not exist or be empty. float32 keeps the trained
    weights exactly; bfloat16 or float16 halve the files."""
    out = Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if average < 1:
        raise ExportError(f"average {average}: average at least 1 checkpoint (1: the checkpoint on its own)")
    if max_shard_bytes < 1:
        raise ExportError(f"the largest shard must be at least 1 byte, got {max_shard_bytes}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{str(out)!r} is a file; give the path of a new directory for the Hugging Face model")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"{str(out)!r} already exists and is not an empty directory; give a new path "
                          "(an export never overwrites files)")
    tokenizer_json = Path(run_dir) / "tokenizer.json"
    if (Path(run_dir) / "config.toml").is_file():  # before loading any weights
        problem = export_problem(load_config(Path(run_dir) / "config.toml").model)
        if problem:
            raise ExportError(f"{str(run_dir)!r} is a model no Hugging Face architecture computes ({problem})")
    if (Path(run_dir) / "config.toml").is_file() and not tokenizer_json.is_file():
        source = next(iter(load_config(Path(run_dir) / "config.toml").data.sources.values())) / "tokenizer.json"
        raise ConfigError(f"run directory {str(run_dir)!r} has no tokenizer.json (training copies it there from "
                          f"its data, {str(source)!r}); copy the tokenizer the run trained with into it")

    import torch
    from safetensors.torch import save_file

    from scaletrain.data.tokenizer import eos_id as find_eos, fim_ids, load_tokenizer
    from scaletrain.generate import data_bos_id, load_model
    from scaletrain.model.flops import param_counts

    model, cfg, step = load_model(run_dir, step=step, average=average, ema=ema)
    tokenizer = load_tokenizer(tokenizer_json)
    eos_id = find_eos(tokenizer)
    eos = tokenizer.id_to_token(eos_id)
    bos_id = data_bos_id(run_dir, cfg)  # (documents begun with it in training: so are texts given the export)
    bos = eos if bos_id is None else tokenizer.id_to_token(bos_id)
    first_id = eos_id if bos_id is None else bos_id  # what begins a text (a generation's first token)
    weights = {}
    for name, tensor in model.state_dict().items():
        if cfg.model.tie_embeddings and name == "output.weight":
            continue  # tied: one tensor, in the embedding
        if name.startswith("mtp."):
            continue  # multi-token prediction (model.mtp_depth) serves training: not part of the model
        names = hf_names(cfg.model, name)
        for hf, part in zip(names, tensor.unbind(0) if ".experts." in name else [tensor]):  # experts one by one
            weights[hf] = part.detach().to(getattr(torch, dtype)).contiguous()

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
        _write_json(staging / "config.json", hf_config(cfg.model, dtype, eos_id, first_id))
        _write_json(staging / "generation_config.json",
                    {"bos_token_id": first_id, "eos_token_id": eos_id, "do_sample": True, "temperature": 0.8,
                     "top_k": 50})
        shutil.copyfile(tokenizer_json, staging / "tokenizer.json")
        if bos_id is None and tokenizer.encode("a").ids != tokenizer.encode("a", add_special_tokens=False).ids:
            # Its post-processor begins texts with a token the run's documents did not begin with (a
            # Llama tokenizer on data prepared with --no-bos): left out, or every text would begin with it.
            saved = json.loads(tokenizer_json.read_text())
            _write_json(staging / "tokenizer.json", {**saved, "post_processor": None})
        # split_special_tokens: "<|endoftext|>" written in a text is encoded as text, as in training
        # (data/tokenizer.py); only the token appended between documents ends one. Not where the
        # model learned fill-in-the-middle: the clients that ask it to infill (transformers, vLLM,
        # editors) write its sentinels into the prompt's text, as Qwen's and StarCoder's tokenizers take them.
        _write_json(staging / "tokenizer_config.json",
                    {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                     "add_bos_token": bos_id is not None, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                     "split_special_tokens": fim_ids(tokenizer) is None, "model_max_length": cfg.model.max_seq_len})
        counts = param_counts(cfg.model)
        (staging / "README.md").write_text(_model_card(Path(run_dir), cfg, step, counts["total"] - counts["mtp"],
                                                       dtype, average, ema))
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


def _model_card(run_dir: Path, cfg, step: int, params: int, dtype: str, average: int = 1, ema: bool = False) -> str:
    from scaletrain.train.metrics import read_metrics

    evals = [r for r in read_metrics(run_dir, "eval") if r["step"] <= step] if (run_dir / "metrics.jsonl").is_file() else []
    m = cfg.model
    decay = f"decay {cfg.train.ema_decay:g} a step"
    weights = ""  # what the exported weights are, where not the checkpoint's own
    if average > 1:
        weights = (f"the mean of the moving averages of the run's weights ({decay}) held by that checkpoint" if ema
                   else "the mean of that checkpoint's") + f" and the {average - 1} before it"
    elif ema:
        weights = f"the moving average of the run's, {decay}"
    lines = [
        f"# {cfg.run.name}",
        "",
        f"A {params:,}-parameter decoder pre-trained with scaletrain (run `{cfg.run.name}`, step {step:,}"
        + (f", its weights {weights}" if weights else "") + f"), exported in {dtype}.",
        "",
        "| | |",
        "|---|---|",
        f"| layers, width, heads (key/value) | {m.n_layers}, {m.dim}, {m.n_heads} ({m.kv_heads}) |",
        f"| MLP width, vocabulary, context | {m.hidden_dim}, {m.vocab}, {m.max_seq_len} |",
        f"| QK-norm, tied embeddings | {'yes' if m.qk_norm else 'no'}, {'yes' if m.tie_embeddings else 'no'} |",
    ]
    if m.moe:
        lines.append(f"| experts (each token to), expert width, dense blocks first | {m.moe_experts} ({m.moe_top_k}), "
                     f"{m.expert_dim}, {m.moe_dense_layers} |")
    if m.mup_base_dim:
        lines.append(f"| trained under muP, base width | {m.mup_base_dim} (the output multiplier is in the head's "
                     "weights: a plain model) |")
    if m.mup_base_layers:
        lines.append(f"| trained under depth-wise muP (CompleteP, alpha {m.mup_depth_alpha:g}), base depth | "
                     f"{m.mup_base_layers} (the residual multiplier is in wo's and w2's weights: a plain model) |")
    if evals:  # the loss of the weights exported, as training measured it
        last = evals[-1]
        where = f"at step {last['step']:,} ({last['tokens']:,} tokens)"
        if average > 1:  # (no evaluation measured a mean of checkpoints)
            lines.append(f"| validation loss of the run's own weights {where}; not of the mean exported (`scaletrain "
                         f"eval --average {average}{' --ema' if ema else ''}` measures it) | {last['loss']:.4f} |")
        elif ema and "ema_loss" in last:
            lines.append(f"| validation loss of the moving average {where} | {last['ema_loss']:.4f} |")
        elif not ema:
            lines.append(f"| validation loss {where} | {last['loss']:.4f} |")
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


_CONTEXT = {"llama": 2048, "mistral": 131072, "qwen3": 32768, "qwen3_moe": 32768, "mixtral": 131072}
"""max_position_embeddings of the transformers config classes, where a config.json leaves it out."""


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
    if kind not in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral"):
        problems.append(f"model_type {kind!r} (supported: llama, mistral, qwen3, qwen3_moe, mixtral)")
    # Unset keys take the transformers config classes' defaults (Qwen3-MoE: 128 experts, 8 a
    # token; Mixtral: 8, 2).
    experts = (hf.get("num_experts", hf.get("num_local_experts", 128 if kind == "qwen3_moe" else 8))
               if kind in ("qwen3_moe", "mixtral") else 0)
    top_k = hf.get("num_experts_per_tok", 8 if kind == "qwen3_moe" else 2)
    dense = hf.get("mlp_only_layers") or []
    if kind == "qwen3_moe":
        if dense != list(range(len(dense))):
            problems.append(f"mlp_only_layers {dense} (dense blocks must come first)")
        if hf.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step {hf['decoder_sparse_step']} (every block after the dense ones "
                            "is a mixture)")
        if bool(hf.get("norm_topk_prob", False)) != (top_k > 1):
            problems.append(f"norm_topk_prob {hf.get('norm_topk_prob', False)} with {top_k} experts per token "
                            "(scaletrain renormalises the weights of several experts and not of one)")
    if kind == "mixtral" and top_k == 1:
        problems.append("one expert per token weighted by 1 (scaletrain weights it by its router probability)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (SwiGLU needs silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key} true (the decoder has no biases)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", *_ROPE_KEYS):
        problems.append(f"rotary scaling {rope_type!r} (plain RoPE, Llama 3.1's, YaRN and linear only"
                        + ("; dynamic scaling changes with each input's length, which training does not)"
                           if rope_type == "dynamic" else ")"))
    needed = [key for key in _ROPE_KEYS.get(rope_type, ()) if rope.get(key) is None]
    if rope_type == "yarn":  # transformers' defaults: the original length is the model's, the factor their ratio
        needed = [key for key in needed if key not in ("factor", "original_max_position_embeddings")]
    if needed:
        problems.append(f"rotary scaling {rope_type!r} without {', '.join(needed)}")
    if rope_type == "yarn" and rope.get("truncate") is False:
        problems.append("YaRN's ramp without truncation (truncate false)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {rope['partial_rotary_factor']} (every dimension rotates)")
    # MistralConfig's defaults: a window of 4,096 tokens in a context of 131,072 (Mixtral's: none).
    # (One that spans a run's sequences is causal attention there: check_matches.)
    window = hf.get("sliding_window", 4096 if kind == "mistral" else None) if kind in ("mistral", "mixtral") else None
    full_layers = None
    if kind in ("qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        window = hf.get("sliding_window", 4096)  # (Qwen3Config's default)
        if kind == "qwen3":  # (Qwen3-MoE's window covers every block)
            layers = hf.get("num_hidden_layers", 0)
            kinds = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                              else "full_attention" for i in range(layers)]
            if set(kinds) - {"sliding_attention", "full_attention"}:
                problems.append(f"layer_types {sorted(set(kinds) - {'sliding_attention', 'full_attention'})} (blocks "
                                "attend within the window or over the whole sequence)")
            full_layers = [i for i, kind_of_layer in enumerate(kinds) if kind_of_layer == "full_attention"] or None
            if window is None or (full_layers is not None and len(full_layers) == len(kinds)):
                window = full_layers = None  # (no window, or every block whole: causal attention)
    if problems:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} holds a model scaletrain's decoder does not "
                          f"compute: {'; '.join(problems)}")
    head_dim = hf.get("head_dim", 128 if kind == "qwen3" else None)  # Qwen3Config's default is 128, not width/heads
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} has head_dim {head_dim} x "
                          f"{hf['num_attention_heads']} heads, not its hidden_size {hf['hidden_size']}; "
                          "scaletrain's heads split the width exactly")
    settings = {ours: hf[theirs] for ours, theirs in _SETTINGS.items() if theirs in hf}
    settings.setdefault("tie_embeddings", False)  # transformers' default for these architectures
    settings["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    settings["max_seq_len"] = hf.get("max_position_embeddings", _CONTEXT.get(kind, 2048))
    if rope_type != "default":
        settings["rope_scaling"] = _our_rope_scaling(rope_type, rope, settings["max_seq_len"])
    settings["qk_norm"] = kind in ("qwen3", "qwen3_moe")
    if window is not None:
        settings["sliding_window"] = window
    if full_layers is not None:
        settings["full_attention_layers"] = full_layers
    if experts:
        settings.update(moe_experts=experts, moe_top_k=top_k, moe_dense_layers=len(dense))
        if kind == "qwen3_moe":
            settings["moe_ffn_dim"] = hf.get("moe_intermediate_size", 768)  # Qwen3MoeConfig's default
        else:  # Mixtral's intermediate_size is its experts' width; it has no dense block
            settings["moe_ffn_dim"] = settings.pop("ffn_dim")
    return settings


def check_matches(cfg: ModelConfig, hf_dir: str | Path) -> None:
    """ConfigError naming every model.* setting that differs from the Hugging Face model's and the
    values to set (max_seq_len may differ: the rotary tables are computed, not loaded)."""
    want = model_settings(hf_dir)
    want.setdefault("moe_experts", 0)
    want.setdefault("rope_scaling", None)
    # A window that spans the run's sequences computes causal attention there, with or without it
    # (Mistral 7B v0.2 on has none; a run exported with one as long as its context has one).
    want["sliding_window"] = effective_window(want.get("sliding_window"), cfg.max_seq_len)
    want["full_attention_layers"] = want.get("full_attention_layers") if want["sliding_window"] else None
    window, full = effective_window(cfg.sliding_window, cfg.max_seq_len), cfg.full_attention_layers
    if window is not None and full is not None and len(full) == cfg.n_layers:
        window = full = None  # (every block whole: causal attention, as a model without a window)
    if cfg.moe_shared_experts and want["moe_experts"]:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} has no shared experts; set "
                          "model.moe_shared_experts = 0")
    have = {"vocab_size": cfg.vocab, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.kv_heads, "ffn_dim": cfg.hidden_dim, "norm_eps": cfg.norm_eps,
            "tie_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
            "rope_scaling": _without_defaults(cfg.rope_scaling),
            "qk_norm": cfg.qk_norm, "moe_experts": cfg.moe_experts,
            "sliding_window": window, "full_attention_layers": full if window is not None else None}
    if want["moe_experts"]:
        have.update(moe_top_k=cfg.moe_top_k, moe_ffn_dim=cfg.expert_dim, moe_dense_layers=cfg.moe_dense_layers)
    wrong = [key for key in have if key in want and have[key] != want[key]]
    if wrong:
        fix = " ".join(f"model.{key}={toml_value(want[key])}" if want[key] is not None else f"nothing for model.{key} (remove it)"
                       for key in wrong)
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} holds another shape: "
                          + ", ".join(f"model.{key} is {have[key]}, the model's is {want[key]}" for key in wrong)
                          + f"; set {fix}")


def check_tokenizer(model_dir: str | Path, data_tokenizer: str | Path, given: str | None = None) -> None:
    """ConfigError when the model directory's tokenizer.json (if it has one; a run directory keeps
    its data's) maps tokens to other ids than the tokenizer the data was prepared with: the model
    would read the data as other words. `given`: checkpoint.init_from as written, for the message."""
    from scaletrain.data.tokenizer import load_tokenizer

    model_tokenizer = Path(model_dir) / "tokenizer.json"
    if not model_tokenizer.is_file():
        return
    if load_tokenizer(model_tokenizer).get_vocab() != load_tokenizer(data_tokenizer).get_vocab():
        raise ConfigError(f"checkpoint.init_from = {given or str(model_dir)!r}: its tokenizer is not the one the data was "
                          f"prepared with ({data_tokenizer}); prepare the data with `scaletrain data prepare "
                          f"--tokenizer {model_tokenizer}`")


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
    keys = {name: hf_names(cfg, name) for name in _our_names(cfg)
            if not (cfg.tie_embeddings and name == "output.weight")}  # tied: the embedding's tensor
    wanted = {key: name for name, names in keys.items() for key in names}
    found = {}
    for file in files:
        if not (hf_dir / file).is_file():
            raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} lacks {file}; give a directory with the "
                              "model's safetensors weights")
        with safe_open(hf_dir / file, framework="pt") as f:  # one tensor at a time, not whole shards
            for key in f.keys():
                if key in wanted:
                    found[key] = f.get_tensor(key).to(torch.float32)
    missing = [key for key in wanted if key not in found]
    if missing:
        raise ConfigError(f"checkpoint.init_from = {str(hf_dir)!r} has no tensor {missing[0]}"
                          + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
    ours = {name: torch.stack([found[key] for key in names]) if ".experts." in name else found[names[0]]
            for name, names in keys.items()}  # an expert stack from its experts
    if cfg.tie_embeddings:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    if cfg.moe_bias_update:  # continued training with balancing biases, from none
        ours.update({f"layers.{i}.feed_forward.expert_bias": torch.zeros(cfg.moe_experts)
                     for i in range(cfg.n_layers) if cfg.is_moe_layer(i)})
    return ours


def _our_names(cfg: ModelConfig) -> list[str]:
    """The names of Transformer(cfg)'s parameters, without building it."""
    optional = ("attention.q_norm.weight", "attention.k_norm.weight")
    moe = ("feed_forward.router.weight", *(f"feed_forward.experts.{w}" for w in ("w1", "w2", "w3")))
    return ["tok_embeddings.weight", "norm.weight", "output.weight",
            *(f"layers.{i}.{rest}" for i in range(cfg.n_layers)
              for rest in [*_BLOCK_NAMES, *(moe if cfg.is_moe_layer(i) else ())]
              if (cfg.qk_norm or rest not in optional) and not (cfg.is_moe_layer(i) and rest.startswith("feed_forward.w")))]
