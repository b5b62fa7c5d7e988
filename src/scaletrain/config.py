"""RunConfig: everything that defines a run, loaded from TOML with dotted overrides.

Each field is documented where it is defined; the README's config reference is
`reference_markdown()` of these docstrings (a test keeps the two equal). Validation happens up front, so a
bad key, type or value stops the run before any work, with a message that names the key,
the value and what would be valid.
"""

from __future__ import annotations

import copy
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scaletrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A config that cannot be run; the message says which key is wrong and what would be right."""


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this type takes true/false (pydantic's lax mode reads true as 1 elsewhere)."""
    if annotation is bool or annotation is Any:
        return True
    return any(_admits_bool(arg) for arg in get_args(annotation))


def _kind_of(annotation: Any) -> str:
    """A field's type in words: "a whole number", "a number or 'auto'"."""
    words = {int: "a whole number", float: "a number", str: "text", type(None): ""}
    if annotation in words:
        return words[annotation]
    origin = get_origin(annotation)
    if origin is Annotated:
        return _kind_of(get_args(annotation)[0])
    if origin in (dict, list, tuple):
        return {dict: "a table, e.g. {key = 1}", list: "a list, e.g. [1, 2]", tuple: "a list, e.g. [1, 2]"}[origin]
    if origin is Literal:
        return ("one of " if len(get_args(annotation)) > 1 else "") + ", ".join(map(repr, get_args(annotation)))
    kinds = [_kind_of(arg) for arg in get_args(annotation)]
    return " or ".join(dict.fromkeys(k for k in kinds if k)) or "another kind of value"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class RunSection(_Section):
    model_config = ConfigDict(coerce_numbers_to_str=True)

    name: str = "run"
    """Name of the run; the run directory is `dir/name`."""
    dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = Field(default=0, ge=0, lt=2**63)
    """Seeds the model initialisation and, unless data.seed is set, the data order."""

    @model_validator(mode="after")
    def _check_name(self) -> RunSection:
        name = self.name
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(f"run.name = {name!r} must name one folder inside run.dir (not empty, no '/', not '.' "
                             "or '..'), e.g. run.name=llama-1b")
        return self


# model.rope_scaling's kinds: {type: (keys it must give, keys it may give)}; no type is Llama 3.1's.
ROPE_SCALING = {"llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"), ()),
                "yarn": (("factor", "original_max_seq_len"), ("beta_fast", "beta_slow", "attention_factor")),
                "linear": (("factor",), ())}
ROPE_EXAMPLES = {"llama3": "{factor = 8, low_freq_factor = 1, high_freq_factor = 4, original_max_seq_len = 8192}",
                 "yarn": '{type = "yarn", factor = 4, original_max_seq_len = 4096}',
                 "linear": '{type = "linear", factor = 4}'}
ROPE_NAMES = {"llama3": "Llama 3.1's", "yarn": "YaRN", "linear": "linear"}
# YaRN's defaults (Peng et al. 2023, and transformers'): the ramp between the dimensions turning
# 32 and 1 times over the original context, and the attention factor 0.1 ln s + 1.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def yarn_attention_factor(factor: float) -> float:
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def check_rope_scaling(scaling: dict) -> None:
    """ValueError, naming what would be valid, for a model.rope_scaling that is not one of ROPE_SCALING's."""
    kind = scaling.get("type", "llama3")
    if kind not in ROPE_SCALING:
        raise ValueError(f"model.rope_scaling: type {kind!r} is not one of {', '.join(map(repr, ROPE_SCALING))} "
                         f"(e.g. {ROPE_EXAMPLES['yarn']})")
    required, optional = (set(keys) for keys in ROPE_SCALING[kind])
    numbers = {key: value for key, value in scaling.items() if key != "type"}
    if (not required <= set(numbers) <= required | optional
            or not all(isinstance(v, float) and 0 < v < math.inf for v in numbers.values())):
        allowed = f" (and may give {', '.join(sorted(optional))})" if optional else ""
        raise ValueError(f"model.rope_scaling = {scaling} must give positive {', '.join(sorted(required))}{allowed} "
                         f"for {ROPE_NAMES[kind]} scaling, e.g. {ROPE_EXAMPLES[kind]}, "
                         "or be left unset for plain RoPE")
    if "original_max_seq_len" in numbers and numbers["original_max_seq_len"] != int(numbers["original_max_seq_len"]):
        raise ValueError(f"model.rope_scaling: original_max_seq_len {numbers['original_max_seq_len']} "
                         "must be a whole number of positions")
    if kind == "llama3" and numbers["high_freq_factor"] <= numbers["low_freq_factor"]:
        raise ValueError(f"model.rope_scaling: high_freq_factor {numbers['high_freq_factor']} must "
                         f"exceed low_freq_factor {numbers['low_freq_factor']}")
    fast, slow = numbers.get("beta_fast", YARN_BETA_FAST), numbers.get("beta_slow", YARN_BETA_SLOW)
    if kind == "yarn" and fast <= slow:
        raise ValueError(f"model.rope_scaling: beta_fast {fast} must exceed beta_slow {slow}")


def effective_window(window: int | None, seq_len: int) -> int | None:
    """A sliding window as it acts on sequences of up to seq_len tokens: None where there is
    none or it spans them (causal attention)."""
    return window if window is not None and window < seq_len else None


def float16_problems(*, tp: int = 1, cp: int = 1, pp: int = 1, moe: bool = False, float8: bool = False,
                     loss_chunk_tokens: int = 0) -> list[str]:
    """What float16's loss scaling does not reach, each named as its setting: tensor, context and
    pipeline parallelism (their losses are split or scheduled), a mixture of experts (its balance
    enters the gradients from inside the blocks), float8, and the chunked loss (its float16
    product of the logits' gradient and the hidden states is formed before any scale could keep
    it in range). Train refuses them under train.dtype = float16 and computes them in float32
    under auto on a GPU without bfloat16; the planner times them so."""
    return [what for what, bad in (
        (f"parallel.tp = {tp}", tp > 1), (f"parallel.cp = {cp}", cp > 1), (f"parallel.pp = {pp}", pp > 1),
        ("a mixture of experts (model.moe_experts)", moe), ("train.float8", float8),
        (f"train.loss_chunk_tokens = {loss_chunk_tokens}", loss_chunk_tokens > 0)) if bad]


def float8_problem(capable: bool, where: str, tp: int = 1) -> str | None:
    """Why train.float8 cannot run, in one sentence, or None: on a device that is not `capable` (an
    NVIDIA GPU of compute capability 8.9 or newer; `where` names the device), or with tensor
    parallelism. Train refuses it (train/float8.py) and the planner plans none (plan/planner.py)."""
    if not capable:
        return (f"train.float8 = true needs an NVIDIA GPU of compute capability 8.9 or newer (H100, H200, L4, "
                f"RTX 40xx); this run is on {where}: leave train.float8 false")
    if tp > 1:
        return ("train.float8 = true is not supported with parallel.tp > 1 yet; use FSDP (parallel.dp_shard) for "
                "float8 runs or leave train.float8 false")
    return None


