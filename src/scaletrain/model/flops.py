"""Parameter and FLOP counts of the dense decoder in `model/llama.py`, from its shape alone.

This is the one place these numbers are derived; training (MFU), planning and scaling
all call it. Pure arithmetic: it imports neither torch nor the config module, and takes
any object with the attributes of `scaletrain.config.ModelConfig` that it reads:
`vocab`, `dim`, `n_layers`, `n_heads`, `kv_heads`, `head_dim`, `hidden_dim`, `qk_norm`,
`tie_embeddings` (and, where present, the mixture-of-experts settings and `mtp_depth`).
"""

from __future__ import annotations

from typing import Any


def param_counts(cfg: Any) -> dict[str, int]:
    """Parameters of the model, split as in Kaplan et al. 2020 ("Scaling Laws for Neural
    Language Models", section 2.1): `embedding` is the token embedding matrix (vocab x dim),
    `non_embedding` is everything else (blocks, final norm and, when untied, the output
    head), `total` is their sum. With tied embeddings the shared matrix is counted once,
    in `embedding`. Equals `sum(p.numel() for p in Transformer(cfg).parameters())`. `active`
    counts what a token passes through: all of a dense model; of a mixture of experts, the
    router and moe_top_k of the routed experts (plus the shared ones) in each such block.
    `mtp` counts the modules of multi-token prediction (model.mtp_depth), which training runs and
    an exported model leaves out; they are in `non_embedding` and `total` too.
    """
    embedding = cfg.vocab * cfg.dim
    norms = 2 * cfg.dim + (2 * cfg.head_dim if cfg.qk_norm else 0)  # attention_norm, ffn_norm (+ q_norm, k_norm)
    # Each depth: a dense block, a 2 dim x dim projection and three norms (model/llama.py).
    mtp = _mtp_depth(cfg) * (_dense_block_linear_params(cfg) + norms + 2 * cfg.dim * cfg.dim + 3 * cfg.dim)
    non_embedding = _blocks_linear_params(cfg) + cfg.n_layers * norms + cfg.dim + mtp  # + final norm
    if not cfg.tie_embeddings:
        non_embedding += cfg.vocab * cfg.dim  # output head
    total = embedding + non_embedding
    # A mixture of experts runs each token through moe_top_k of its routed experts only.
    active = total - _blocks_linear_params(cfg) + _blocks_linear_params(cfg, active=True)
    return {"total": total, "embedding": embedding, "non_embedding": non_embedding, "active": active, "mtp": mtp}


def matmul_params(cfg: Any) -> int:
    """Weights that each token multiplies through: every linear layer of the blocks (of a
    mixture of experts, the router and the experts the token is routed to) and the output head. The embedding is a lookup and norms are elementwise, so neither counts;
    the output head counts whether or not it is tied to the embedding. Training's multi-token
    prediction adds, per depth, its block, its projection and another pass through the head
    (counted over every position, though depth k scores T - k of T)."""
    return _blocks_linear_params(cfg, active=True) + cfg.vocab * cfg.dim + _mtp_depth(cfg) * _mtp_matmul_params(cfg)


