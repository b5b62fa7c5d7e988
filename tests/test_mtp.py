"""Multi-token prediction (model.mtp_depth, DeepSeek-V3): which tokens each depth reads and
predicts, its share of the gradient and none of the loss, its counts, training and resuming with
it, starting it from a checkpoint without it, exporting without it, and refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import tiny_config
from scaletrain.config import ConfigError, ModelConfig, load_config
from scaletrain.hf import export_hf
from scaletrain.model.flops import param_counts, train_flops_per_token
from scaletrain.model.llama import Transformer
from scaletrain.model.loss import Tally
from scaletrain.parallel.layout import check_layout, resolve_layout
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import Trainer, train

SHAPE = dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def model_and_tokens(depth: int, seed: int = 0) -> tuple[Transformer, torch.Tensor]:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**SHAPE, mtp_depth=depth)), torch.randint(0, 96, (3, 17))  # 16 inputs + 1


def test_each_depth_joins_the_token_k_ahead_and_predicts_the_one_after():
    """From a stream x_0..x_16 (inputs x_0..x_15): depth 1 at position i joins the trunk's h_i
    with Emb(x_{i+1}) and predicts x_{i+2}; depth 2 joins depth 1's state with Emb(x_{i+2}) and
    predicts x_{i+3}. Spelled out on the raw stream, the mean of their losses is what the model
    tallies; a token past x_{i+k} changes nothing at depth k's position i."""
    model, stream = model_and_tokens(2)
    model.train()
    model.mtp_tally = Tally()
    model(stream[:, :-1], stream[:, 1:])
    with torch.no_grad():
        trunk = stream[:, :16]
        cos, sin = model.rope_cos, model.rope_sin
        h = model.tok_embeddings(trunk)
        for block in model.layers.values():
            h = block(h, cos, sin)
        losses, states = [], []
        for k, depth in enumerate(model.mtp, start=1):
            h, normed = depth(h[:, :16 - k], model.tok_embeddings(stream[:, k:16]), cos, sin)
            states.append(h)
            logits = model.output(normed)
            losses.append(F.cross_entropy(logits.flatten(0, 1), stream[:, k + 1:17].flatten()))
    assert model.mtp_tally.total.item() == pytest.approx(sum(losses).item() / 2, rel=1e-5)
    assert model.mtp_tally.count.item() == 1
    # Causality: a new x_12 leaves depth 1's positions ≤ 10 and depth 2's ≤ 9 as they were.
    changed = stream.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 96
    with torch.no_grad():
        h = model.tok_embeddings(changed[:, :16])
        for block in model.layers.values():
            h = block(h, cos, sin)
        for k, depth in enumerate(model.mtp, start=1):
            h, _ = depth(h[:, :16 - k], model.tok_embeddings(changed[:, k:16]), cos, sin)
            unchanged = 12 - k  # positions i with i + k < 12
            torch.testing.assert_close(h[:, :unchanged], states[k - 1][:, :unchanged], rtol=0, atol=1e-6)
            assert not torch.allclose(h[:, unchanged], states[k - 1][:, unchanged])


def test_it_enters_the_gradient_at_its_weight_and_not_the_loss():
    """The loss returned is the trunk's next-token loss, with or without the depths, at any
    weight; the gradient is the trunk's plus weight x the depths' (linear in the weight); in
    evaluation the depths do not run."""
    model, stream = model_and_tokens(2)
    inputs, targets = stream[:, :-1], stream[:, 1:]
    plain = Transformer(ModelConfig(**SHAPE))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    model.train()
    gradients, values = [], []
    for weight in (0.0, 0.3, 0.6):
        model.zero_grad()
        model.mtp_weight = weight
        loss = model(inputs, targets)
        loss.backward()
        values.append(loss.item())
        gradients.append(model.layers["0"].attention.wq.weight.grad.clone())
    assert values[0] == values[1] == values[2] == plain(inputs, targets).item()
    assert model.mtp[0].proj.weight.grad.abs().sum() > 0
    assert not torch.allclose(gradients[0], gradients[1])
    torch.testing.assert_close(gradients[2] - gradients[0], 2 * (gradients[1] - gradients[0]), rtol=1e-4, atol=1e-7)
    model.eval()
    model.mtp_tally = Tally()
    with torch.no_grad():
        assert model(inputs, targets).item() == values[0]
    assert model.mtp_tally.count is None  # (nothing ran)