def check_float16(problems: list[str]) -> None:
    """ConfigError naming float16_problems' `problems`, where there are any."""
    if problems:
        raise ConfigError(f"train.dtype = float16 scales the loss on one device or data-parallel layouts of a dense "
                          f"model, not with {', '.join(problems)}; use train.dtype = float32 (or bfloat16 on a GPU "
                          "that has it)")


def masked_attention(cfg: Any, seq_len: int) -> bool:
    """Attention over sequences of seq_len tokens is masked beyond causal: within documents, or
    within a window shorter than them (cfg: ModelConfig's fields; the planner's stand-ins too)."""
    return bool(getattr(cfg, "document_mask", False)) or \
        effective_window(getattr(cfg, "sliding_window", None), seq_len) is not None


class ModelConfig(_Section):
    """Shape of a Llama-style decoder. `model/flops.py` counts parameters and FLOPs from it."""

    vocab_size: int | None = Field(default=None, ge=1)
    """Embedding rows. Unset: the data directory's tokenizer size rounded up to a multiple of 64."""
    dim: int = Field(default=256, ge=1)
    """Width of the residual stream."""
    n_layers: int = Field(default=4, ge=1)
    """Number of transformer blocks."""
    n_heads: int = Field(default=4, ge=1)
    """Attention (query) heads; `dim` must be divisible by it."""
    n_kv_heads: int | None = Field(default=None, ge=1)
    """Key/value heads for grouped-query attention. Unset: equal to `n_heads` (multi-head)."""
    ffn_dim: int | None = Field(default=None, ge=1)
    """Hidden width of the SwiGLU MLP. Unset: 8/3 x dim rounded up to a multiple of 64 (Llama)."""
    max_seq_len: int = Field(default=1024, ge=1)
    """Longest sequence the rotary tables are built for."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """Base of the rotary embedding frequencies."""
    rope_scaling: dict[str, float | str] | None = None
    """Rotary frequency scaling, for a context longer than the model was trained on (unset: plain RoPE). Llama 3.1's, e.g. {factor = 8, low_freq_factor = 1, high_freq_factor = 4, original_max_seq_len = 8192}: wavelengths longer than original_max_seq_len / low_freq_factor are stretched by factor, those shorter than original_max_seq_len / high_freq_factor kept, those between interpolated (Llama 3.1 and 3.2). {type = "yarn", factor = 4, original_max_seq_len = 4096}: YaRN (Peng et al. 2023; DeepSeek-V3, Qwen): frequencies turning fewer than beta_slow (default 1) times over original_max_seq_len divided by factor, more than beta_fast (32) times kept, a linear ramp over the dimensions between, and the attention logits scaled by attention_factor^2 (default (0.1 ln factor + 1)^2). {type = "linear", factor = 4}: position interpolation (Chen et al. 2023), every frequency divided by factor."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """Epsilon of RMSNorm."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head before attention (stabilises large learning rates)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection. Under pipeline parallelism the last stage holds a copy of the embedding as its head: its gradient is added to the first stage's each step, whose optimizer steps the embedding, and the copy takes the result (between two ranks under looping schedules; within rank 0 under the V-shaped ones, which run the first and the last stage there)."""
    document_mask: bool = False
    """Attention within documents: a token of a packed training sequence attends only to the tokens of its own document (from the one after the previous end-of-document token on), as Llama 3 was trained (Llama Team 2024, section 3.2), instead of to every earlier token of the sequence. Generation is unchanged (a prompt is one document)."""
    sliding_window: int | None = Field(default=None, ge=1)
    """Sliding-window attention (Mistral 7B's, Jiang et al. 2023): each token attends to itself and the sliding_window - 1 tokens before it (within its document, with document_mask), in training, evaluation and generation; information still travels further through the layers; full_attention_layers takes some blocks out of it. Exported as MistralForCausalLM (Qwen3ForCausalLM with qk_norm, Qwen3-MoE or Mixtral for a mixture). Its FLOPs are counted as causal attention's over the whole sequence (the MFU convention); the compute it saves is taken with attention_kernel = "flex". Not with context parallelism. Unset: causal attention over the whole sequence."""
    full_attention_layers: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    """With sliding_window: the blocks (numbered from 0) that attend over the whole sequence (causal, within documents with document_mask) while the others attend within the window — local and global layers interleaved, as Gemma 2 (every other block), Gemma 3 (one in six: [5, 11, 17, ...]) and gpt-oss were trained: long-range attention at a fraction of the cost of every block's. Multi-token prediction's depths attend as the last block. Exported as Qwen3ForCausalLM's layer_types (which needs qk_norm; a mixture is refused; transformers versions that read only max_window_layers take it for whole blocks first, then windowed ones). `scaletrain tune`'s shallower proxy keeps those below its depth. Unset: every block within the window."""
    attention_kernel: Literal["sdpa", "flex"] = "sdpa"
    """How masked attention (document_mask, a sliding_window shorter than the sequence) is computed on a GPU. "sdpa": PyTorch's scaled_dot_product_attention with the mask as a tensor of the scores' shape, one for all blocks (two with full_attention_layers within documents): its memory-efficient kernel computes every score and masks it, as if unmasked. "flex": FlexAttention (torch.nn.attention.flex_attention, compiled; Dong et al. 2024) with a block mask, which skips the blocks of scores the mask removes wholly (a window of W computes about W / T of the scores) and keeps no mask of the scores' shape; the planner times attention so. Unmasked causal attention stays SDPA's (FlashAttention) either way, as does decoding with a KV cache. On a CPU, where torch's FlexAttention has no backward, and under context parallelism (whose attention over gathered keys and values takes SDPA's masks), "flex" computes with "sdpa"'s mask: the same attention. Holds no weight."""
    init_std: float = Field(default=0.02, gt=0)
    """Std of the normal initialisation; output projections get init_std / sqrt(2 * n_layers) (under mup_base_layers, see there)."""
    mup_base_dim: int | None = Field(default=None, ge=1)
    """Maximal update parametrization (muP; Yang et al. 2022, Tensor Programs V), so that the learning rate, init_std and weight decay found best at width mup_base_dim stay best at width dim: with m = dim / mup_base_dim, the blocks' matrices start at init_std / sqrt(m) and learn at lr / m (under Muon lr / sqrt(m): its orthogonal update's spectral norm grows as sqrt(width)), the output head (and a mixture's routers) start at init_std / m and learn at lr / m, the embedding and the norms as at the base width; every matrix that learns more slowly decays by as much more (weight_decay x m, or x sqrt(m)), so that the decay per step, lr x weight_decay, stays the base width's (Wang and Aitchison 2024; as CompleteP's reference code scales it). Adam's eps is eps / m where muP's gradients shrink as 1 / width (the blocks' matrices, the embedding, the norms), as CompleteP's reference code has it, so that it stays as small beside them as at the base width. The logit multiplier 1 / m of Yang et al. and MiniCPM is folded into the head's weight (its decay x m, its eps the base width's: the same training under Adam as the multiplier written out, a plain Llama to export; gradient-norm clipping and the logged gradient norms count the head's and routers' gradients times 1 / m, as with the multiplier written out). Widths grow together (ffn_dim and the heads in proportion to dim, heads of a fixed width, as the sweep's shapes and Llama's sizes do); not with tied embeddings, whose two uses muP starts and steps differently. Unset: the standard parametrization."""
    mup_base_layers: int | None = Field(default=None, ge=1)
    """Depth-wise muP, CompleteP (Dey et al. 2025, "Don't be lazy: CompleteP enables compute-efficient deep transformers", table 1; Bordelon et al. 2023 and Yang et al. 2023 for alpha 1/2), so that the learning rate, init_std and weight decay found best at mup_base_layers blocks stay best at n_layers: with d = n_layers / mup_base_layers, each block's attention and MLP outputs enter the residual stream multiplied by d^-alpha, the blocks' matrices and norms learn at lr x d^(alpha - 1) with Adam's eps x d^-alpha, and the output projections start as at the base depth (init_std / sqrt(2 x mup_base_layers)); the embedding, the final norm, the head and the multi-token-prediction modules (one block each, whatever the depth) as at the base depth. The multiplier is folded into the output projections (wo, w2: started d^-alpha as large, learning at lr / d, decay x d^alpha, Adam's eps as at the base), the same training under Adam and Muon (whose updates do not depend on the gradient's scale) and a plain Llama to export; gradient-norm clipping and the logged gradient norms count wo's and w2's gradients times d^-alpha, as with the multiplier written out. Combines with mup_base_dim (the width's factors multiply). Unset: no depth scaling."""
    mup_depth_alpha: float = Field(default=1.0, ge=0.5, le=1.0)
    """The exponent alpha of mup_base_layers' residual multiplier d^-alpha: 1 is CompleteP (every block keeps learning non-linear features as depth grows, and the one Dey et al. found best), 1/2 the depth-muP of Yang et al. 2023 and Bordelon et al. 2023."""
    mtp_depth: int = Field(default=0, ge=0)
    """Multi-token prediction (DeepSeek-V3, Liu et al. 2024, section 2.2): this many extra modules, chained, the k-th predicting the token k + 1 places ahead: at each position it joins the previous depth's hidden state (the trunk's, for the first) with the embedding of the token k places ahead (each RMS-normalised, concatenated, projected from 2 x dim to dim), runs one dense transformer block over them and scores the shared output head; the mean of their losses, times train.mtp_weight, joins the training objective (a denser training signal), not the reported loss. Training only: evaluation, generation and export use the trunk (an export leaves the modules out). Trains under data, tensor, context, expert and pipeline parallelism (on the last stage, beside a copy of the embedding the depths read; under the V-shaped schedules that stage shares rank 0 with the embedding, as DeepSeek-V3 placed them). 0: off."""
    moe_experts: int = Field(default=0, ge=0)
    """Routed experts of each mixture-of-experts block (0: a dense model): the block's MLP becomes moe_experts SwiGLU experts, each token sent to moe_top_k of them."""
    moe_top_k: int = Field(default=2, ge=1)
    """Experts each token is routed to (their outputs weighted by their router scores, renormalised over the k: see moe_score)."""
    moe_score: Literal["softmax", "sigmoid"] = "softmax"
    """How the router scores the experts for a token: a softmax over all of them (Switch, Mixtral, Qwen3-MoE) or each expert's own sigmoid (DeepSeek-V3); the top k by score are chosen, weighted by their scores renormalised over the k (by the score itself when k = 1)."""
    moe_ffn_dim: int | None = Field(default=None, ge=1)
    """Hidden width of each expert. Unset: the dense MLP width (ffn_dim)."""
    moe_shared_experts: int = Field(default=0, ge=0)
    """Experts every token also goes through (DeepSeekMoE's shared experts), each moe_ffn_dim wide."""
    moe_dense_layers: int = Field(default=0, ge=0)
    """The first this many blocks keep a dense MLP (as DeepSeek-V3's first three)."""
    moe_bias_update: float = Field(default=0.0, ge=0)
    """Auxiliary-loss-free balancing (DeepSeek-V3): each expert gets a routing bias, added to its router probability when choosing a token's top-k (not to the weight of its output), moved by this much after each step toward balance (up for experts that got fewer than the mean of the global batch's assignments, down for those that got more); 0: off. DeepSeek-V3 used 0.001 on sigmoid scores; softmax probabilities are about 1/moe_experts."""
    moe_groups: int = Field(default=1, ge=1)
    """Expert groups for group-limited routing (DeepSeek-V3's node-limited routing): the routed experts split into this many equal groups of consecutive experts; under parallel.ep, consecutive ranks hold consecutive experts, so a group per node keeps each token's all-to-all within moe_group_limit nodes. 1: no groups."""
    moe_group_limit: int | None = Field(default=None, ge=1)
    """Groups each token may take its experts from: the moe_group_limit groups whose best ceil(moe_top_k / moe_group_limit) experts score highest in sum (DeepSeek-V3 sent each token to at most 4 of its 8 nodes' groups). Unset: every group (no limit)."""
    moe_aux_loss: float = Field(default=0.01, ge=0)
    """Weight of the load-balancing loss E x sum_i f_i P_i of each MoE block (Switch Transformer; f_i: share of routed tokens, P_i: mean router probability of expert i; 1 when balanced), whose sum over blocks is added to the training objective; logged per block as moe_balance."""

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim = {self.dim} is not divisible by model.n_heads = {self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(
                f"model.n_heads = {self.n_heads} is not divisible by model.n_kv_heads = {kv}; "
                "grouped-query attention needs each key/value head to serve a whole number of query heads"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head dimension dim / n_heads = {self.dim // self.n_heads} is odd; rotary embeddings need it even"
            )
        if self.mup_base_dim is not None and self.tie_embeddings:
            raise ValueError("model.mup_base_dim is set with model.tie_embeddings = true; muP initialises and "
                             "steps the embedding and the output head differently, so untie them "
                             "(model.tie_embeddings = false) or unset model.mup_base_dim")
        if self.mup_base_layers is None and "mup_depth_alpha" in self.model_fields_set and self.mup_depth_alpha != 1.0:
            raise ValueError(f"model.mup_depth_alpha = {self.mup_depth_alpha:g} is set but model.mup_base_layers is "
                             "not; set model.mup_base_layers to the depth the hyperparameters were tuned at, or drop "
                             "model.mup_depth_alpha")
        if self.full_attention_layers is not None:
            if self.sliding_window is None:
                raise ValueError(f"model.full_attention_layers = {self.full_attention_layers} names the blocks that "
                                 "attend over the whole sequence where the others attend within model.sliding_window, "
                                 "which is unset; set a window, or drop model.full_attention_layers")
            wrong = [i for i in self.full_attention_layers if i >= self.n_layers]
            if wrong or len(set(self.full_attention_layers)) < len(self.full_attention_layers):
                raise ValueError(f"model.full_attention_layers = {self.full_attention_layers} "
                                 + (f"names blocks {wrong} of a model of {self.n_layers}; list blocks 0 to "
                                    f"{self.n_layers - 1}" if wrong else "names a block twice; list each once"))
            if self.full_attention_layers != sorted(self.full_attention_layers):  # (one way to write each)
                self.full_attention_layers = sorted(self.full_attention_layers)
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
            if self.rope_scaling.get("type") == "llama3":  # one way to write each: no type is Llama 3.1's
                self.rope_scaling = {key: value for key, value in self.rope_scaling.items() if key != "type"}
        if self.moe_experts:
            if self.moe_top_k > self.moe_experts:
                raise ValueError(f"model.moe_top_k = {self.moe_top_k}"
                                 + ("" if "moe_top_k" in self.model_fields_set else " (its default)")
                                 + f" is more than the model.moe_experts = {self.moe_experts} there are; route to "
                                 "at most all of them")
            if self.moe_experts % self.moe_groups:
                raise ValueError(f"model.moe_groups = {self.moe_groups} does not divide the model.moe_experts = "
                                 f"{self.moe_experts}; groups are equal: use a divisor of {self.moe_experts}")
            limit = self.group_limit
            if limit > self.moe_groups:
                raise ValueError(f"model.moe_group_limit = {limit} is more than the model.moe_groups = "
                                 f"{self.moe_groups} there are; use at most {self.moe_groups}")
            if self.moe_top_k > limit * (self.moe_experts // self.moe_groups):
                raise ValueError(f"model.moe_top_k = {self.moe_top_k} experts cannot be chosen from "
                                 f"model.moe_group_limit = {limit} groups of {self.moe_experts // self.moe_groups}; "
                                 "allow more groups or choose fewer experts")
            if self.moe_dense_layers >= self.n_layers:
                raise ValueError(f"model.moe_dense_layers = {self.moe_dense_layers} leaves none of the "
                                 f"{self.n_layers} blocks a mixture of experts; use fewer, or model.moe_experts = 0")
        else:
            # Set to something other than their defaults (a resolved config writes every field).
            stray = sorted(name for name, info in type(self).model_fields.items()
                           if name.startswith("moe_") and name != "moe_experts" and getattr(self, name) != info.default)
            if stray:
                raise ValueError(f"{', '.join('model.' + name for name in stray)} set, but model.moe_experts = 0 (a "
                                 "dense model); set model.moe_experts to make a mixture of experts, or drop them")
        return self

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def group_limit(self) -> int:
        """The groups a token may take its experts from (moe_group_limit, or all of them)."""
        return self.moe_group_limit or self.moe_groups

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.hidden_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_experts > 0 and index >= self.moe_dense_layers

    def window_of(self, layer: int) -> int | None:
        """The sliding window block `layer` attends within, or None: over the whole sequence (a
        depth of multi-token prediction attends as the last block, layer n_layers - 1)."""
        return None if layer in (self.full_attention_layers or ()) else self.sliding_window

    @property
    def width_mult(self) -> float:
        """muP's width multiplier dim / mup_base_dim (1 in the standard parametrization)."""
        return self.dim / self.mup_base_dim if self.mup_base_dim else 1.0

    @property
    def depth_mult(self) -> float:
        """Depth-wise muP's multiplier n_layers / mup_base_layers (1 without it)."""
        return self.n_layers / self.mup_base_layers if self.mup_base_layers else 1.0

    @property
    def residual_scale(self) -> float:
        """What each block's outputs are multiplied by on their way into the residual stream under
        depth-wise muP, depth_mult^-mup_depth_alpha (folded into wo and w2; 1 without it)."""
        return self.depth_mult ** -self.mup_depth_alpha

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return _round_up(int(8 * self.dim / 3), 64)

    @property
    def vocab(self) -> int:
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is unset; it is filled in from the data directory's tokenizer")
        return self.vocab_size


class DataConfig(_Section):
    path: str = "data/python-stdlib"
    """Data directory written by `scaletrain data prepare`; with `mix`, the directory that holds the mixed ones."""
    mix: dict[str, float] | None = None
    """Train on several data directories under `path` by weight, e.g. {code = 0.3, prose = 0.7}; they must share a tokenizer."""
    seq_len: int = Field(default=256, ge=1)
    """Tokens per training sequence (the model sees seq_len + 1 tokens per sample: inputs and shifted targets)."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    """Seed of the data order (which windows, in which order; a mixture's draws); unset: run.seed. Set apart from run.seed to vary the initialisation and the data order one at a time (OLMo's data_seed), e.g. to tell seed noise from data noise."""

    @model_validator(mode="after")
    def _check_mix(self) -> DataConfig:
        if self.mix is not None:
            if not self.mix:
                raise ValueError("data.mix is empty; name at least one data directory, e.g. {code = 1.0}, or leave it unset")
            bad = {name: weight for name, weight in self.mix.items() if not (0 < weight < math.inf)}
            if bad:
                raise ValueError(f"data.mix weights must be positive finite numbers, got {bad}")
        return self

    @property
    def sources(self) -> dict[str, Path]:
        """Name -> data directory of every source trained on."""
        if self.mix is None:
            return {Path(self.path).name: Path(self.path)}
        return {name: Path(self.path) / name for name in self.mix}

    @property
    def weights(self) -> dict[str, float]:
        if self.mix is None:
            return {name: 1.0 for name in self.sources}
        total = sum(self.mix.values())
        return {name: weight / total for name, weight in self.mix.items()}


def mix_toml(shares: dict[str, float]) -> str:
    """data.mix's TOML value for `shares`, e.g. {code = 0.3, prose = 0.7} (names that are not
    bare TOML keys quoted)."""
    def key(name: str) -> str:
        return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)

    return "{" + ", ".join(f"{key(name)} = {share}" for name, share in shares.items()) + "}"


class TrainConfig(_Section):
    steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to train for. Give exactly one of `steps` and `tokens`."""
    tokens: int | None = Field(default=None, ge=1)
    """Tokens to train for; rounded up to whole steps. Give exactly one of `steps` and `tokens`."""
    global_batch_tokens: int = Field(default=16384, ge=1)
    """Tokens per optimizer step across all processes; a multiple of micro_batch x seq_len."""
    micro_batch: int = Field(default=8, ge=1)
    """Sequences per forward/backward pass; gradients accumulate up to the global batch."""
    batch_ramp: list[tuple[int, int]] = []
    """Smaller global batches first, as [[batch_tokens, until_tokens], ...]: steps of batch_tokens until until_tokens have been trained, then the next pair's, then global_batch_tokens (a batch-size warmup: early in training the loss falls as fast with small batches, which give more steps for the tokens; DeepSeek-V3 grew its batch from 3,072 to 15,360 sequences over its first 469B tokens, Llama 3 405B doubled its batch twice). Each batch below global_batch_tokens and a multiple of micro_batch x seq_len; until_tokens increasing. The learning-rate schedule counts steps; train.tokens counts every step's tokens. Empty: global_batch_tokens throughout."""
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final learning rate as a fraction of `lr` (cosine and WSD)."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warmup: cosine decay, warmup-stable-decay, or constant."""
    warmup_steps: int = Field(default=100, ge=0)
    """Linear warmup to `lr` over this many steps (the first update at `lr` / warmup_steps)."""
    decay_fraction: float = Field(default=0.2, gt=0, le=1)
    """WSD only: fraction of all steps spent in the final decay."""
    decay_shape: Literal["linear", "1-sqrt", "cosine"] = "linear"
    """WSD only: the decay's shape from lr to min_lr: linear; 1-sqrt, lr x (1 - sqrt(progress)) (Hägele et al. 2024 found it matches or beats cosine at a 20% decay, where linear falls short); or half a cosine."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """AdamW; or Muon for the weight matrices inside the blocks (their momentum orthogonalised by Newton-Schulz iterations, Jordan et al. 2024), scaled as Moonlight did so that lr and weight_decay carry over from AdamW, with AdamW for the embedding, output head and vectors. Fixed for a run: its checkpoints hold that optimizer's state."""
    muon_momentum: float = Field(default=0.95, ge=0, lt=1)
    """Muon's (Nesterov) momentum."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay, applied to matrices only (not norms, not biases); Muon's too, decoupled alike."""
    embedding_decay: bool = True
    """Decay the token embedding too (with tied embeddings, the head it is); false leaves it undecayed, as OLMo 2 trained (Team OLMo 2024, "2 OLMo 2 Furious": a stability measure). Fixed for a run: its checkpoints hold the optimizer's groups it sets."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """AdamW beta2."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping. Under muP (model.mup_base_dim, model.mup_base_layers) the norm is that of the gradients with its multipliers written out, which is also the norm logged."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype (autocast; weights, gradients and optimizer stay float32): auto is bfloat16 on GPUs that have it, float16 on those that do not (V100, T4; float32 where float16's scaling does not reach the run) and float32 on CPUs. float16 scales the loss dynamically (Micikevicius et al. 2018, as torch's GradScaler: from 2^16, halved at each step whose gradient overflows, which is skipped, doubled after 2,000 steps without one; checkpointed, and logged as loss_scale), on one device or data-parallel layouts (FSDP, HSDP) of a dense model, without float8 or loss_chunk_tokens; a run whose scale falls below 1 has diverged."""
    compile: bool = False
    """Compile each transformer block with torch.compile (of a mixture-of-experts block, its attention: the routing runs eagerly)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode for the blocks; reduce-overhead and max-autotune replay CUDA graphs (static shapes, one process only)."""
    float8: bool = False
    """Compute the blocks' linear layers in float8 (torchao, dynamic scaling; Hopper-class GPUs; pip install 'scaletrain[float8]'). Weights, optimizer and checkpoints are unchanged."""
    z_loss: float = Field(default=0.0, ge=0)
    """Weight of PaLM's auxiliary z-loss, z x log^2 Z per token (Z: the output softmax's normaliser), which keeps log Z near 0 and training stabler (PaLM used 1e-4). It enters the gradient, not the reported loss. 0: off."""
    mtp_weight: float = Field(default=0.3, ge=0)
    """With model.mtp_depth: the weight of the multi-token prediction loss (the mean over its depths) in the training objective; it enters the gradient, not the reported loss, and is logged as mtp_loss. DeepSeek-V3 used 0.3 for its first 10T tokens, then 0.1."""
    ema_decay: float = Field(default=0.0, ge=0, lt=1)
    """Also keep an exponential moving average of the weights (Polyak averaging), ema <- ema_decay x ema + (1 - ema_decay) x weights after each applied update, from the run's first weights; sharded as the weights are, checkpointed with them. Each evaluation measures it too (ema_loss in the eval records); `scaletrain eval --ema` and `export --ema` take it instead of the weights. A half-life of h steps is ema_decay = 2^(-1/h) (0.999: about 700 steps). Averaged weights approach what annealing the learning rate reaches, without annealing (Sanyal et al. 2023; Hägele et al. 2024 found averaging recovers part of what a cooldown gives, not all). 0: off."""
    loss_chunk_tokens: int = Field(default=0, ge=0)
    """Run the output head and loss this many tokens at a time, never holding a micro-batch's float32 logits (0: all at once); on a pipeline's last stage too. Not under tensor parallelism, whose head is split by vocabulary (the loss then takes the split logits)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks CUDA when available."""
    rewinds: int = Field(default=0, ge=0)
    """Times (per invocation of train) a divergence — a NaN or infinite loss or gradient, or a loss spike (spike_sigmas) — sends the run back to its newest checkpoint from before it (for a spike, from before the update that made it; newer ones are discarded), skipping the batches read since (PaLM's remedy for loss spikes), before the next NaN stops it (and spikes are only logged); 0: the first NaN stops it."""
    spike_sigmas: float = Field(default=0.0, ge=0)
    """Loss-spike detection: a step whose loss (over the global batch) exceeds the running mean of the earlier steps' losses by more than this many running standard deviations is a divergence, rewound as one while train.rewinds last, logged after (OLMo 2 counted losses beyond 7 as spikes). 0: off."""
    spike_window: int = Field(default=100, ge=2)
    """Span in steps of the running mean and variance of the loss that spike_sigmas compares against (plain averages over the first window / 2 steps, exponential ones after); no step is judged before this many have been seen."""
    hang_timeout_s: float = Field(default=900.0, ge=0)
    """After the first step: seconds without a finished step, evaluation or checkpoint after which the process prints every thread's stack and exits with status 75, for the launcher to restart the job from its newest checkpoint (torchrun --max-restarts); 0 disables. Keep it above the slowest checkpoint save and evaluation."""

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compile mode replays CUDA graphs (its cudagraph trees)."""
        return self.compile and self.compile_mode in ("reduce-overhead", "max-autotune")

    @model_validator(mode="after")
    def _check_compile_mode(self) -> TrainConfig:
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"train.compile_mode = {self.compile_mode!r} has no effect without train.compile = true; "
                             "set both or leave compile_mode at 'default'")
        return self

    @model_validator(mode="after")
    def _check_length(self) -> TrainConfig:
        if (self.steps is None) == (self.tokens is None):
            raise ValueError(
                f"give exactly one of train.steps and train.tokens (got steps = {self.steps}, tokens = {self.tokens})"
            )
        return self

    @model_validator(mode="after")
    def _check_ramp(self) -> TrainConfig:
        untils = [until for _, until in self.batch_ramp]
        if any(batch < 1 for batch, _ in self.batch_ramp) or untils != sorted(set(untils)) or min(untils, default=1) < 1:
            raise ValueError(f"train.batch_ramp = {[list(pair) for pair in self.batch_ramp]} must list [batch_tokens, "
                             "until_tokens] pairs of positive numbers with until_tokens increasing, e.g. [[4096, "
                             "1000000], [8192, 3000000]]")
        return self


class ParallelConfig(_Section):
    """How the processes `scaletrain train --nproc N` (or torchrun) starts split the work."""

    dp_replicate: int = Field(default=1, ge=1)
    """Data-parallel replicas holding whole copies of the (dp_shard-sharded) model."""
    dp_shard: int = Field(default=-1, ge=-1)
    """Processes each replica's parameters, gradients and optimizer state are sharded over (FSDP2, ZeRO-3); -1: all remaining processes."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree: attention heads, MLP columns and the vocabulary split over tp ranks, the sequence between blocks (sequence parallel)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree (a mixture of experts only): each group of ep neighbouring dp_shard ranks splits the routed experts between them, each token sent to its experts' rank and back by all-to-all; FSDP shards each expert over the dp_shard and cp ranks that hold the same experts. Under tensor parallelism the experts split over the ep x tp ranks (model.moe_experts a multiple of ep x tp)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree: each sequence split over cp ranks (load-balanced causal split into 2 x cp chunks), keys and values all-gathered for attention."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel degree: the blocks split into consecutive stages on pp ranks; each rank's micro-batches (train.micro_batch sequences each) flow through them."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                         "zbv_zero_bubble", "dualpipev"] = "1f1b"
    """Pipeline schedule (torch.distributed.pipelining): gpipe and 1f1b run one stage per rank; the others run several (virtual stages). The zero-bubble ones (interleaved_zero_bubble, zbv_zero_bubble, dualpipev) split each backward pass into the inputs' and the weights' gradients, which torch cannot do through compiled blocks (no train.compile)."""
    pp_stages_per_rank: int | None = Field(default=None, ge=1)
    """Virtual pipeline stages per rank. Unset: 1 for gpipe and 1f1b, 2 for the others (zbv_zero_bubble and dualpipev need exactly 2)."""
    pp_stage_blocks: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)] | None = None
    """Blocks of each pipeline stage, first to last (pp x stages per rank counts adding up to model.n_layers), e.g. [7, 8, ..., 8, 7] for 126 blocks on 16 stages, lighter ends for the embedding and the output head as Llama 3 split them. Unset: an even split (model.n_layers a multiple of the stages). A checkpoint resumes under another split."""
    recompute: Literal["none", "selective", "full", "auto"] = "none"
    """Activation recomputation per block: none; selective (keep matmul and attention outputs, recompute the rest); full (keep only block inputs); auto: the least of these whose peak memory, as plan/memory.py predicts it, fits in 90% of the GPU's memory (none on CPUs)."""
    fsdp_param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype FSDP gathers parameters in for compute (gradients are reduced in float32 and the sharded master weights stay float32). auto: the compute dtype train.dtype resolves to. Under bfloat16 the residual stream between blocks is then bf16 too (the norms keep bf16 inputs); under float16 each block hands it on in float32, out of float16's range, as on one device. float32 under 16-bit compute: twice the gathers' traffic, and autocast's 16-bit copy of every block's weights kept on every rank for the backward pass, as on one device."""

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard = 0 is not a size; use a positive number of processes, or -1 for all remaining ones")
        single = self.pp_schedule in ("gpipe", "1f1b")
        if self.pp_stages_per_rank is not None:
            if single and self.pp_stages_per_rank != 1:
                raise ValueError(f"parallel.pp_schedule = {self.pp_schedule!r} runs one stage per rank, not "
                                 f"parallel.pp_stages_per_rank = {self.pp_stages_per_rank}; choose interleaved_1f1b, "
                                 "looped_bfs or interleaved_zero_bubble for virtual stages")
            if self.pp_schedule in ("zbv_zero_bubble", "dualpipev") and self.pp_stages_per_rank != 2:
                raise ValueError(f"parallel.pp_schedule = {self.pp_schedule!r} runs exactly 2 stages per rank (a V "
                                 f"shape), not parallel.pp_stages_per_rank = {self.pp_stages_per_rank}")
        if self.pp_stage_blocks and self.pp == 1:
            raise ValueError(f"parallel.pp_stage_blocks = {self.pp_stage_blocks} splits a pipeline's stages, but "
                             "parallel.pp = 1 (no pipeline); set parallel.pp, or leave pp_stage_blocks unset")
        return self

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule in ("gpipe", "1f1b") else 2


class CheckpointConfig(_Section):
    interval: Annotated[int, Field(ge=0)] | Literal["auto"] = 500
    """Save every this many steps (and always at the end); 0 saves only at the end. "auto": at the interval that loses least to failures, Daly's higher-order optimum, sqrt(2 x blocking x MTBF) to first order (Young 1974, Daly 2006; plan/cost.py), from what this run measures — the seconds the last save blocked training (a background save's next one also waits for its writing to end), the seconds a step takes (each the largest over the ranks; the invocation's first step, which compiles and warms up, left out) — and the job's MTBF, 1 / (failures_per_device_hour x processes): the first save after a tenth of the run or 10 steps, whichever is fewer, then each at the interval the last one's measurements give (never below the save's own blocking time), and at every multiple of keep_every."""
    failures_per_device_hour: float = Field(default=419 / (16384 * 54 * 24), ge=0)
    """With interval = "auto": how often one process's device fails, per hour. Default: what Meta reported for Llama 3 405B, 419 unexpected interruptions in 54 days on 16,384 H100s (one per ~50,700 device-hours). 0: none fail (then hourly)."""
    keep: int = Field(default=3, ge=1)
    """How many of the newest complete checkpoints to keep."""
    keep_every: int = Field(default=0, ge=0)
    """Also keep every checkpoint whose step is a multiple of this (a multiple of interval) when newer ones prune it: what later stages, branches and analyses start from (see init_from); a rewind still discards those newer than the checkpoint it goes back to. 0: none."""
    async_save: bool = False
    """Write checkpoints in the background: training waits only while the state is copied to host memory (and for the previous checkpoint, if still writing). The last one is always waited for."""
    resume: str = "auto"
    """"auto": resume from the newest complete checkpoint in the run directory if any; "never"; or a checkpoint path."""
    init_from: str | None = None
    """What a new run's weights start from: a Hugging Face model directory (LlamaForCausalLM, MistralForCausalLM — a sliding window shorter than its context as model.sliding_window —, Qwen3ForCausalLM — its windows as model.sliding_window and model.full_attention_layers — or their mixtures of experts Qwen3MoeForCausalLM and MixtralForCausalLM, e.g. what `scaletrain export` writes: continued pre-training), whose config.json model.* must describe; or another scaletrain run's checkpoint (…/checkpoints/step_NNNNNNN, or a run directory for its newest): the next stage of its training, on other data, at another sequence length, layout or schedule, from step 0 of this run's own schedule and data order, with its weights of the same shapes (model.* may differ in what holds no weight: rope settings, max_seq_len, document_mask, routing). A run that resumes takes its own checkpoint instead."""
    init_optimizer: bool = True
    """With init_from naming a scaletrain checkpoint: also take its optimizer state (AdamW's moments, Muon's momentum; the same train.optimizer), so that the next stage continues without the jolt of fresh moments; false: start the optimizer afresh (then warm the learning rate up again)."""

    @model_validator(mode="after")
    def _check_one_start(self) -> CheckpointConfig:
        if self.init_from is not None and self.resume not in ("auto", "never"):
            raise ValueError(f"checkpoint.resume = {self.resume!r} continues a run from its checkpoint, and "
                             f"checkpoint.init_from = {self.init_from!r} starts a new run from one: give only one")
        return self

    @model_validator(mode="after")
    def _check_keep_every(self) -> CheckpointConfig:
        if self.interval == "auto":  # (which also saves at every multiple of keep_every)
            return self
        if self.keep_every and not self.interval:
            raise ValueError(f"checkpoint.keep_every = {self.keep_every} keeps nothing with checkpoint.interval = 0, "
                             "which saves only at the end; set an interval that divides it")
        if self.keep_every % max(self.interval, 1):
            raise ValueError(f"checkpoint.keep_every = {self.keep_every} is not a multiple of checkpoint.interval = "
                             f"{self.interval}, so some of the steps it keeps are never saved; use a multiple of it")
        return self


