"""Parameter and FLOP counts of the dense decoder in `model/llama.py`, from its shape alone.

This is the one place these numbers are derived; training (MFU), planning and scaling
all call it. Pure arithmetic: it imports neither torch nor the config module, and takes
any object with the attributes of `scaletrain.config.ModelConfig` that it reads:
`vocab`, `dim`, `n_layers`, `n_heads`, `kv_heads`, `head_dim`, `hidden_dim`, `qk_norm`,
`tie_embeddings`.
"""

from __future__ import annotations

from typing import Any


def param_counts(cfg: Any) -> dict[str, int]:
    """Parameters of the model, split as in Kaplan et al. 2020 ("Scaling Laws for Neural
    Language Models", section 2.1): `embedding` is the token embedding matrix (vocab x dim),
    `non_embedding` is everything else (blocks, final norm and, when untied, the output
    head), `total` is their sum. With tied embeddings the shared matrix is counted once,
    in `embedding`. Equals `sum(p.numel() for p in Transformer(cfg).parameters())`.
    """
    embedding = cfg.vocab * cfg.dim
    per_layer = _block_linear_params(cfg) + 2 * cfg.dim  # + attention_norm, ffn_norm
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim  # q_norm, k_norm: one weight over head_dim each
    non_embedding = cfg.n_layers * per_layer + cfg.dim  # + final norm
    if not cfg.tie_embeddings:
        non_embedding += cfg.vocab * cfg.dim  # output head
    return {"total": embedding + non_embedding, "embedding": embedding, "non_embedding": non_embedding}


def matmul_params(cfg: Any) -> int:
    """Weights that each token multiplies through: every linear layer of the blocks and the
    output head. The embedding is a lookup and norms are elementwise, so neither counts;
    the output head counts whether or not it is tied to the embedding."""
    return cfg.n_layers * _block_linear_params(cfg) + cfg.vocab * cfg.dim


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
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return 6 * matmul_params(cfg) + (attention // 2 if causal else attention)


def forward_flops_per_token(cfg: Any, seq_len: int) -> int:
    """FLOPs of a forward pass per token: one third of `train_flops_per_token` (2 N + 4 L H Q T)."""
    return train_flops_per_token(cfg, seq_len) // 3


def _block_linear_params(cfg: Any) -> int:
    # wq, wo: dim x (n_heads * head_dim); wk, wv: dim x (kv_heads * head_dim);
    # SwiGLU w1, w3: dim x hidden, w2: hidden x dim.
    attention = 2 * cfg.dim * cfg.n_heads * cfg.head_dim + 2 * cfg.dim * cfg.kv_heads * cfg.head_dim
    mlp = 3 * cfg.dim * cfg.hidden_dim
    return attention + mlp
