"""A Llama-style dense decoder as plain single-device PyTorch.

Pre-norm blocks of grouped-query attention and a SwiGLU MLP (Touvron et al. 2023, "LLaMA"),
RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021, "RoFormer"),
optional QK-norm (Dehghani et al. 2023, "Scaling Vision Transformers to 22B"), no biases.
Parameter names follow Meta's Llama / torchtitan (`layers.0.attention.wq.weight`), so that
`parallel/` can address blocks and linears by name; distribution is applied from outside.
`layers` is a ModuleDict keyed by block index, so a pipeline stage that keeps some blocks (and
drops the embedding or the output head: those attributes become None) keeps the names a
checkpoint of the whole model uses.
Parameter and FLOP counts live in `model/flops.py`, not here.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from scaletrain.config import YARN_BETA_FAST, YARN_BETA_SLOW, ModelConfig, effective_window, yarn_attention_factor
from scaletrain.model.loss import (IGNORE, Tally, add_replicated, chunked_cross_entropy, compute_dtype, cross_entropy,
                                   local_value)
from scaletrain.model.moe import MoE


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None,
                scaling: dict[str, float | str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, head_dim // 2), in float32.

    Frequency i is theta^(-2i / head_dim) (RoFormer eq. 15); position p rotates by p x freq.
    model.rope_scaling changes the frequencies, for a context longer than the model was trained
    on (L = original_max_seq_len, s = factor):
    - Llama 3.1's (Llama Team 2024, "The Llama 3 Herd of Models"): frequencies whose wavelength
      2 pi / freq exceeds L / low_freq_factor are divided by s, those under L / high_freq_factor
      kept, and in between mixed, (1 - a) freq / s + a freq with a = (L / wavelength -
      low_freq_factor) / (high_freq_factor - low_freq_factor).
    - "linear", position interpolation (Chen et al. 2023): every frequency divided by s.
    - "yarn" (Peng et al. 2023, "YaRN", section 3.2 "NTK-by-parts" and 3.4): a frequency that
      turns r = L / wavelength times over L is divided by s when r < beta_slow and kept when
      r > beta_fast; between, the share divided by s ramps linearly over the dimension index,
      from the (floor of the) dimension where r = beta_fast to the (ceiling of the) one where r =
      beta_slow, as the paper's reference code and Hugging Face compute it. cos and sin are
      multiplied by attention_factor (default 0.1 ln s + 1, the paper's sqrt(1/t)), so the
      attention logits, a product of two rotated vectors, by its square."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    kind = (scaling or {}).get("type", "llama3")
    magnitude = 1.0
    if scaling is not None and kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelengths = 2 * math.pi / freqs
        smooth = ((scaling["original_max_seq_len"] / wavelengths - low) / (high - low)).clamp(0, 1)
        freqs = (1 - smooth) * freqs / factor + smooth * freqs
    elif kind == "linear":
        freqs = freqs / scaling["factor"]
    elif kind == "yarn":
        factor, original = scaling["factor"], scaling["original_max_seq_len"]

        def dimension(turns: float) -> float:  # the dimension index d whose frequency turns `turns` times over L
            return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

        first = max(math.floor(dimension(scaling.get("beta_fast", YARN_BETA_FAST))), 0)
        last = min(math.ceil(dimension(scaling.get("beta_slow", YARN_BETA_SLOW))), head_dim - 1)
        index = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
        interpolated = ((index - first) / (last - first or 1e-3)).clamp(0, 1)  # 0: kept, 1: divided by s
        freqs = interpolated * freqs / factor + (1 - interpolated) * freqs
        magnitude = scaling.get("attention_factor", yarn_attention_factor(factor))
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)  # (max_seq_len, head_dim // 2)
    return angles.cos() * magnitude, angles.sin() * magnitude


def shifted_targets(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """(batch, seq, 1 + depth) from targets (batch, seq): column k holds, at each position, the
    target k places on (column 0 the targets themselves; multi-token prediction's depth k predicts
    column k and reads the token of column k - 1), IGNORE past the end of the sequence. Built on
    whole sequences, it can be cut along the sequence (context parallelism) as they are."""
    pad = torch.full_like(targets[:, :depth], IGNORE)
    return torch.stack([torch.cat([targets[:, k:], pad[:, :k]], dim=1) for k in range(depth + 1)], dim=-1)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) index of the document each token belongs to within its sequence: packed
    documents end with eos_id, which belongs to the document it ends; the next token opens
    another (document_mask = True keeps attention within these)."""
    ends = (tokens == eos_id).to(torch.int32)
    return ends.cumsum(dim=1, dtype=torch.int32) - ends