class EvalConfig(_Section):
    interval: int = Field(default=200, ge=0)
    """Validation loss every this many steps (and at the end); 0: only at the end."""
    tokens: int = Field(default=65536, ge=1)
    """Validation tokens per evaluation of each source (of a mixture, and of each eval.data directory): the same fixed windows of its validation split each time, as many whole windows of data.seq_len as fit in this (at least one)."""
    tasks: list[str] = []
    """Multiple-choice tasks scored at each evaluation, in the manner of lm-evaluation-harness (train/tasks.py says where they differ): JSON Lines files of {"context": ..., "choices": [...], "label": index}, each choice ranked by the log-probability of its tokens after the context; logged per task (its file's name) as task_accuracy, task_accuracy_norm (per character of the choice) and task_nll (the right choice's loss per token, smooth where accuracy is still at chance)."""
    task_examples: int = Field(default=500, ge=1)
    """The first this many examples of each task are scored."""
    data: dict[str, str] = {}
    """Held-out data directories whose validation loss each evaluation measures too, by name, e.g. {c4 = "data/c4", wiki = "data/wiki"} (OLMo's in-loop perplexity sets): prepared with the run's tokenizer (`data prepare ... --tokenizer DATA/tokenizer.json`), eval.tokens of each; logged as heldout_loss (and heldout_bits_per_byte), name -> value, beside the training data's."""

    @property
    def sources(self) -> dict[str, Path]:
        """Name -> data directory of each held-out set (eval.data)."""
        return {name: Path(path) for name, path in self.data.items()}

    @model_validator(mode="after")
    def _check_task_names(self) -> EvalConfig:
        names = [Path(task).stem for task in self.tasks]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"eval.tasks = {self.tasks} names more than one task {repeated[0]!r} (a task is named "
                             "by its file's name, without the folder); rename the files apart")
        return self


