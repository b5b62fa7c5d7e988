"""The optimizers: Muon's orthogonalised updates, its split of the parameters with AdamW, a
skipped step, exact resumes, and matrices split by rows orthogonalised one rank each."""

from __future__ import annotations

import math
import pytest
import torch

from conftest import ROOT, run_with_retry, tiny_config
from zygote import run_ranks, script
from scaletrain.config import ConfigError, load_config
from scaletrain.model.llama import Transformer
from scaletrain.train.metrics import read_metrics
from scaletrain.train.optim import Muon, build_optimizer, orthogonalise
from scaletrain.train.trainer import train


def test_newton_schulz_brings_every_singular_value_near_one_matrix_by_matrix():
    torch.manual_seed(0)
    for shape in ((64, 192), (192, 64), (3, 48, 32)):
        update = torch.randn(shape) * torch.logspace(-2, 0, shape[-1])  # columns over two decades
        singular = torch.linalg.svdvals(orthogonalise(update))
        assert singular.min() > 0.6 and singular.max() < 1.25, (shape, singular.min(), singular.max())  # the quintic's band
    stack = torch.randn(3, 48, 32)
    assert torch.allclose(orthogonalise(stack)[1], orthogonalise(stack[1]), atol=1e-6)  # experts one by one


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    cfg = load_config("configs/tiny.toml", ["model.vocab_size=512", "model.moe_experts=4"])
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                                device=torch.device("cpu"), kind="muon", momentum=0.9)
    names = {id(p): name for name, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g.get("muon") for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g.get("muon") for p in g["params"]}
    assert "layers.0.attention.wq.weight" in muon and "layers.1.feed_forward.experts.w2" in muon
    assert "layers.0.feed_forward.router.weight" in muon
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"} <= adamw
    assert not muon & adamw and len(muon | adamw) == len(names)
    [group] = [g for g in optimizer.param_groups if g.get("muon")]
    assert group["momentum"] == 0.9 and group["weight_decay"] == 0.1


def test_a_step_with_found_inf_changes_nothing_and_a_step_without_moves_by_the_scaled_orthogonal_update():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(32, 96))
    optimizer = Muon([{"params": [weight], "muon": True, "momentum": 0.5}], lr=0.1, weight_decay=0.0)
    weight.grad = torch.randn(32, 96)
    before = weight.detach().clone()
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    assert torch.equal(weight, before) and not optimizer.state[weight]["momentum_buffer"].any()
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    # Nesterov: the gradient plus momentum times the new buffer (the gradient itself, first time)
    expected = before - 0.1 * 0.2 * math.sqrt(96) * orthogonalise(weight.grad * 1.5)
    assert torch.allclose(weight, expected, atol=1e-6)
    assert torch.equal(optimizer.state[weight]["momentum_buffer"], weight.grad)
    step_rms = (weight - before).pow(2).mean().sqrt().item()
    assert 0.1 * 0.2 * 0.6 < step_rms < 0.1 * 0.2 * 1.2  # Moonlight's scale: AdamW's typical 0.2 lr


def test_a_muon_run_learns_resumes_bit_exactly_and_keeps_its_optimizer(stdlib_data, tmp_path):
    common = ["train.optimizer=muon", "train.steps=8", "eval.interval=4", "checkpoint.interval=4"]
    whole = tmp_path / "whole"
    train(tiny_config(stdlib_data, whole, *common))
    split = tmp_path / "split"
    train(tiny_config(stdlib_data, split, *common), stop_at_step=4)
    train(tiny_config(stdlib_data, split, *common))
    losses = {name: {r["step"]: r["loss"] for r in read_metrics(tmp_path / name, "train")} for name in ("whole", "split")}
    assert losses["split"] == losses["whole"] and len(losses["whole"]) == 8
    assert losses["whole"][8] < losses["whole"][1] - 0.2
    with pytest.raises(ConfigError, match="train.optimizer muon then, adamw now"):
        train(tiny_config(stdlib_data, split, "train.steps=12"))


def test_the_embedding_can_be_left_undecayed_as_olmo_2_trained(stdlib_data, tmp_path):
    """train.embedding_decay = false: the embedding's rows no batch touches (those past the
    tokenizer's 512 ids, where model.vocab_size is larger) keep their values, where decay shrinks
    them; the other matrices decay alike; a resume may not change it."""
    from scaletrain.train.checkpoint import load_newest
    from scaletrain.train.trainer import Trainer

    rows = {}
    for decay in ("true", "false"):
        cfg = tiny_config(stdlib_data, tmp_path / f"decay-{decay}", "train.steps=3", "eval.interval=0",
                          f"train.embedding_decay={decay}", "train.weight_decay=0.5", "model.vocab_size=576")
        trainer = Trainer(cfg)
        first = trainer.model.tok_embeddings.weight.detach().clone()
        decayed = {group["weight_decay"] for group in trainer.optimizer.param_groups
                   if any(p is trainer.model.tok_embeddings.weight for p in group["params"])}
        assert decayed == ({0.5} if decay == "true" else {0.0})
        assert any(group["weight_decay"] == 0.5 for group in trainer.optimizer.param_groups)  # (the blocks')
        trainer.fit()
        state = {"model": Transformer(trainer.cfg.model).state_dict()}  # (resolved: the data's vocabulary)
        load_newest(tmp_path / f"decay-{decay}" / "checkpoints", state)
        unused = slice(512, None)  # (rows past the stdlib tokenizer's 512 ids)
        rows[decay] = (first[unused], state["model"]["tok_embeddings.weight"][unused])
    assert torch.equal(*rows["false"])
    assert torch.all(rows["true"][1].abs() < rows["true"][0].abs() + 1e-12) and not torch.equal(*rows["true"])
    with pytest.raises(ConfigError, match="train.embedding_decay False then, True now"):
        train(tiny_config(stdlib_data, tmp_path / "decay-false", "train.steps=6", "train.embedding_decay=true",
                          "train.weight_decay=0.5", "model.vocab_size=576"))


def test_matrices_split_by_rows_are_orthogonalised_by_one_rank_each_to_the_bit():
    """Three real processes over gloo (tests/muon_shared_out.py asserts on every rank)."""
    run_with_retry(lambda: run_ranks(script, (str(ROOT / "tests" / "muon_shared_out.py"), []), 3, timeout=300),
                   "3 ranks of muon_shared_out.py")