def causal_mask(rows: torch.Tensor, keys: int, window: int | None = None) -> torch.Tensor:
    """(queries, keys) True where the query at position rows[i] may attend to key position j: an
    earlier or the same position, and with `window` (sliding-window attention) one of the
    window - 1 before it at most."""
    positions = torch.arange(keys, device=rows.device)
    allowed = positions[None, :] <= rows[:, None]
    if window is not None:
        allowed &= positions[None, :] > rows[:, None] - window
    return allowed


def document_causal_mask(documents: torch.Tensor, rows: torch.Tensor | None = None,
                         window: int | None = None) -> torch.Tensor:
    """(batch, 1, queries, seq) True where a token may attend to another: an earlier or the same
    position of its own document (within `window`, with one). documents: (batch, seq) document_ids
    of whole sequences; rows: the positions of the queries (default all: a square mask)."""
    seq = documents.shape[1]
    rows = torch.arange(seq, device=documents.device) if rows is None else rows
    return (documents[:, None, rows, None] == documents[:, None, None, :]) & causal_mask(rows, seq, window)


def document_bias(documents: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None,
                  window: int | None = None) -> torch.Tensor:
    """(batch, 1, queries, seq) to add to the attention scores: 0 where document_causal_mask
    allows, -inf elsewhere, in the dtype of the scores (SDPA would turn a boolean mask into such
    a tensor in each block, and each block would keep its own for the backward pass)."""
    return _bias(document_causal_mask(documents, rows, window), dtype)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def attention_bias(x: torch.Tensor, seq: int, documents: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, window: int | None = None,
                   flex: bool = False) -> torch.Tensor | BlockMask | None:
    """The bias all blocks add to their attention scores over sequences of `seq` tokens (x: the
    hidden states, for their dtype and device): within `documents` (document_bias; under context
    parallelism, `positions` given, the rows of this rank's queries), and with a sliding `window`
    shorter than the sequence, within it; None where attention is plainly causal. With `flex`
    (model.attention_kernel = "flex") on a device of FLEX_DEVICES and without context parallelism,
    FlexAttention's block mask of the same attention instead (flex_block_mask)."""
    window = effective_window(window, seq)
    if flex and (documents is not None or window is not None) and positions is None and x.device.type in FLEX_DEVICES:
        return flex_block_mask(seq, documents, window, x.device)
    if documents is not None:
        return document_bias(documents, compute_dtype(x), positions, window)
    if window is None:
        return None
    rows = torch.arange(seq, device=x.device) if positions is None else positions
    return _bias(causal_mask(rows, seq, window), compute_dtype(x))[None, None]


FLEX_DEVICES = ("cuda",)  # device types where attention_kernel = "flex" runs FlexAttention (torch's has no CPU backward)


def flex_block_mask(seq: int, documents: torch.Tensor | None, window: int | None, device) -> BlockMask:
    """FlexAttention's block mask of causal attention over sequences of `seq` tokens, within
    `documents` (batch, seq) and within `window`, where given: document_causal_mask's attention,
    kept as which blocks of 128 x 128 scores are wholly masked (skipped), wholly kept (computed
    without the mask) or partly kept. On CUDA its construction is compiled, which holds no
    (seq, seq) tensor."""
    def allowed(b, h, q, k):
        keep = k <= q
        if window is not None:
            keep = keep & (q - k < window)
        if documents is not None:
            keep = keep & (documents[b, q] == documents[b, k])
        return keep

    batch = None if documents is None else documents.shape[0]  # (None: one mask for every sequence)
    build = _compiled_create_block_mask() if torch.device(device).type == "cuda" else create_block_mask
    return build(allowed, batch, None, seq, seq, device=device)