class LogConfig(_Section):
    interval: int = Field(default=10, ge=1)
    """Write a train record to metrics.jsonl and a console line every this many steps (loss, learning rate, gradient norm, tokens/s, MFU where the device's peak is known, and the time left to the invocation's end, at the pace of its tokens since its first step or the last rewind, evaluations and checkpoints included)."""
    tensorboard: bool = False
    """Also write the numbers of the train, eval and checkpoint records as TensorBoard scalars, into the run directory's tensorboard/ (`tensorboard --logdir RUN_DIR`); needs `pip install 'scaletrain[tensorboard]'`."""
    wandb_project: str | None = Field(default=None, min_length=1)
    """Also log them to this Weights & Biases project, as a W&B run named run.name whose id the run directory keeps (wandb_id), so that a resumed run continues it; needs `pip install 'scaletrain[wandb]'` and `wandb login`, or WANDB_MODE=offline."""
    plan: str | None = None
    """The plan the run was written from: the .plan.json that `scaletrain plan --write-config` writes beside the config, and names here. At the first record from step 10 on (of a step of the global batch), each invocation sets its tokens/s, MFU and peak memory against the plan's (a plan_check record) and warns when it runs below 80% of the planned speed, or above the planned memory by more than 10%, or on other devices than planned: hours, not the run's end, into it. Unset: no check (`scaletrain report --plan` compares afterwards)."""
    norms: bool = False
    """Also the 2-norm of the gradient (before clipping) and of the weights (after the update) of each part of the model — the embedding, each block (layers.N), the final norm and output head (head), each multi-token prediction depth (mtp.K) — in each train record (grad_norm_by_part, weight_norm_by_part): where an instability starts. Under muP both are those of the model with its multipliers written out, as clipping counts them: a weight folding in a multiplier s (the head's 1 / m, the output projections' d^-alpha) counts s times its gradient and 1 / s times itself. One all-reduce of the parts' vector per kind of sharding, at the logged steps only."""
    profile_steps: list[int] | None = None
    """Trace steps [first, last] with the PyTorch profiler on every rank (CPU operators; on a GPU its kernels too; shapes and memory), into the run directory's profile/steps_FIRST-LAST_rankR.json, a Chrome trace that Perfetto (ui.perfetto.dev) opens. Unset: no tracing."""

    @model_validator(mode="after")
    def _check_profile(self) -> LogConfig:
        steps = self.profile_steps
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ValueError(f"log.profile_steps = {steps} must be [first, last] steps to trace, 1 <= first <= last, "
                             "e.g. [10, 12]")
        return self


