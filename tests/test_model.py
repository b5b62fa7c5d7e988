"""The dense decoder: shapes, loss at init, causality, KV-cache decoding, init, meta build, learning."""

import math

import pytest
import torch

from scaletrain.config import ModelConfig
from scaletrain.model.llama import RMSNorm, Transformer, document_causal_mask, document_ids, repeat_kv_heads
from scaletrain.model.sample import generate

SHAPES = {
    "mha": {},
    "tied": {"tie_embeddings": True},
    "gqa": {"n_kv_heads": 2},
    "gqa_qk_norm": {"n_kv_heads": 1, "qk_norm": True},
}


def tiny(**overrides) -> ModelConfig:
    shape = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    return ModelConfig(**(shape | overrides))


def build(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny(**overrides))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_gives_logits_and_a_loss_near_uniform_at_init(shape):
    model = build(**shape)
    tokens = torch.randint(0, 256, (2, 32))
    targets = torch.randint(0, 256, (2, 32))
    assert model(tokens).shape == (2, 32, 256)
    loss = model(tokens, targets)
    assert loss.shape == () and torch.isfinite(loss)
    # Small init: logits are near zero, so the loss is near that of a uniform guess.
    assert abs(loss.item() - math.log(256)) < 0.3


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_changing_a_future_token_leaves_earlier_logits_unchanged(shape):
    model = build(**shape)
    tokens = torch.randint(0, 256, (1, 24))
    changed = tokens.clone()
    changed[0, 15] = (tokens[0, 15] + 1) % 256
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=0)
    assert not torch.allclose(a[:, 15:], b[:, 15:])


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_packed_documents_under_the_document_mask_give_the_logits_of_each_alone(shape):
    model = build(**shape)
    eos = 255
    first, second, third = torch.randint(0, 255, (12,)), torch.randint(0, 255, (30,)), torch.randint(0, 255, (9,))
    packed = torch.cat([first, torch.tensor([eos]), second, torch.tensor([eos]), third])[None]  # (1, 53)
    documents = document_ids(packed, eos)
    assert documents.tolist() == [[0] * 13 + [1] * 31 + [2] * 9]  # each end-of-document token closes its document
    with torch.no_grad():
        masked, unmasked = model(packed, documents=documents), model(packed)
        # Rotary embeddings depend on relative positions only: a document later in the sequence
        # scores its keys as it would alone from position 0.
        alone = [model(torch.cat([first, torch.tensor([eos])])[None]), model(second[None]), model(third[None])]
    torch.testing.assert_close(masked[:, :13], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked[:, 13:43], alone[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked[:, 44:], alone[2], atol=1e-5, rtol=1e-5)
    assert (unmasked[:, 13:] - masked[:, 13:]).abs().max() > 1e-2  # without the mask the documents mix
    torch.testing.assert_close(unmasked[:, :13], masked[:, :13])
    with pytest.raises(ValueError, match="KV cache takes none"):
        model(packed, cache=model.new_cache(1), documents=documents)


def test_repeated_key_value_heads_attend_as_grouped_query_attention():
    """What a masked call on CUDA does instead of enable_gqa (which that kernel lacks)."""
    q, k, v = torch.randn(2, 6, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    mask = document_causal_mask(torch.tensor([[0] * 4 + [1] * 6, [0] * 10]))
    grouped = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    repeated = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv_heads(k, 6), repeat_kv_heads(v, 6),
                                                                attn_mask=mask)
    torch.testing.assert_close(repeated, grouped)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cached_chunks_give_the_logits_of_one_full_forward(shape):
    model = build(**shape)
    tokens = torch.randint(0, 256, (2, 20))
    full = model(tokens)  # (2, 20, 256)
    cache = model.new_cache(batch=2)
    # Prefill at 0, a multi-token chunk at start_pos > 0 (explicit mask), then single steps.
    pieces = [model(tokens[:, :7], cache=cache, start_pos=0), model(tokens[:, 7:12], cache=cache, start_pos=7)]
    pieces += [model(tokens[:, p : p + 1], cache=cache, start_pos=p) for p in range(12, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [SHAPES["mha"], SHAPES["gqa_qk_norm"]], ids=["mha", "gqa_qk_norm"])
def test_greedy_generation_is_the_same_with_and_without_the_kv_cache(shape):
    model = build(**shape).eval()
    prompt = torch.randint(0, 256, (2, 6))
    cached = generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=True)
    uncached = generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=False)
    assert cached.shape == (2, 30)
    assert torch.equal(cached, uncached)


def test_generation_with_the_cache_stops_at_max_seq_len():
    model = build().eval()
    prompt = torch.randint(0, 256, (1, 60))
    assert generate(model, prompt, max_new_tokens=30, temperature=0).shape == (1, 4)
    assert generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=False).shape == (1, 30)


