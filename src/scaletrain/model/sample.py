"""Autoregressive sampling from a `Transformer`, with or without a KV cache."""

from __future__ import annotations

import torch

from scaletrain.model.llama import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,  # (batch, prompt_len) token ids
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    vocab: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The new tokens (batch, n_new), n_new <= max_new_tokens, sampled one at a time.

    temperature 0 is greedy (argmax), as is one too small for float32 (below 1.2e-38, where the
    logits' largest would divide to 0 / 0); otherwise logits / temperature, restricted to the
    top_k most likely tokens when top_k is given and to the smallest set of them whose
    probabilities sum to top_p when that is (nucleus sampling: Holtzman et al. 2020, "The
    Curious Case of Neural Text Degeneration"), are sampled with `generator` (on the
    model's device). With `eos_id`, a sequence that has produced it keeps producing it,
    and generation stops once every sequence has. With `vocab`, only ids below it are produced:
    the tokenizer's ids, where the embedding has rows beyond them (model.vocab_size rounds the
    tokenizer's size up to a multiple of 64), which decode to nothing.

    With the cache, the prompt is processed once (prefill) and each step feeds one token;
    the whole sequence, prompt included, stops at model.cfg.max_seq_len tokens. Without it,
    each step re-runs the full sequence, cropped to its last max_seq_len tokens, so it can
    go on past max_seq_len (and gives the same tokens as the cache up to there).

    The caller puts the model in eval mode (`model.eval()`); this function changes no mode.
    """
    if prompt.dim() != 2:
        raise ValueError(f"prompt must be (batch, seq) token ids; got shape {tuple(prompt.shape)}")
    batch, prompt_len = prompt.shape
    max_seq_len = model.cfg.max_seq_len
    cache = None
    if use_cache:
        if prompt_len > max_seq_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens but model.max_seq_len = {max_seq_len}; "
                "shorten the prompt or pass use_cache=False to crop it"
            )
        max_new_tokens = min(max_new_tokens, max_seq_len - prompt_len)
        cache = model.new_cache(batch, prompt_len + max_new_tokens)

    sequence = prompt  # (batch, seq so far)
    unseen = prompt  # tokens the cache has not yet processed
    finished = torch.zeros(batch, dtype=torch.bool, device=prompt.device)
    new_tokens = []
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(sequence[:, -max_seq_len:])
        else:
            logits = model(unseen, cache=cache, start_pos=sequence.shape[1] - unseen.shape[1])
        token = _pick(logits[:, -1, :vocab], temperature, top_k, generator, top_p)  # (batch,)
        if eos_id is not None:
            token = torch.where(finished, eos_id, token)
            finished |= token == eos_id
        new_tokens.append(token)
        unseen = token[:, None]
        sequence = torch.cat([sequence, unseen], dim=1)
        if eos_id is not None and bool(finished.all()):
            break
    if not new_tokens:
        return prompt.new_empty(batch, 0)
    return torch.stack(new_tokens, dim=1)


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator,
          top_p: float | None = None) -> torch.Tensor:
    """One token per row of logits (batch, vocab)."""
    if temperature < torch.finfo(torch.float32).tiny:  # (0, or a float32 zero: greedy, not a 0 / 0)
        return logits.argmax(dim=-1)
    logits = logits.float()  # (less its largest before the division: a tiny temperature overflows nothing, it is greedy)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (batch, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= top_p  # the likelier tokens already hold top_p (never the likeliest)
        logits = logits.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)[:, 0]
