"""The gradient noise scale (train/noise.py): the estimators recover a known gradient and noise,
and the trainer's estimates are those of its first micro-batch's and whole step's gradients,
computed here again by hand."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_config
from scaletrain.train import noise
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import Trainer


def test_the_estimators_recover_the_true_gradient_and_the_trace_of_its_noise():
    """Per-example gradients G + noise of covariance diag(sigma^2) in 64 dimensions; batches of
    256 whose first 32 are the small batch, as a step's first micro-batch."""
    generator = torch.Generator().manual_seed(0)
    dims, small, big, steps = 64, 32, 256, 4000
    true = torch.randn(dims, generator=generator, dtype=torch.float64) * 0.05
    sigma = torch.linspace(0.2, 1.0, dims, dtype=torch.float64)
    examples = true + sigma * torch.randn(steps, big, dims, generator=generator, dtype=torch.float64)
    small_sq = examples[:, :small].mean(1).square().sum(-1)
    big_sq = examples.mean(1).square().sum(-1)
    stats, sums = noise.new_stats(), torch.zeros(2, dtype=torch.float64)
    for s, b in zip(small_sq.tolist(), big_sq.tolist()):
        grad_sq, trace = noise.estimates(s, b, small, big)
        sums += torch.tensor([grad_sq, trace])
        stats = noise.update(stats, grad_sq, trace)
    grad_sq, trace = (sums / steps).tolist()
    assert grad_sq == pytest.approx(true.square().sum().item(), rel=0.05)
    assert trace == pytest.approx(sigma.square().sum().item(), rel=0.02)
    # The moving averages' ratio: noisier (the last ~20 estimates), right in size.
    assert noise.noise_scale(stats) == pytest.approx(sigma.square().sum().item() / true.square().sum().item(), rel=0.5)
    assert noise.noise_scale(noise.new_stats()) is None
    for negative in ([1.0, -1.0, 1.0], [-1.0, 1.0, 1.0]):  # early estimates below zero: no scale yet
        assert noise.noise_scale(torch.tensor(negative, dtype=torch.float64)) is None
    assert torch.equal(noise.update(stats, math.nan, 1.0), stats)
    with pytest.raises(ValueError, match="must be smaller"):
        noise.estimates(1.0, 1.0, 256, 256)


def test_a_step_measures_its_first_micro_batch_against_the_whole_step(stdlib_data, tmp_path):
    """tiny.toml's steps are of 2 micro-batches of 4 sequences; the same step again by hand, on a
    trainer of the same seed reading the same batches."""
    cfg = tiny_config(stdlib_data, tmp_path / "run", "train.steps=2", "train.warmup_steps=1")
    measured = Trainer(cfg)
    measured.train_step(look=True)
    got = measured.noise
    measured.loader.close()

    by_hand = Trainer(tiny_config(stdlib_data, tmp_path / "other", "train.steps=2", "train.warmup_steps=1"))
    model = by_hand.model
    norms = []
    for _ in range(2):
        inputs, targets, documents = by_hand._batch(*by_hand.loader.next_batch())
        (model(inputs, targets, documents=documents) / 2).backward()
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
    by_hand.loader.close()
    small_sq, big_sq = (2 * norms[0]) ** 2, norms[1] ** 2
    tokens = cfg.train.global_batch_tokens
    expected = noise.estimates(small_sq, big_sq, tokens // 2, tokens)
    assert got["noise_grad_sq"] == pytest.approx(expected[0], rel=1e-5)
    assert got["noise_trace"] == pytest.approx(expected[1], rel=1e-5)
    assert got["noise_scale"] == pytest.approx(expected[1] / expected[0], abs=0.1)  # the first estimate alone
    assert expected[1] > 0


def test_runs_log_the_noise_scale_where_a_step_has_micro_batches_to_compare(stdlib_data, tmp_path):
    train_records = {}
    for name, overrides in {"accumulating": [], "one-micro-batch": ["train.micro_batch=8"]}.items():
        trainer = Trainer(tiny_config(stdlib_data, tmp_path / name, "train.steps=3", "eval.interval=0", *overrides))
        trainer.fit()
        train_records[name] = read_metrics(tmp_path / name, "train")
    assert all(r["noise_scale"] > 0 and "noise_trace" in r for r in train_records["accumulating"])
    assert not any(key in r for r in train_records["one-micro-batch"]
                   for key in ("noise_scale", "noise_grad_sq", "noise_trace"))
