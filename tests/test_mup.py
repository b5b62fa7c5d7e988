"""muP (model.mup_base_dim): its initialisation and learning rates, the same model as the standard
parametrization at the base width, and the coordinate check of Yang et al. 2022 — after a few
Adam steps at one learning rate, the logits move by as much at 8x the width under muP, and by
about 8x as much without it (and Muon's hidden updates keep their spectral norm)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from scaletrain.config import ConfigError, load_config
from scaletrain.data.shards import open_split
from scaletrain.model.llama import Transformer
from scaletrain.train.optim import build_optimizer, set_lr

TINY = ROOT / "configs" / "tiny.toml"


def config(dim: int, *overrides: str):
    """tiny.toml's model at width `dim`, heads of 16."""
    return load_config(TINY, ["model.vocab_size=512", f"model.dim={dim}", f"model.n_heads={dim // 16}",
                              f"model.n_kv_heads={dim // 16}", *overrides])


def optimizer_for(model, cfg, lr=1e-3, kind="adamw"):
    return build_optimizer(model, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device=torch.device("cpu"),
                           kind=kind, width_mult=cfg.model.width_mult)


def lr_by_name(model, optimizer) -> dict[str, float]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}


def test_mup_starts_and_steps_each_kind_of_weight_as_its_fan_in_asks():
    cfg = config(256, "model.mup_base_dim=64", "model.moe_experts=4", "model.n_layers=8")  # m = 4
    assert cfg.model.width_mult == 4
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    weights = dict(model.named_parameters())
    residual = 0.02 / 2 / 4  # init_std / sqrt(m) / sqrt(2 n_layers)
    for name, std in {"tok_embeddings.weight": 0.02, "layers.0.attention.wq.weight": 0.01,
                      "layers.0.feed_forward.experts.w1": 0.01, "layers.0.attention.wo.weight": residual,
                      "layers.0.feed_forward.experts.w2": residual, "layers.0.feed_forward.router.weight": 0.005,
                      "output.weight": 0.005}.items():
        assert weights[name].std().item() == pytest.approx(std, rel=0.06), name
    for kind in ("adamw", "muon"):
        optimizer = optimizer_for(model, cfg, kind=kind)
        set_lr(optimizer, 2e-3)
        lrs = lr_by_name(model, optimizer)
        assert len(lrs) == len(weights)
        for name, lr in lrs.items():
            slow = weights[name].ndim >= 2 and not name.startswith("tok_embeddings")
            # Muon's hidden matrices: lr / sqrt(m) (its update's spectral norm grows as sqrt(width))
            hidden = kind == "muon" and name.startswith("layers.") and slow and not name.endswith("router.weight")
            assert lr == pytest.approx(1e-3 if hidden else 5e-4 if slow else 2e-3), (kind, name)
        assert {g["weight_decay"] for g in optimizer.param_groups if g["params"][0].ndim >= 2} == {0.1}


def test_at_its_base_width_mup_is_the_standard_parametrization():
    standard, mup = config(64), config(64, "model.mup_base_dim=64")
    models = []
    for cfg in (standard, mup):
        torch.manual_seed(0)
        models.append(Transformer(cfg.model))
        optimizer = optimizer_for(models[-1], cfg)
        set_lr(optimizer, 3e-3)
        assert set(lr_by_name(models[-1], optimizer).values()) == {3e-3}
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_mup_refuses_tied_embeddings():
    with pytest.raises(ConfigError, match="untie them"):
        config(128, "model.mup_base_dim=64", "model.tie_embeddings=true")


def update_size(dim: int, data, *overrides: str, lr: float = 3e-3, steps: int = 5, kind: str = "adamw") -> float:
    """Root mean square of how far `steps` steps at `lr` moved the logits of a batch of real
    text, for the model at width `dim` (kind "muon": the spectral norm of how far they moved
    the second block's MLP output matrix, a hidden matrix Muon steps)."""
    cfg = config(dim, *overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = optimizer_for(model, cfg, lr=lr, kind=kind)
    hidden = model.layers["1"].feed_forward.w2.weight
    start = hidden.detach().clone()
    inputs, targets = data[:, :-1], data[:, 1:]
    with torch.no_grad():
        before = model(inputs)
    for _ in range(steps):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        if kind == "muon":
            return torch.linalg.matrix_norm(hidden - start, ord=2).item()
        return (model(inputs) - before).pow(2).mean().sqrt().item()


def test_the_coordinate_check_muP_keeps_the_logits_update_as_the_width_grows_and_standard_does_not(stdlib_data):
    """Widths 32 and 256 (8x apart; 64 and 512 measured alike at four times the cost)."""
    split = open_split(stdlib_data, "train")
    data = torch.from_numpy(np.stack([split.read(i * 65, 65) for i in range(16)]))
    widths, base = (32, 256), "model.mup_base_dim=32"
    standard = [update_size(dim, data) for dim in widths]
    mup = [update_size(dim, data, base) for dim in widths]
    assert standard[0] == pytest.approx(mup[0], rel=1e-6)  # the same model at the base width
    # Measured: 0.23 -> 0.21 under muP; 0.23 -> 1.73 without it (Adam's steps grow the logits as
    # the fan-in of the head). (At 64 -> 512: 0.41 at both; 0.41 -> 3.4.)
    assert 0.5 < mup[1] / mup[0] < 2, mup
    assert standard[1] / standard[0] > 4, standard
    # Muon's hidden updates: measured 0.035 -> 0.031 under muP; 0.035 -> 0.084 without. (At 64 ->
    # 512: 0.044 at both; 0.044 -> 0.115, and 0.016 at 512 had they been slowed by 1 / m, as Adam's are.)
    standard = [update_size(dim, data, kind="muon") for dim in widths]
    mup = [update_size(dim, data, base, kind="muon") for dim in widths]
    assert 0.7 < mup[1] / mup[0] < 1.4, mup
    assert standard[1] / standard[0] > 2, standard


def test_a_mup_run_resumes_with_the_losses_of_one_that_never_stopped(stdlib_data, tmp_path):
    from conftest import tiny_config
    from scaletrain.train.metrics import read_metrics
    from scaletrain.train.trainer import train

    common = ["model.dim=128", "model.n_heads=8", "model.n_kv_heads=4", "model.mup_base_dim=32", "train.steps=6",
              "checkpoint.interval=3", "eval.interval=3"]
    train(tiny_config(stdlib_data, tmp_path / "whole", *common))
    train(tiny_config(stdlib_data, tmp_path / "split", *common), stop_at_step=3)
    train(tiny_config(stdlib_data, tmp_path / "split", *common))
    for kind in ("train", "eval"):
        whole, split = ({r["step"]: r["loss"] for r in read_metrics(tmp_path / run, kind)} for run in ("whole", "split"))
        assert split == whole, kind  # (the loaded optimizer keeps each group's share of the rate)