def test_sampling_is_reproducible_with_a_generator_and_respects_top_k_and_eos():
    model = build().eval()
    prompt = torch.randint(0, 256, (3, 4))
    draw = lambda: generate(model, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(1))  # noqa: E731
    assert torch.equal(draw(), draw())

    # top_k = 1 is greedy.
    top1 = generate(model, prompt, 12, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(top1, generate(model, prompt, 12, temperature=0))

    # Generation stops at the step where eos appears (here, in the only row).
    greedy = generate(model, prompt[:1], 12, temperature=0)[0]
    eos = int(greedy[3])
    first = int((greedy == eos).nonzero()[0, 0])
    stopped = generate(model, prompt[:1], 12, temperature=0, eos_id=eos)[0]
    assert torch.equal(stopped, greedy[: first + 1])

    # A row that has emitted eos keeps emitting it while other rows go on.
    rows = generate(model, prompt, 12, temperature=0, eos_id=eos)
    first_in_row0 = int((rows[0] == eos).nonzero()[0, 0])
    assert (rows[0, first_in_row0:] == eos).all()

    # Only the tokenizer's ids, where the embedding has rows beyond them: here the output head's rows
    # from 200 on are made the likeliest, and are never drawn.
    with torch.no_grad():
        model.output.weight[200:] = model.output.weight[:56] * 50
    assert (generate(model, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(3)) >= 200).any()
    kept = generate(model, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(3), vocab=200)
    assert (kept < 200).all() and (generate(model, prompt, 12, temperature=0, vocab=200) < 200).all()
    # A temperature too small to divide by is greedy, not a softmax of infinities.
    assert torch.equal(generate(model, prompt, 12, temperature=1e-39, generator=torch.Generator().manual_seed(4)),
                       generate(model, prompt, 12, temperature=0))


def test_output_projections_get_the_scaled_init_and_tied_weights_are_one_tensor():
    cfg = tiny(dim=256, n_layers=4, n_heads=4, init_std=0.02)
    model = Transformer(cfg)
    residual_std = 0.02 / math.sqrt(2 * 4)
    for block in model.layers.values():
        for weight in (block.attention.wo.weight, block.feed_forward.w2.weight):
            assert weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert torch.equal(block.attention_norm.weight, torch.ones(256))
    assert model.output.weight.std().item() == pytest.approx(0.02, rel=0.05)

    tied = Transformer(tiny(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert len(list(tied.parameters())) == len(list(Transformer(tiny()).parameters())) - 1


@pytest.mark.parametrize("shape", [SHAPES["mha"], SHAPES["tied"]], ids=["mha", "tied"])
def test_meta_build_then_to_empty_and_init_weights_gives_a_working_model(shape):
    cfg = tiny(**shape)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.init_weights()
    reference = Transformer(cfg)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(model.rope_sin, reference.rope_sin, rtol=0, atol=0)
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, 256, (2, 16))
    loss = model(tokens, torch.randint(0, 256, (2, 16)))
    assert abs(loss.item() - math.log(256)) < 0.3
    # Rope tables are derived, not state: they stay out of checkpoints.
    assert not any("rope" in key for key in model.state_dict())


def test_adamw_on_a_repeated_batch_lowers_the_loss():
    model = build(n_kv_heads=2, qk_norm=True)
    tokens = torch.randint(0, 256, (4, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_rms_norm_keeps_its_input_and_scale_for_backward_with_torchs_values(dtype):
    """The blocks' RMSNorm: torch's values (in float32 its forward bit for bit; in bf16 computed
    in float32 and rounded once, as CUDA's fused kernel does, where the CPU's composite rounds
    twice) and gradients, keeping for backward only its input and 1 / rms per row (as CUDA's
    fused kernel does), not the normalised input the composite rms_norm would keep too."""
    torch.manual_seed(0)
    ours, theirs = RMSNorm(64, eps=1e-5), torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    ours.to(dtype), theirs.to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype)
    xs = [x.clone().requires_grad_() for _ in range(2)]

    def kept(inputs: torch.Tensor, autocast: bool = False) -> tuple[torch.Tensor, list]:
        saved = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = ours(inputs)
        return out, sorted((tuple(t.shape), t.dtype) for t in saved if t.dim() == 3)  # (not the weight)

    y, saved = kept(xs[0])
    assert saved == [((3, 5, 1), torch.float32), ((3, 5, 64), dtype)]
    expected = theirs(xs[1])
    if dtype == torch.float32:
        assert torch.equal(y, expected)
    else:
        wide = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * ours.weight.float()
        assert torch.equal(y, wide.to(dtype))
        torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tolerance)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, **tolerance)
    # Under autocast: an input of the weight's dtype as it is (FSDP's bf16 parameters and bf16
    # stream: the bf16 input kept); another taken to float32 with the weight, as CUDA's autocast
    # runs rms_norm (a float32 copy kept).
    y, saved = kept(x.clone().requires_grad_(), autocast=True)
    assert y.dtype == dtype and saved == [((3, 5, 1), torch.float32), ((3, 5, 64), dtype)]
    if dtype == torch.float32:
        half = x.detach().to(torch.bfloat16).requires_grad_()
        y, saved = kept(half, autocast=True)
        assert y.dtype == torch.float32 and saved == [((3, 5, 1), torch.float32), ((3, 5, 64), torch.float32)]
        wide = half.detach().float().requires_grad_()
        expected = torch.nn.functional.rms_norm(wide, (64,), ours.weight.detach(), 1e-5)
        torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
        grad = torch.randn_like(y)
        y.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(half.grad, wide.grad.to(torch.bfloat16))


@pytest.mark.parametrize("seq", [50, 200])  # (one partial block of 128 scores; two blocks, the second partial)
def test_flex_attention_trains_the_losses_and_gradients_of_sdpas_mask(seq):
    """model.attention_kernel = "flex": FlexAttention's block mask computes the attention of
    SDPA's mask — within documents, within a sliding window, both — with grouped heads and
    multi-token prediction (whose depths take the same mask), forward and backward; unmasked
    causal attention and decoding with a cache stay SDPA's."""
    from conftest import flex_on_cpu

    from scaletrain.model.llama import BlockMask, attention_bias, flex_block_mask
    from scaletrain.parallel.recompute import apply_recompute

    tokens = torch.randint(0, 255, (2, seq))
    tokens[tokens % 23 == 0] = 255  # (documents of about 23 tokens)
    documents = document_ids(tokens, 255)
    targets = torch.randint(0, 255, (2, seq))
    for masks in ({"documents": True}, {"window": 16}, {"documents": True, "window": 40},
                  {"documents": True, "window": 16, "full": [0]}, {"window": 16, "full": [1]}):
        shape = dict(n_kv_heads=2, max_seq_len=256, mtp_depth=1, sliding_window=masks.get("window"),
                     full_attention_layers=masks.get("full"))
        runs = []
        for kernel in ("sdpa", "flex"):
            model = build(**shape, attention_kernel=kernel)
            # Selective recomputation, which keeps attention's output (FlexAttention's operator too).
            apply_recompute(model, "selective" if masks.get("window") == 40 else "none")
            with flex_on_cpu():
                loss = model(tokens, targets, documents=documents if masks.get("documents") else None)
                loss.backward()
            runs.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
        (sdpa_loss, sdpa_grads), (flex_loss, flex_grads) = runs
        torch.testing.assert_close(flex_loss, sdpa_loss, rtol=1e-5, atol=1e-6)
        for name, grad in sdpa_grads.items():
            torch.testing.assert_close(flex_grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{masks} {name}: {m}")
    x = torch.zeros(1, seq, 8)
    with flex_on_cpu():
        assert isinstance(attention_bias(x, seq, documents, flex=True), BlockMask)
        assert attention_bias(x, seq, flex=True) is None  # (causal: flash's)
        assert isinstance(attention_bias(x, seq, window=8, flex=True), BlockMask)
        assert attention_bias(x, seq, window=seq, flex=True) is None  # (a window spanning the sequence: causal)
        # Context parallelism (positions given) takes SDPA's mask for its attention over gathered keys.
        assert isinstance(attention_bias(x, seq, documents, positions=torch.arange(seq), flex=True), torch.Tensor)
    assert isinstance(attention_bias(x, seq, documents, flex=True), torch.Tensor)  # (the CPU's: SDPA's mask)
    if seq == 200:  # CUDA's compiled construction of the block mask: the same blocks, for other documents too
        from unittest import mock

        from scaletrain.model import llama
        def blocks(docs, window):  # (which blocks are skipped, partly and wholly kept: the mask's tensors)
            return [t for t in flex_block_mask(512, docs, window, "cpu").as_tuple() if isinstance(t, torch.Tensor)]

        long = torch.randint(0, 255, (2, 512))
        long[long % 61 == 0] = 255
        cases = [(document_ids(long, 255), 200), (document_ids(long, 255), None), (torch.zeros_like(long), None)]
        eager = [blocks(*case) for case in cases]
        with mock.patch.object(llama, "create_block_mask", llama._compiled_create_block_mask()):
            compiled = [blocks(*case) for case in cases]
        same = [all(torch.equal(a, b) for a, b in zip(x, y, strict=True)) for x, y in zip(eager, compiled, strict=True)]
        assert all(same)
        for a, b in ((0, 1), (1, 2)):  # (three masks of other blocks: a check that tells them apart)
            assert not all(torch.equal(x, y) for x, y in zip(eager[a], eager[b]))
    # Decoding with a cache past the window: SDPA's mask, the logits of a full forward.
    model = build(n_layers=2, sliding_window=4, attention_kernel="flex").eval()
    with torch.no_grad(), flex_on_cpu():
        full = model(tokens[:1, :24])
        cache = model.new_cache(1, 24)
        pieces = [model(tokens[:1, :10], cache=cache),
                  *(model(tokens[:1, i:i + 1], cache=cache, start_pos=i) for i in range(10, 24))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_full_attention_layers_attend_over_the_whole_sequence_between_windowed_ones():
    """Two blocks with a window of 4: position 19 reads tokens 13 .. 19 through both; with either
    block in model.full_attention_layers, every earlier token (still within its document, with
    documents); decoding with the cache gives the logits of one full forward."""
    tokens = torch.randint(0, 255, (1, 24))
    other = tokens.clone()
    other[0, 2] = (other[0, 2] + 1) % 255
    split = tokens.clone()
    split[0, 5] = 255  # (a document ends there: token 2 lies in the one before position 19's)
    moved = split.clone()
    moved[0, 2] = (moved[0, 2] + 1) % 255
    for full, reaches in ((None, False), ([1], True), ([0], True)):
        model = build(n_layers=2, sliding_window=4, full_attention_layers=full).eval()
        with torch.no_grad():
            assert (not torch.allclose(model(other)[0, 19], model(tokens)[0, 19])) == reaches, full
            assert torch.allclose(model(moved, documents=document_ids(moved, 255))[0, 19],
                                  model(split, documents=document_ids(split, 255))[0, 19]), full
            whole = model(tokens)
            cache = model.new_cache(1, 24)
            pieces = [model(tokens[:, :10], cache=cache),
                      *(model(tokens[:, i:i + 1], cache=cache, start_pos=i) for i in range(10, 24))]
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"model.full_attention_layers = \[1\] names the blocks .* model.sliding_window, "
                                         "which is unset"):
        tiny(full_attention_layers=[1])
    with pytest.raises(ValueError, match=r"names blocks \[2\] of a model of 2; list blocks 0 to 1"):
        tiny(sliding_window=4, full_attention_layers=[0, 2])
    assert tiny(sliding_window=4, full_attention_layers=[1, 0]).full_attention_layers == [0, 1]
    # A pipeline stage builds the masks its own blocks take, not the other kind's (the depths of
    # multi-token prediction attend as the last block). (Within documents: whole blocks take a mask too.)
    x, documents = torch.zeros(1, 24, 64), document_ids(tokens, 255)
    for held, mtp, kinds in (("0", 0, {"window"}), ("1", 0, {"whole"}), ("1", 1, {"window", "whole"})):
        stage = build(n_layers=3, sliding_window=4, full_attention_layers=[1], mtp_depth=mtp)
        for name in [name for name in stage.layers if name != held]:
            del stage.layers[name]
        masks = stage.attention_masks(x, 24, documents)
        assert {"window" if i != 1 else "whole" for i, mask in masks.items() if mask is not None} == kinds, held
        assert masks[int(held)] is not None


def test_a_sliding_window_limits_what_each_token_attends_to_in_training_and_decoding():
    """model.sliding_window = 4 on one block: position p's logits depend on tokens p - 3 .. p
    only, within documents too; a window spanning the sequence is causal attention; decoding
    with the cache (in chunks, and a token at a time) gives the logits of one full forward."""
    model = build(n_layers=1, sliding_window=4).eval()
    tokens = torch.randint(0, 255, (1, 24))
    with torch.no_grad():
        base = model(tokens)
        for moved, changes in ((15, False), (16, True), (19, True), (20, False)):  # (20: after it)
            other = tokens.clone()
            other[0, moved] = (other[0, moved] + 1) % 255
            changed = not torch.allclose(model(other)[0, 19], base[0, 19])
            assert changed == changes, moved
        # Within documents as well: a token attends to the window's part of its own document.
        split = tokens.clone()
        split[0, 17] = 255  # (a document ends there)
        documents = document_ids(split, 255)
        within = model(split, documents=documents)
        other = split.clone()
        other[0, 17] = 255
        other[0, 16] = (other[0, 16] + 1) % 255  # (the previous document, inside the window)
        assert torch.allclose(model(other, documents=document_ids(other, 255))[0, 19], within[0, 19])
        # A window as long as the sequence computes causal attention.
        wide = build(n_layers=1, sliding_window=24).eval()
        plain = build(n_layers=1).eval()
        assert torch.allclose(wide(tokens), plain(tokens), atol=1e-6)
        # Decoding with the cache, past the window.
        deep = build(n_layers=2, sliding_window=4).eval()
        full = deep(tokens)
        cache = deep.new_cache(1, 24)
        pieces = [deep(tokens[:, :10], cache=cache), *(deep(tokens[:, i:i + 1], cache=cache, start_pos=i)
                                                      for i in range(10, 24))]
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