@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask)  # (shapes that change: as _compiled_flex_attention)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by the angles cos/sin (seq, head_dim // 2).

    Pairs are (i, i + head_dim/2) — the "rotate half" layout of GPT-NeoX and Hugging Face
    Llama — so exported wq/wk need no permutation. Computed in float32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.type_as(x)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimension as CUDA's fused kernel (torch's _fused_rms_norm) computes
    it, on any device: in float32 (float64 for float64) whatever the input's dtype, rounded to it
    once, keeping the input and the per-row 1 / rms for the backward pass, not the normalised
    input that the composite rms_norm's multiplication by the weight keeps (a second copy of the
    residual stream). In float32 the forward pass is torch's composite, bit for bit. The backward
    pass, dx = r (g w - x_hat mean(g w x_hat)) and dw = sum g x_hat with x_hat = r x, rebuilds
    x_hat from the input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        wide = x.to(compute)
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (wide * rstd * weight.to(compute)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        compute = rstd.dtype
        normalised = x.to(compute) * rstd
        weighted = grad.to(compute) * weight.to(compute)
        dx = rstd * (weighted - normalised * (weighted * normalised).mean(-1, keepdim=True))
        dw = (grad.to(compute) * normalised).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dx.to(x.dtype), None if dw is None else dw.to(weight.dtype), None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (Zhang & Sennrich 2019) computed by CUDA's fused kernel on a GPU and as that
    kernel computes it elsewhere (_RMSNormFunction): in float32, keeping only the input and
    1 / rms for backward. An input of the weight's dtype is normalised as it is — a bf16 residual
    stream under FSDP's bf16 parameters keeps its bf16 input, not the float32 copy autocast
    would make of it (CUDA's autocast runs rms_norm in float32) — and otherwise both are taken
    to float32 under autocast, as CUDA's autocast does, on every device; so the CPU keeps what
    the memory model counts for CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype != weight.dtype and torch.is_autocast_enabled(x.device.type):
            x, weight = x.float(), weight.float()
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # (of the dtype it computes in)
        if not x.is_cuda:
            return _RMSNormFunction.apply(x, weight, eps)
        with torch.autocast("cuda", enabled=False):
            return F.rms_norm(x, (x.shape[-1],), weight, eps)


class KVCache:
    """Keys and values of every layer for incremental decoding.

    k[i], v[i]: (batch, kv_heads, max_len, head_dim). A forward at `start_pos` over `seq`
    tokens writes positions [start_pos, start_pos + seq) and reads [0, start_pos + seq)."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, device=None, dtype=None):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core = CoreAttention()
        self.window = cfg.window_of(layer)  # (sliding-window attention, in decoding with a cache)

    def forward(
        self,
        x: torch.Tensor,  # (batch, seq, dim)
        cos: torch.Tensor,  # (≥ seq, head_dim // 2), angles of the positions of x's tokens
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this layer's KVCache.k[i], .v[i]
        start_pos: int = 0,
        bias: torch.Tensor | BlockMask | None = None,  # attention_bias's: added to the scores, or FlexAttention's
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads, not n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            # In the norm weight's dtype: under bf16 autocast q and k are bf16 while the weight
            # stays float32, and torch.rms_norm then falls back to an unfused kernel (and warns).
            norm_dtype = self.q_norm.weight.dtype
            q = self.q_norm(q.to(norm_dtype)).to(v.dtype)
            k = self.k_norm(k.to(norm_dtype)).to(v.dtype)
        # Blocks may see fewer positions than the tables hold (a sequence-parallel shard of the
        # residual stream is gathered for attention): take the first seq.
        cos, sin = cos[:seq], sin[:seq]
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (batch, heads, seq, head_dim)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (batch, kv_heads, seq, head_dim)
        v = v.transpose(1, 2)

        mask, causal = None, True  # training: causal within the sequence
        if kv is not None:
            end = start_pos + seq
            k_cache, v_cache = kv  # (batch, kv_heads, max_len, head_dim)
            k_cache[:, :, start_pos:end] = k
            v_cache[:, :, start_pos:end] = v
            k, v = k_cache[:, :, :end], v_cache[:, :, :end]  # (batch, kv_heads, end, head_dim)
            # SDPA's is_causal aligns the mask top-left, which is wrong once queries start at
            # start_pos > 0: query i (at position start_pos + i) sees keys 0..start_pos + i.
            causal = False
            if seq > 1 or (self.window is not None and end > self.window):
                mask = causal_mask(torch.arange(start_pos, end, device=x.device), end, self.window)
        if bias is not None:  # training or evaluation (Transformer.forward refuses it with a cache)
            mask, causal = bias, False
        out = self.core(q, k, v, mask, causal)  # (batch, heads, seq, head_dim)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v, no parameters. A module of its own so that parallel/
    can swap in a version that attends across ranks (context parallelism).

    mask: None, boolean (True: attend) or added to the scores (document_bias)."""

    def forward(self, q, k, v, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        return attend(q, k, v, mask, causal)


REPEATED_KV_DEVICES = ("cuda",)  # device types whose masked attention kernels take no grouped heads (see attend)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal: bool = False) -> torch.Tensor:
    """SDPA of q (batch, heads, q, head_dim) over k, v (batch, kv_heads, keys, head_dim), grouped
    query heads included. enable_gqa lets each key/value head serve heads / kv_heads query heads
    without copies, but on CUDA only the flash kernel (which takes no mask) and the math one (which
    keeps the whole score matrix) accept it: a masked call (within documents, or cached and
    multi-token) gets repeated heads there, and the memory-efficient kernel. A CausalBias (context
    parallelism's bottom-right causal mask) is computed by flash without copies. A BlockMask
    (flex_block_mask's) is computed by FlexAttention, which takes grouped heads as they are."""
    if isinstance(mask, BlockMask):
        # Within a compiled block (train.compile) the block's compilation takes it in; outside one on
        # CUDA, its own. Elsewhere, eager: torch's reference (the CPU's tests).
        kernel = _compiled_flex_attention() if q.device.type == "cuda" and not torch.compiler.is_compiling() \
            else flex_attention
        return kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if mask is not None and not isinstance(mask, CausalBias) and q.device.type in REPEATED_KV_DEVICES:
        k, v = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _compiled_flex_attention():
    """FlexAttention compiled into its fused kernel (eager, it is a reference that keeps every
    score), for shapes that change too (evaluation's task rows, generation without a cache):
    marked dynamic after a first recompilation rather than recompiled for each until torch
    gives up and runs the reference."""
    return torch.compile(flex_attention)


def repeat_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv_heads, seq, head_dim) -> (batch, heads, seq, head_dim): query head h reads key/value
    head h // (heads / kv_heads), as SDPA's enable_gqa does."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class FeedForward(nn.Module):
    """SwiGLU MLP, w2(silu(w1 x) * w3 x) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _weight(layer: nn.Module | nn.Parameter) -> torch.Tensor:
    """A linear layer's weight, or the stacked weight of an expert group's projection."""
    return layer if isinstance(layer, nn.Parameter) else layer.weight


class Block(nn.Module):
    """One pre-norm transformer block; the unit that FSDP, recompute and pipelining wrap."""

    def __init__(self, cfg: ModelConfig, moe: bool = False, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MoE(cfg, layer) if moe else FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor] | None = None, start_pos: int = 0,
                bias: torch.Tensor | BlockMask | None = None):
        # Norm outputs go to the compute dtype once: left in float32, autocast would cast them
        # again for each projection (q, k, v; w1, w3), and backward would keep every copy.
        dtype = compute_dtype(x)
        x = x + self.attention(self.attention_norm(x).to(dtype), cos, sin, kv, start_pos, bias)
        return x + self.feed_forward(self.ffn_norm(x).to(dtype))


class MultiTokenPrediction(nn.Module):
    """One depth of DeepSeek-V3's multi-token prediction (Liu et al. 2024, "DeepSeek-V3 Technical
    Report", section 2.2, eq. 21-22): h' = proj [RMSNorm(h); RMSNorm(Emb(t))], the previous
    depth's hidden state h at each position joined with the embedding of the token this depth
    reads ahead, then one dense block; returns its output, for the next depth, and that output
    through its own final norm, for the shared output head (inside forward: under FSDP the norm's
    weight is gathered only there)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.embedding_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, layer=cfg.n_layers - 1)  # (attending as the last block: ModelConfig.window_of)
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, cos, sin,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(hidden)
        joined = torch.cat([self.hidden_norm(hidden), self.embedding_norm(embedded)], dim=-1).to(dtype)
        # The block's residual stream in the trunk's dtype (float32 under autocast), as the trunk's.
        out = self.block(self.proj(joined).to(hidden.dtype), cos, sin, bias=bias)
        return out, self.norm(out)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, cfg.is_moe_layer(i), i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        # model.mtp_depth: training's extra heads (see forward); None without them.
        self.mtp = nn.ModuleList(MultiTokenPrediction(cfg) for _ in range(cfg.mtp_depth)) if cfg.mtp_depth else None
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Tokens per chunk of the output head and loss when forward() is given targets; 0 for the
        # whole batch at once (model/loss.py). Set by the trainer from train.loss_chunk_tokens.
        self.loss_chunk = 0
        self.z_loss = 0.0  # PaLM's z-loss weight (model/loss.py), set by the trainer from train.z_loss
        self.z_tally: Tally | None = None  # where the trainer reads the z-loss's value (model/loss.py)
        # Multi-token prediction's weight in the objective (train.mtp_weight), and where the trainer
        # reads its loss, which the loss returned leaves out.
        self.mtp_weight = 0.0
        self.mtp_tally: Tally | None = None
        # Under context parallelism (parallel/context.py) the group whose ranks hold the other
        # parts of each sequence: multi-token prediction weighs each rank's mean loss by its share.
        self.cp_group = None
        # Under tensor parallelism's sequence parallelism (parallel/tensor.py) the shards of the
        # sequence a later pipeline stage's hidden states are one of: attention sees them all.
        self.sequence_shards = 1
        # Derived from cfg, so not saved in checkpoints; init_weights() fills them.
        table = (cfg.max_seq_len, cfg.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table, dtype=torch.float32), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and recompute the rotary tables.

        Call after building on the meta device and `to_empty(device=...)`, where parameters
        and non-persistent buffers hold garbage. Linear weights and the embedding are
        N(0, init_std); the projections that write into the residual stream (wo, w2) get
        init_std / sqrt(2 n_layers), since each block adds two of them (GPT-2, Radford et al.
        2019, section 2.3; Megatron-LM, Shoeybi et al. 2019). Norm weights are ones. Under muP
        (model.mup_base_dim), with m the width multiplier, the blocks' matrices start 1 / sqrt(m)
        as large (their fan-in grew m times), the output head and routers 1 / m as large (muP's
        output multiplier folded into them), the embedding as at the base width. Under depth-wise
        muP (model.mup_base_layers) the output projections start as at the base depth, times the
        residual multiplier folded into them; the multi-token-prediction blocks' as at the base
        depth (each is one block, whatever the depth)."""
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # to_empty() from the meta device gives each module its own new Parameter,
            # untying them; tie again (a no-op where tying survived, e.g. under FSDP2).
            self.output.weight = self.tok_embeddings.weight
        std, mult = self.cfg.init_std, self.cfg.width_mult
        hidden_std = std / math.sqrt(mult)
        base_std = hidden_std / math.sqrt(2 * (self.cfg.mup_base_layers or self.cfg.n_layers))
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        depths = list(self.mtp) if self.mtp is not None else []
        trunk = list(self.layers.values())
        for block in [*trunk, *(depth.block for depth in depths)]:
            residual_std = base_std * (self.cfg.residual_scale if block in trunk else 1.0)
            attention, mlp = block.attention, block.feed_forward
            mlps = [mlp] if isinstance(mlp, FeedForward) else [mlp.experts] + ([mlp.shared] if mlp.shared else [])
            weights = [attention.wq.weight, attention.wk.weight, attention.wv.weight]
            if isinstance(mlp, MoE):
                nn.init.normal_(mlp.router.weight, mean=0.0, std=std / mult)
            for weight in weights + [w for m in mlps for w in (_weight(m.w1), _weight(m.w3))]:
                nn.init.normal_(weight, mean=0.0, std=hidden_std)
            for weight in [attention.wo.weight] + [_weight(m.w2) for m in mlps]:
                nn.init.normal_(weight, mean=0.0, std=residual_std)
            for norm in (block.attention_norm, block.ffn_norm, attention.q_norm, attention.k_norm):
                if norm is not None:
                    norm.reset_parameters()
        for depth in depths:  # (its projection reads the residual stream as a block's matrices do)
            nn.init.normal_(depth.proj.weight, mean=0.0, std=hidden_std)
            for norm in (depth.hidden_norm, depth.embedding_norm, depth.norm):
                norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, mean=0.0, std=std / mult)
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.rope_cos.device,
                               self.cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def new_cache(self, batch: int, max_len: int | None = None, device=None, dtype=None) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `max_len` (default max_seq_len)
        positions, on the device and in the dtype of the weights unless given."""
        weight = self.output.weight
        return KVCache(
            self.cfg.n_layers,
            batch,
            self.cfg.kv_heads,
            max_len or self.cfg.max_seq_len,
            self.cfg.head_dim,
            device=device or weight.device,
            dtype=dtype or weight.dtype,
        )

    def forward(
        self,
        tokens: torch.Tensor,  # (batch, seq) token ids; at a later pipeline stage hidden states (batch, seq, dim)
        targets: torch.Tensor | None = None,  # (batch, seq) next-token ids, or shifted_targets' (batch, seq, 1 + depth)
        cache: KVCache | None = None,
        start_pos: int = 0,
        positions: torch.Tensor | None = None,  # (seq,) positions of the tokens, if not start_pos..
        documents: torch.Tensor | None = None,  # (batch, seq) document_ids of the whole sequences
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab) when targets is None, else the mean cross-entropy loss
        (over targets other than -100, which mark padding).

        With a cache, `tokens` sit at positions start_pos.. and attend to everything the
        cache holds before them; without one, attention is causal within `tokens`, and with
        `documents` within each token's document as well (under context parallelism they are the
        ids of the whole sequences, not of this rank's part). A pipeline stage without the output
        head returns its hidden states (batch, seq, dim)."""
        seq = tokens.shape[1]
        end = start_pos + seq
        if end > self.cfg.max_seq_len:
            raise ValueError(
                f"positions up to {end} requested but model.max_seq_len = {self.cfg.max_seq_len}; "
                "shorten the input or build the model with a larger max_seq_len"
            )
        if cache is not None and end > cache.max_len:
            raise ValueError(f"positions up to {end} requested but the KV cache holds {cache.max_len}")
        if positions is None:
            # From start_pos on, not cut at seq: under sequence parallelism a later pipeline stage
            # receives a shard of the sequence, and attention sees all of it.
            cos, sin = self.rope_cos[start_pos:], self.rope_sin[start_pos:]  # (≥ seq, head_dim // 2)
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        # (A later pipeline stage is given hidden states; the last one may hold the embedding too.)
        x = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)  # (batch, seq, dim)
        if x.dtype == torch.float16 and torch.is_autocast_enabled(x.device.type):
            x = x.float()  # (FSDP's float16 parameters under float16: the stream in float32, as the blocks hand it on)
        if documents is not None and cache is not None:
            raise ValueError("documents mask the attention of training and evaluation; decoding with a KV cache "
                             "takes none")
        # One for all blocks: a mask built in each would be kept by each for its backward pass.
        # (A cache's attention masks its own.) Over the whole sequence, which a later pipeline
        # stage under sequence parallelism holds a shard of.
        whole = seq * self.sequence_shards if tokens.is_floating_point() else seq
        masks = {} if cache is not None else self.attention_masks(x, whole, documents, positions)
        for name, block in self.layers.items():
            # Blocks get tensors, not a layer index, so compiled blocks see no per-layer constant.
            layer_kv = None if cache is None else (cache.k[int(name)], cache.v[int(name)])
            x = block(x, cos, sin, layer_kv, start_pos, masks.get(int(name)))
        if self.output is None:
            return x
        if targets is None:
            return self.output(self.norm(x))  # (batch, seq, vocab)
        shifted = targets.dim() == 3
        loss = self._loss(self.norm(x), targets[..., 0] if shifted else targets, self.z_loss, self.z_tally)
        if self.mtp is not None and self.training:
            # Its gradient joins the objective, its value stays out of the loss returned (as the z-loss's).
            extra = self._mtp_loss(x, targets if shifted else shifted_targets(targets, len(self.mtp)), cos, sin,
                                   masks.get(self.cfg.n_layers - 1))
            if self.mtp_tally is not None:
                self.mtp_tally.add(extra, torch.ones_like(extra))
            loss = add_replicated(loss, self.mtp_weight * (extra - extra.detach()))
        return loss

    def attention_masks(self, x: torch.Tensor, seq: int, documents: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None) -> dict[int, torch.Tensor | BlockMask | None]:
        """Each block's attention_bias over sequences of `seq` tokens, by its index (x, documents,
        positions: as attention_bias takes them): one for all, or with model.full_attention_layers
        a second for those, without the window (where the window spans the sequences, one). A
        pipeline stage builds only what its blocks (and multi-token prediction's depths, which
        attend as the last block) take: the others' entries are None, for blocks it does not run."""
        window, flex = self.cfg.sliding_window, self.cfg.attention_kernel == "flex"
        if effective_window(window, seq) is None or not self.cfg.full_attention_layers:
            return dict.fromkeys(range(self.cfg.n_layers), attention_bias(x, seq, documents, positions, window, flex))
        held = [int(name) for name in self.layers] + ([self.cfg.n_layers - 1] if self.mtp is not None else [])
        windowed = {self.cfg.window_of(i) is not None for i in held}
        bias = attention_bias(x, seq, documents, positions, window, flex) if True in windowed else None
        full = attention_bias(x, seq, documents, positions, None, flex) if False in windowed else None
        return {i: bias if self.cfg.window_of(i) is not None else full for i in range(self.cfg.n_layers)}

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0,
              tally: Tally | None = None) -> torch.Tensor:
        """The output head's mean cross-entropy over normalised hidden states (in chunks with
        loss_chunk)."""
        if self.loss_chunk:
            return chunked_cross_entropy(hidden, self.output.weight, targets, self.loss_chunk, z_loss, tally)
        return cross_entropy(self.output(hidden), targets, z_loss, tally)

    def _mtp_loss(self, trunk: torch.Tensor, targets: torch.Tensor, cos, sin, bias) -> torch.Tensor:
        """The mean loss of the multi-token prediction depths, from the trunk's last hidden states
        and shifted_targets (batch, seq, 1 + depths). Inputs t_0..t_{T-1} have targets t_1..t_T;
        depth k at position i joins the previous depth's h_i with Emb(t_{i+k}) (column k - 1) and
        predicts t_{i+k+1} (column k), at the T - k positions whose token that is (DeepSeek-V3's
        depths see sequences one shorter each). Attention is causal (within documents, with a
        bias), so the k positions past them, whose targets are IGNORE, change nothing of the others:
        every depth runs on the whole sequence — the shape tensor and context parallelism split."""
        hidden, losses = trunk, []
        for k, depth in enumerate(self.mtp, start=1):
            ahead = targets[..., k - 1].clamp(min=0)  # (past the end, IGNORE, reads token 0: its loss is masked)
            hidden, normed = depth(hidden, self.tok_embeddings(ahead), cos, sin, bias)
            losses.append(local_value(self._loss(normed, targets[..., k])))  # (a DTensor under tp)
        total = torch.stack(losses)
        if self.cp_group is not None:
            # Each rank's means are over its part of the sequences, which holds fewer of the
            # positions a depth predicts where the sequences end: weighted by its share of them,
            # the mean of the ranks' losses (what FSDP's average over cp makes of the gradients)
            # is the whole sequences' loss.
            counts = (targets[..., 1:] != IGNORE).flatten(0, -2).sum(0).to(total.dtype)
            whole = counts.clone()
            dist.all_reduce(whole, group=self.cp_group)
            total = total * counts * dist.get_world_size(self.cp_group) / whole
        return total.mean()