class RunConfig(_Section):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        """`model.dim = true` is a mistake, not the 1 that pydantic would read."""
        for section, values in data.items() if isinstance(data, dict) else ():
            kind = cls.model_fields.get(section)
            fields = getattr(kind.annotation, "model_fields", {}) if kind is not None else {}
            for name, value in values.items() if isinstance(values, dict) else ():
                if isinstance(value, bool) and name in fields and not _admits_bool(fields[name].annotation):
                    raise ValueError(f"{section}.{name} = {str(value).lower()}: this key takes "
                                     f"{_kind_of(fields[name].annotation)}, not true or false")
        return data

    @model_validator(mode="after")
    def _check_run(self) -> RunConfig:
        if self.model.mtp_depth >= self.data.seq_len:
            raise ValueError(f"model.mtp_depth = {self.model.mtp_depth} is not below data.seq_len = {self.data.seq_len}; "
                             "each depth predicts one token further within the sequence")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len = {self.data.seq_len} is above model.max_seq_len = {self.model.max_seq_len}; "
                f"lower data.seq_len or raise model.max_seq_len"
            )
        seq_tokens = self.train.micro_batch * self.data.seq_len
        for batch, _ in self.train.batch_ramp:
            if batch >= self.train.global_batch_tokens:
                raise ValueError(f"train.batch_ramp's batch_tokens = {batch} is not below train.global_batch_tokens = "
                                 f"{self.train.global_batch_tokens}: the ramp's batches come before the global one "
                                 "and are smaller (memory is planned for the global batch)")
        for name, batch in self.batch_names():
            if batch % seq_tokens:
                lower = max(seq_tokens, batch // seq_tokens * seq_tokens)
                raise ValueError(
                    f"{name} = {batch} is not divisible by train.micro_batch x data.seq_len = "
                    f"{self.train.micro_batch} x {self.data.seq_len} = {seq_tokens}; use a multiple of {seq_tokens}, "
                    f"e.g. {lower}"
                )
        return self

    def batch_names(self) -> list[tuple[str, int]]:
        """(how the config names it, tokens) of every global batch size the run trains with."""
        return [*(("train.batch_ramp's batch_tokens", batch) for batch, _ in self.train.batch_ramp),
                ("train.global_batch_tokens", self.train.global_batch_tokens)]

    def _batch_phases(self):
        """(first step, steps or None for the last, batch tokens, tokens trained before) of each
        stretch of constant batch: train.batch_ramp's pairs that are trained, then the global batch."""
        step, done = 0, 0
        for batch, until in self.train.batch_ramp:
            if done < until:
                steps = -(-(until - done) // batch)
                yield step, steps, batch, done
                step, done = step + steps, done + steps * batch
        yield step, None, self.train.global_batch_tokens, done

    def batch_schedule(self) -> list[tuple[int, int]]:
        """(steps, batch tokens) of each stretch of constant batch the whole run trains, in order."""
        total = self.total_steps
        return [(min(total, first + steps) - first if steps is not None else total - first, batch)
                for first, steps, batch, _ in self._batch_phases() if first < total]

    def _phase_of(self, step: int) -> tuple[int, int | None, int, int]:
        """The stretch of constant batch that step `step` + 1 belongs to."""
        return next(phase for phase in self._batch_phases() if phase[1] is None or step < phase[0] + phase[1])

    def step_batch_tokens(self, step: int) -> int:
        """Global batch tokens of the step that follows `step` completed ones."""
        return self._phase_of(step)[2]

    def tokens_before(self, step: int) -> int:
        """Tokens trained by the first `step` steps."""
        first, _, batch, done = self._phase_of(step)
        return done + (step - first) * batch

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def data_seed(self) -> int:
        """The seed of the data order: data.seed, else run.seed."""
        return self.run.seed if self.data.seed is None else self.data.seed

    @property
    def seqs_per_step(self) -> int:
        return self.train.global_batch_tokens // self.data.seq_len

    @property
    def total_steps(self) -> int:
        if self.train.steps is not None:
            return self.train.steps
        tokens: int = self.train.tokens  # type: ignore[assignment]
        first, _, batch, done = next(phase for phase in self._batch_phases()  # where train.tokens is reached
                                     if phase[1] is None or tokens <= phase[3] + phase[1] * phase[2])
        return first + max(0, -(-(tokens - done) // batch))

    @property
    def total_tokens(self) -> int:
        return self.tokens_before(self.total_steps)

    def to_toml(self) -> str:
        return dump_toml(self.model_dump(exclude_none=True))


def reference_markdown() -> str:
    """The config reference of the README: one table per section, from the fields' docstrings."""
    out = []
    for section, field in RunConfig.model_fields.items():
        out += [f"### `[{section}]`", "", "| key | default | meaning |", "|---|---|---|"]
        for name, info in field.annotation.model_fields.items():
            default = info.default
            if default is None or info.is_required():
                shown = "unset"
            elif isinstance(default, bool):
                shown = f"`{str(default).lower()}`"
            elif isinstance(default, str):
                shown = f'`"{default}"`'
            else:
                shown = f"`{default}`"
            out.append(f"| `{name}` | {shown} | {info.description} |")
        out.append("")
    return "\n".join(out)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (["train", "lr"], 0.0003). Values are TOML; bare words are strings."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"override key {key!r} must name a section and a key, e.g. train.lr")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def run_config_file(run_dir: str | Path) -> Path:
    """The config.toml of a run directory; ConfigError when `run_dir` is none (pointing from one
    of its checkpoints to the run and its step)."""
    run_dir = Path(run_dir)
    path = run_dir / "config.toml"
    if not path.is_file():
        run = run_dir.parent.parent
        if run_dir.name.startswith("step_") and (run / "config.toml").is_file():
            raise ConfigError(f"{str(run_dir)!r} is a checkpoint of the run {str(run)!r}; give the run directory, "
                              f"with --step {int(run_dir.name.removeprefix('step_'))} for this checkpoint")
        raise ConfigError(f"{str(run_dir)!r} is not a run directory (no config.toml); give the directory "
                          "`scaletrain train` wrote, e.g. runs/demo")
    return path


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML config, apply dotted overrides and validate; raise ConfigError with a readable message."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            hint = f"pass its config.toml ({str(path / 'config.toml')!r})" if (path / "config.toml").is_file() \
                else "pass a TOML file such as configs/tiny.toml"
            raise ConfigError(f"config file {str(path)!r} is a directory; {hint}")
        if not path.is_file():
            # The configs that come with scaletrain lie in its source checkout's configs/, which a
            # path relative to another working directory misses.
            shipped = Path(__file__).resolve().parents[2] / "configs" / path.name
            hint = (f"the one of that name that comes with scaletrain is {str(shipped)!r}" if shipped.is_file()
                    else "pass a TOML file such as configs/tiny.toml (in scaletrain's source checkout)")
            raise ConfigError(f"config file {str(path)!r} does not exist in {str(Path.cwd())!r}; {hint}")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:  # (TOML is UTF-8)
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text, as TOML is ({e.reason} at byte "
                              f"{e.start}); save it as UTF-8") from None
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror}); give a readable TOML "
                              "file") from None
    return config_from(data, overrides, source=str(path) if path else "config")


def config_from(data: dict[str, Any], overrides: list[str] = (), source: str = "config") -> RunConfig:
    """A config's TOML data with dotted overrides applied, validated."""
    data = copy.deepcopy(data)
    parsed = [parse_override(text) for text in overrides]
    given = {tuple(keys) for keys, _ in parsed}
    for text, (keys, value) in zip(overrides, parsed):
        # The run's length is given once: train.steps=N on the command line replaces the file's train.tokens.
        other = {("train", "steps"): "tokens", ("train", "tokens"): "steps"}.get(tuple(keys))
        if other and ("train", other) not in given:
            data.get("train", {}).pop(other, None)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {k!r} is not a section")
        node[keys[-1]] = value
    return validate_config(data, source=source)


def validate_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, source)) from None