def test_counts_include_the_depths_that_training_runs():
    cfg, plain = ModelConfig(**SHAPE, mtp_depth=2), ModelConfig(**SHAPE)
    counts = param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in Transformer(cfg).parameters())
    assert counts["total"] - counts["mtp"] == param_counts(plain)["total"] and param_counts(plain)["mtp"] == 0
    # Per depth: a dense block, the 2 dim x dim projection, another pass through the head.
    block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * cfg.hidden_dim
    extra = 2 * (6 * (block + 2 * 64 * 64 + 96 * 64) + 12 * 4 * 16 * 16)
    assert train_flops_per_token(cfg, 16) - train_flops_per_token(plain, 16) == extra


def test_a_run_logs_it_resumes_exactly_and_exports_without_it(stdlib_data, tmp_path):
    common = ["model.mtp_depth=1", "train.steps=6", "checkpoint.interval=3", "eval.interval=3", "log.interval=1"]
    whole = tmp_path / "whole"
    train(tiny_config(stdlib_data, whole, *common))
    records = read_metrics(whole, "train")
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"]
    assert records[-1]["mtp_loss"] > records[-1]["loss"]  # two tokens ahead: harder than one, once either is learnt
    split = tmp_path / "split"
    train(tiny_config(stdlib_data, split, *common), stop_at_step=3)
    train(tiny_config(stdlib_data, split, *common))
    assert [(r["loss"], r["mtp_loss"]) for r in read_metrics(split, "train")] == [
        (r["loss"], r["mtp_loss"]) for r in records]

    export_hf(whole, tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert not [name for name in exported if "mtp" in name]
    cfg = load_config(whole / "config.toml")
    counts = param_counts(cfg.model)
    assert sum(t.numel() for t in exported.values()) == counts["total"] - counts["mtp"]

    # A next stage that adds the depths starts them afresh from a checkpoint without them (their
    # optimizer state too, the rest of it taken from the checkpoint).
    plain = tmp_path / "plain"
    train(tiny_config(stdlib_data, plain, "train.steps=2", "eval.interval=0"))
    staged = tmp_path / "staged"
    stage = tiny_config(stdlib_data, staged, "model.mtp_depth=1", "train.steps=2", "eval.interval=0",
                        f"checkpoint.init_from={plain}")
    trainer = Trainer(stage)
    trainer.init_from_checkpoint()
    state = trainer.optimizer.state
    named = dict(trainer.model.named_parameters())
    assert not state[named["mtp.0.proj.weight"]]["exp_avg"].any()  # afresh
    assert state[named["mtp.0.proj.weight"]]["step"] == 0
    assert state[named["layers.0.attention.wq.weight"]]["exp_avg"].any()  # the checkpoint's
    trainer.loader.close()
    train(stage)
    [start] = read_metrics(staged, "start")
    assert start["init_step"] == 2 and start["init_optimizer"]
    assert all("mtp_loss" in r for r in read_metrics(staged, "train"))


def test_every_layout_takes_the_depths_and_depths_beyond_the_sequence_are_refused(stdlib_data, tmp_path):
    """Tensor, context and pipeline parallelism, looping or V-shaped, take the depths
    (tests/test_distributed.py trains them); depths that leave a context-parallel rank nothing to
    predict do not."""
    for schedule in ("dualpipev", "interleaved_zero_bubble"):
        cfg = tiny_config(stdlib_data, tmp_path / "run", "model.mtp_depth=1", "parallel.dp_shard=1", "parallel.pp=2",
                          "train.micro_batch=1", f"parallel.pp_schedule={schedule}", "model.n_layers=4")
        check_layout(resolve_layout(cfg.parallel, 2), cfg)
    for layout in (["parallel.tp=2"], ["parallel.cp=2"]):
        cfg = tiny_config(stdlib_data, tmp_path / "run", "model.mtp_depth=2", "model.vocab_size=512",
                          "parallel.dp_shard=1", *layout)
        check_layout(resolve_layout(cfg.parallel, 2), cfg)
    cfg = tiny_config(stdlib_data, tmp_path / "run", "model.mtp_depth=32", "parallel.dp_shard=1", "parallel.cp=2")
    with pytest.raises(ConfigError, match="model.mtp_depth = 32 would leave a context-parallel rank no position to "
                                          "predict; with parallel.cp = 2 it must be below data.seq_len / 2 = 32"):
        check_layout(resolve_layout(cfg.parallel, 2), cfg)
    with pytest.raises(ConfigError, match="model.mtp_depth = 64 is not below data.seq_len = 64"):
        tiny_config(stdlib_data, tmp_path / "run", "model.mtp_depth=64")


def test_within_documents_each_depth_attends_only_to_its_documents_positions():
    """model.document_mask: an end of document at position 8 of 16; a change to token 3 (the first
    document) leaves every depth's states at positions 9 on as they were (each depth's attention
    masked to the document of its positions), where without the mask they change."""
    from scaletrain.model.llama import document_bias, document_ids

    model, stream = model_and_tokens(1)
    eos = 95
    stream[stream == eos] = 0
    stream[:, 8] = eos
    changed = stream.clone()
    changed[:, 3] = (changed[:, 3] + 1) % 95

    def depth_states(tokens: torch.Tensor, masked: bool, normed: bool = False) -> torch.Tensor:
        inputs = tokens[:, :16]
        bias = document_bias(document_ids(inputs, eos), torch.float32) if masked else None
        with torch.no_grad():
            h = model.tok_embeddings(inputs)
            for block in model.layers.values():
                h = block(h, model.rope_cos, model.rope_sin, bias=bias)
            part = None if bias is None else bias[:, :, :15, :15]
            return model.mtp[0](h[:, :15], model.tok_embeddings(tokens[:, 1:16]), model.rope_cos, model.rope_sin,
                                part)[int(normed)]
    torch.testing.assert_close(depth_states(changed, True)[:, 9:], depth_states(stream, True)[:, 9:], rtol=0, atol=0)
    assert not torch.allclose(depth_states(changed, False)[:, 9:], depth_states(stream, False)[:, 9:])
    # The model's own loss of the depth, within documents, is this one's.
    model.train()
    model.mtp_tally = Tally()
    model(stream[:, :-1], stream[:, 1:], documents=document_ids(stream[:, :-1], eos))
    with torch.no_grad():
        logits = model.output(depth_states(stream, True, normed=True))
    expected = F.cross_entropy(logits.flatten(0, 1), stream[:, 2:17].flatten())
    assert model.mtp_tally.total.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_covers_the_depths_and_changes_no_gradient(mode):
    """parallel.recompute wraps each depth's block as it does the trunk's: the same loss, gradients
    and state-dict names as without it."""
    import copy

    from scaletrain.parallel.recompute import apply_recompute

    model, stream = model_and_tokens(2)
    wrapped = copy.deepcopy(model)
    apply_recompute(wrapped, mode)
    assert all(type(depth.block).__name__ == "CheckpointWrapper" for depth in wrapped.mtp)
    assert list(wrapped.state_dict()) == list(model.state_dict())
    for m in (model, wrapped):
        m.train()
        m.mtp_weight = 0.3
        m(stream[:, :-1], stream[:, 1:]).backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in wrapped.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)