def train_flops_per_token(cfg: Any, seq_len: int, causal: bool = False) -> int:
    """FLOPs of one forward and backward pass, per token, at sequence length `seq_len`.

    6 N for the matmuls (2 forward, 4 backward: gradients of inputs and of weights;
    Kaplan et al. 2020, section 2.1) plus 12 L H Q T for attention scores and their
    weighted sum (PaLM, Chowdhery et al. 2022, appendix B), with N = `matmul_params`,
    L layers, H query heads of width Q, context T. The attention term is counted over the
    whole T x T score matrix, without halving for the causal mask, as
    `torch.utils.flop_counter.FlopCounterMode` counts SDPA; elementwise work (norms,
    rotary, softmax, SiLU, loss) is not counted. `causal` counts only the lower triangle of
    the scores, the work a causal kernel (FlashAttention) does: half the attention term.
    """
    attention = (cfg.n_layers + _mtp_depth(cfg)) * attention_flops_per_token(cfg, seq_len)
    return 6 * matmul_params(cfg) + (attention // 2 if causal else attention)


def attention_flops_per_token(cfg: Any, seq_len: int) -> int:
    """The attention term of one block's `train_flops_per_token`, over the whole score matrix:
    12 H Q T."""
    return 12 * cfg.n_heads * cfg.head_dim * seq_len


def mtp_train_flops_per_token(cfg: Any, seq_len: int, causal: bool = False) -> int:
    """The share of `train_flops_per_token` that multi-token prediction's depths take: per depth,
    6 x (its block's linear weights, its 2d x d projection and the head it passes through again)
    plus its block's attention term (halved with `causal`). 0 without depths. Under pipeline
    parallelism this work runs on the last stage, beside the head."""
    attention = attention_flops_per_token(cfg, seq_len)
    return _mtp_depth(cfg) * (6 * _mtp_matmul_params(cfg) + (attention // 2 if causal else attention))


def block_train_flops_per_token(cfg: Any, seq_len: int, causal: bool = False) -> float:
    """`train_flops_per_token` of one block, on average over the model's: all of it but the output
    head's 6 V d and multi-token prediction's depths, over the blocks."""
    head = 6 * cfg.vocab * cfg.dim
    return (train_flops_per_token(cfg, seq_len, causal) - head - mtp_train_flops_per_token(cfg, seq_len, causal)) \
        / cfg.n_layers


def forward_flops_per_token(cfg: Any, seq_len: int) -> int:
    """FLOPs of a forward pass per token: one third of `train_flops_per_token` (2 N + 4 L H Q T)."""
    return train_flops_per_token(cfg, seq_len) // 3


def moe_layers(cfg: Any) -> int:
    """Blocks whose MLP is a mixture of experts (0 for a dense model)."""
    if not getattr(cfg, "moe_experts", 0):
        return 0
    return cfg.n_layers - cfg.moe_dense_layers


def _mtp_depth(cfg: Any) -> int:
    return getattr(cfg, "mtp_depth", 0) or 0


def _mtp_matmul_params(cfg: Any) -> int:
    """The weights a token multiplies through in one depth of multi-token prediction: its dense
    block, its 2d x d projection and another pass through the output head."""
    return _dense_block_linear_params(cfg) + 2 * cfg.dim * cfg.dim + cfg.vocab * cfg.dim


def attention_linear_params(cfg: Any) -> int:
    """The linear weights of a block's attention: wq, wo, dim x (n_heads * head_dim); wk, wv,
    dim x (kv_heads * head_dim)."""
    return 2 * cfg.dim * cfg.n_heads * cfg.head_dim + 2 * cfg.dim * cfg.kv_heads * cfg.head_dim


def _dense_block_linear_params(cfg: Any) -> int:
    """The linear weights of a dense block: attention and the SwiGLU MLP (w1, w3: dim x hidden,
    w2: hidden x dim)."""
    return attention_linear_params(cfg) + 3 * cfg.dim * cfg.hidden_dim


def _blocks_linear_params(cfg: Any, active: bool = False) -> int:
    """The linear weights of all blocks; with `active`, only those a token multiplies through
    (of a mixture of experts: the router, moe_top_k routed experts and the shared ones)."""
    attention, dense = attention_linear_params(cfg), _dense_block_linear_params(cfg)
    sparse = moe_layers(cfg)
    if not sparse:
        return cfg.n_layers * dense
    routed = cfg.moe_top_k if active else cfg.moe_experts
    expert = 3 * cfg.dim * (cfg.moe_ffn_dim or cfg.hidden_dim)
    mixture = attention + cfg.dim * cfg.moe_experts + (routed + cfg.moe_shared_experts) * expert  # + the router
    return (cfg.n_layers - sparse) * dense + sparse * mixture