_UNION_TAGS = {"int", "str", "float", "bool", "list", "dict", "none"}


def _describe(error: ValidationError, source: str) -> str:
    lines = []
    unions: dict[str, int] = {}  # key -> its line, for the other members of a union (interval: int | "auto")
    for item in error.errors():
        # (a union's members appear in loc as tags: constrained-int, literal['auto']; the key is without them)
        parts = [p for p in item["loc"] if not isinstance(p, str) or (p.isidentifier() and p not in _UNION_TAGS)]
        tagged = len(parts) < len(item["loc"])
        key = ".".join(str(p) for p in parts)
        msg = item["msg"].removeprefix("Value error, ")
        if tagged and key in unions:
            lines[unions[key]] += ", or " + msg.removeprefix("Input should ")
            continue
        if tagged:
            unions[key] = len(lines)
        if item["type"] == "extra_forbidden":
            section = item["loc"][0] if len(item["loc"]) > 1 else None
            valid = _valid_keys(section)
            lines.append(f"{key}: unknown key; valid keys here are {', '.join(valid)}")
        elif item["type"] == "missing":
            lines.append(f"{key}: required but not given")
        elif item["type"] == "value_error":
            lines.append(f"{key}: {msg}" if key else msg)
        else:
            lines.append(f"{key} = {item.get('input')!r}: {msg}")
    return f"{source}: " + "; ".join(lines)


def _valid_keys(section: Any) -> list[str]:
    fields = RunConfig.model_fields
    if section in fields:
        return list(fields[section].annotation.model_fields)  # type: ignore[union-attr]
    return list(fields)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else toml_value(key)


def dump_toml(data: dict[str, Any]) -> str:
    """Write a two-level dict (sections of scalars) as TOML."""
    out = []
    for section, values in data.items():
        out.append(f"[{section}]")
        for key, value in values.items():
            out.append(f"{key} = {toml_value(value)}")
        out.append("")
    return "\n".join(out)


def toml_value(value: Any) -> str:
    """value as TOML writes it (and a section.key=VALUE override reads it)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} as TOML")
