"""muP (model.mup_base_dim): its initialisation and learning rates, the same model as the standard
parametrization at the base width, and the coordinate check of Yang et al. 2022 — after a few
Adam steps at one learning rate, the logits move by as much at 8x the width under muP, and by
about 8x as much without it (and Muon's hidden updates keep their spectral norm). Depth-wise muP
(model.mup_base_layers, CompleteP): its factors, its residual multiplier folded into the weights
trains as the multiplier itself does, and its coordinate check across depth."""

from __future__ import annotations

import copy

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


def optimizer_for(model, cfg, lr=1e-3, kind="adamw", weight_decay=0.1, eps=1e-8):
    return build_optimizer(model, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), eps=eps,
                           device=torch.device("cpu"), kind=kind, width_mult=cfg.model.width_mult,
                           depth_mult=cfg.model.depth_mult, depth_alpha=cfg.model.mup_depth_alpha)


def lr_by_name(model, optimizer, key="lr") -> dict[str, float]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: group[key] for group in optimizer.param_groups for p in group["params"]}


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
        lrs, decays, epss = (lr_by_name(model, optimizer, key) for key in ("lr", "weight_decay", "eps"))
        assert len(lrs) == len(weights)
        for name, lr in lrs.items():
            slow = weights[name].ndim >= 2 and not name.startswith("tok_embeddings")
            # Muon's hidden matrices: lr / sqrt(m) (its update's spectral norm grows as sqrt(width))
            hidden = kind == "muon" and name.startswith("layers.") and slow and not name.endswith("router.weight")
            assert lr == pytest.approx(1e-3 if hidden else 5e-4 if slow else 2e-3), (kind, name)
            # The decay per step, lr x weight_decay, the base width's: 0.1 x 2e-3 for every matrix.
            assert decays[name] * lr == pytest.approx(2e-4 if weights[name].ndim >= 2 else 0), (kind, name)
            # Adam's eps / m where muP's gradients shrink as 1 / width; as at the base width where
            # the head's (and routers') 1 / m is folded into the weight.
            folded = name == "output.weight" or name.endswith("router.weight")
            assert epss[name] == pytest.approx(1e-8 if folded else 2.5e-9), (kind, name)


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


def update_size(dim: int, data, *overrides: str, lr: float = 3e-3, steps: int = 5, kind: str = "adamw",
                blocks: bool = False) -> float:
    """Root mean square of how far `steps` steps at `lr` moved the logits of a batch of real
    text, for the model at width `dim` (kind "muon": the spectral norm of how far they moved
    the second block's MLP output matrix, a hidden matrix Muon steps; blocks: of how far they
    moved what the blocks add to the residual stream, the final norm's input less the embedding)."""
    cfg = config(dim, *overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = optimizer_for(model, cfg, lr=lr, kind=kind)
    hidden = model.layers["1"].feed_forward.w2.weight
    start = hidden.detach().clone()
    inputs, targets = data[:, :-1], data[:, 1:]
    seen = {}
    if blocks:
        model.tok_embeddings.register_forward_hook(lambda module, args, out: seen.update(embedding=out.detach()))
        model.norm.register_forward_pre_hook(lambda module, args: seen.update(added=args[0].detach() - seen["embedding"]))
    with torch.no_grad():
        before = model(inputs) if not blocks else (model(inputs), seen["added"])[1]
    for _ in range(steps):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        if kind == "muon":
            return torch.linalg.matrix_norm(hidden - start, ord=2).item()
        after = model(inputs) if not blocks else (model(inputs), seen["added"])[1]
        return (after - before).pow(2).mean().sqrt().item()


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

    # (Depth-wise muP too: its groups' shares of the decay and of Adam's eps come back with the config.)
    common = ["model.dim=128", "model.n_heads=8", "model.n_kv_heads=4", "model.mup_base_dim=32", "train.steps=6",
              "model.mup_base_layers=1", "checkpoint.interval=3", "eval.interval=3"]
    train(tiny_config(stdlib_data, tmp_path / "whole", *common))
    train(tiny_config(stdlib_data, tmp_path / "split", *common), stop_at_step=3)
    train(tiny_config(stdlib_data, tmp_path / "split", *common))
    for kind in ("train", "eval"):
        whole, split = ({r["step"]: r["loss"] for r in read_metrics(tmp_path / run, kind)} for run in ("whole", "split"))
        assert split == whole, kind  # (the loaded optimizer keeps each group's share of the rate)


def test_depth_mup_starts_and_steps_each_kind_of_weight_as_completep_asks():
    # d = 8 / 2 = 4, alpha 1/2: the residual multiplier 1/2; with muP's width m = 2.
    cfg = config(128, "model.mup_base_dim=64", "model.n_layers=8", "model.mup_base_layers=2",
                 "model.mup_depth_alpha=0.5", "model.moe_experts=4", "model.moe_shared_experts=1",
                 "model.qk_norm=true", "model.mtp_depth=1")
    assert (cfg.model.depth_mult, cfg.model.residual_scale) == (4, 0.5)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    weights = dict(model.named_parameters())
    residual = 0.02 / 2 ** 0.5 / 2  # init_std / sqrt(m) / sqrt(2 mup_base_layers): the base depth's
    for name, std in {"layers.0.attention.wq.weight": 0.02 / 2 ** 0.5, "layers.0.attention.wo.weight": residual / 2,
                      "layers.0.feed_forward.experts.w2": residual / 2, "layers.0.feed_forward.shared.w2.weight":
                      residual / 2, "mtp.0.block.attention.wo.weight": residual, "output.weight": 0.01}.items():
        assert weights[name].std().item() == pytest.approx(std, rel=0.08), name
    for kind in ("adamw", "muon"):
        optimizer = optimizer_for(model, cfg, lr=1e-3, kind=kind, eps=1e-8)
        lrs, decays, epss = (lr_by_name(model, optimizer, key) for key in ("lr", "weight_decay", "eps"))
        assert len(lrs) == len(weights)
        for name, lr in lrs.items():
            matrix = weights[name].ndim >= 2
            width = 1 if not matrix or name.startswith("tok_embeddings") else 2 ** 0.5 if (
                kind == "muon" and not name.startswith("output") and not name.endswith("router.weight")) else 2
            trunk = name.startswith("layers.")
            residual = trunk and (".wo." in name or ".w2" in name)
            depth = 1 / 4 if residual else 4 ** -0.5 if trunk else 1  # lr d^(alpha - 1), and s of it for W' = s W
            assert lr == pytest.approx(1e-3 / width * depth), (kind, name)
            # The width's decay times m (or sqrt(m): lr x decay as at the base width), the depth's
            # fold's times d^alpha.
            assert decays[name] == pytest.approx(0 if not matrix else 0.1 * width * (2 if residual else 1)), (kind, name)
            folded = name.startswith("output") or name.endswith("router.weight")
            assert epss[name] == pytest.approx(1e-8 * (1 / 2 if trunk and not residual else 1) * (1 if folded else 1 / 2)), (
                kind, name)


def test_at_its_base_depth_depth_mup_is_the_standard_parametrization():
    standard, mup = config(64, "model.n_layers=3"), config(64, "model.n_layers=3", "model.mup_base_layers=3")
    models, optimizers = [], []
    for cfg in (standard, mup):
        torch.manual_seed(0)
        models.append(Transformer(cfg.model))
        optimizers.append(optimizer_for(models[-1], cfg))
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    def groups(optimizer):  # (the groups a checkpoint of the standard parametrization holds)
        return [(len(g["params"]), g["lr"], g["weight_decay"], g["eps"]) for g in optimizer.param_groups]
    assert groups(optimizers[0]) == groups(optimizers[1])
    with pytest.raises(ConfigError, match="model.mup_depth_alpha = 0.5 is set but model.mup_base_layers is not"):
        config(64, "model.mup_depth_alpha=0.5")


def _train_both(stdlib_data, models, optimizers) -> dict[int, list[float]]:
    """Four steps of the same batches for each model with its optimizer: their losses."""
    split = open_split(stdlib_data, "train")
    losses = {i: [] for i in range(len(models))}
    for step in range(4):
        batch = torch.from_numpy(np.stack([split.read((step * 8 + i) * 65, 65) for i in range(8)]))
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[i].append(loss.item())
    return losses


def test_the_logit_multiplier_folded_into_the_head_trains_as_the_multiplier_itself(stdlib_data):
    """muP written out — the logits times 1 / m, the head started m times as large and stepped at
    the base rate and decay, the blocks' matrices at lr / m with decay x m, Adam's eps / m for
    all (their gradients 1 / m as large) — against the model that trains: 1 / m folded into the
    head with its own rate, decay and eps. A large eps and decay, so that either factor wrong
    shows."""
    cfg = config(128, "model.mup_base_dim=32")  # m = 4
    m, lr, eps, decay = 4.0, 3e-3, 1e-4, 0.5
    torch.manual_seed(0)
    folded = Transformer(cfg.model)
    written = copy.deepcopy(folded)
    written.output.weight.data *= m
    written.output.register_forward_hook(lambda module, args, out: out / m)
    groups = []
    for name, p in written.named_parameters():
        hidden = p.ndim >= 2 and name.startswith("layers.")
        groups.append({"params": [p], "lr": lr / m if hidden else lr, "eps": eps / m,
                       "weight_decay": 0.0 if p.ndim < 2 else decay * m if hidden else decay})
    optimizers = [optimizer_for(folded, cfg, lr=lr, weight_decay=decay, eps=eps),
                  torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=True)]
    losses = _train_both(stdlib_data, (folded, written), optimizers)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, a), b in zip(folded.state_dict().items(), written.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b / m if name == "output.weight" else b, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_the_residual_multiplier_folded_into_the_weights_trains_as_the_multiplier_itself(stdlib_data, alpha):
    """CompleteP written out — each block's attention and MLP outputs times s = d^-alpha, the
    blocks' parameters at lr d^(alpha - 1) and eps d^-alpha — against the model that trains:
    s folded into wo and w2 with their own rate, decay and eps. A large eps and decay, so that
    either factor wrong shows."""
    cfg = config(64, "model.n_layers=6", "model.mup_base_layers=2", f"model.mup_depth_alpha={alpha}",
                 "model.qk_norm=true")
    d, s = 3.0, 3.0 ** -alpha
    lr, eps, decay = 3e-3, 1e-4, 0.5
    torch.manual_seed(0)
    folded = Transformer(cfg.model)
    written = copy.deepcopy(folded)
    for block in written.layers.values():
        for linear in (block.attention.wo, block.feed_forward.w2):
            linear.weight.data /= s
            linear.register_forward_hook(lambda module, args, out: out * s)
    groups = []
    for name, p in written.named_parameters():
        trunk = name.startswith("layers.")
        groups.append({"params": [p], "lr": lr * (d ** (alpha - 1) if trunk else 1),
                       "eps": eps * (d ** -alpha if trunk else 1), "weight_decay": decay if p.ndim >= 2 else 0.0})
    optimizers = [optimizer_for(folded, cfg, lr=lr, weight_decay=decay, eps=eps),
                  torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=True)]
    losses = _train_both(stdlib_data, (folded, written), optimizers)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, a), b in zip(folded.state_dict().items(), written.state_dict().values(), strict=True):
        scale = s if name.endswith(("wo.weight", "w2.weight")) else 1.0
        torch.testing.assert_close(a, b * scale, rtol=1e-4, atol=1e-7, msg=name)


def test_the_coordinate_check_across_depth(stdlib_data):
    """What the blocks add to the residual stream moves as far after 5 Adam steps at 16 blocks as
    at 2 under CompleteP, and about 9x as far in the standard parametrization."""
    split = open_split(stdlib_data, "train")
    data = torch.from_numpy(np.stack([split.read(i * 65, 65) for i in range(16)]))
    sizes = {name: [update_size(64, data, f"model.n_layers={n}", *extra, blocks=True) for n in (2, 16)]
             for name, extra in (("standard", []), ("completep", ["model.mup_base_layers=2"]))}
    # Measured: 0.031 -> 0.033 under CompleteP; 0.031 -> 0.28 without it.
    assert sizes["standard"][0] == pytest.approx(sizes["completep"][0], rel=1e-6)
    assert 0.5 < sizes["completep"][1] / sizes["completep"][0] < 2, sizes
    assert sizes["standard"][1] / sizes["standard"][0] > 4, sizes


def test_clipping_and_the_logged_norms_count_the_gradients_with_the_multipliers_written_out(stdlib_data, tmp_path):
    """The trainer's gradient norm (and each part's gradient and weight norm) under width and depth
    muP is that of the model with muP's output
    multiplier 1 / m and the residual multiplier d^-alpha written out (the weights that fold them
    divided by them, the multipliers applied to their outputs), and clipping leaves each folded
    gradient 1 / s times the written-out model's clipped one: the same training."""
    from conftest import tiny_config
    from scaletrain.train.trainer import Trainer

    cfg = tiny_config(stdlib_data, tmp_path / "run", "model.n_layers=4", "model.mup_base_layers=1",
                      "model.mup_depth_alpha=0.5", "model.mup_base_dim=16", "train.clip=0.05")
    trainer = Trainer(cfg)
    m, s = 4.0, 4.0 ** -0.5
    written = copy.deepcopy(trainer.model)
    multipliers = {"output.weight": 1 / m}
    for name, block in written.layers.items():
        for linear, path in ((block.attention.wo, "attention.wo"), (block.feed_forward.w2, "feed_forward.w2")):
            multipliers[f"layers.{name}.{path}.weight"] = s
    for name, multiplier in multipliers.items():
        module = written.get_submodule(name.removesuffix(".weight"))
        module.weight.data /= multiplier
        module.register_forward_hook(lambda module, args, out, multiplier=multiplier: out * multiplier)
    inputs, targets = trainer.loader.next_batch()[:2]
    trainer.model(inputs, targets).backward()
    F.cross_entropy(written(inputs).flatten(0, 1), targets.flatten()).backward()
    trainer.loader.close()

    def written_norms(of):  # each part's norm in the written-out model
        return {"embedding": of(written.tok_embeddings.weight).norm().item(),
                "head": torch.cat([of(written.norm.weight), of(written.output.weight).flatten()]).norm().item(),
                **{f"layers.{name}": torch.cat([of(p).flatten() for p in block.parameters()]).norm().item()
                   for name, block in written.layers.items()}}

    assert trainer._norms_by_part(grads=True) == pytest.approx(written_norms(lambda p: p.grad), rel=1e-4)
    weight_norms = trainer._norms_by_part(grads=False)
    assert weight_norms == pytest.approx(written_norms(lambda p: p.detach()), rel=1e-5)
    folded_block = torch.cat([p.detach().flatten() for p in trainer.model.layers["0"].parameters()]).norm()
    # (the folded weights' norms differ, by far more than the tolerance: the norms' ones dominate)
    assert abs(weight_norms["layers.0"] / folded_block.item() - 1) > 1e-3
    folded_norm = torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).norm().item()
    norm = trainer._clip_gradients(cfg.train.clip).item()
    written_norm = torch.nn.utils.clip_grad_norm_(written.parameters(), cfg.train.clip).item()
    assert norm == pytest.approx(written_norm, rel=1e-5)
    assert abs(norm / folded_norm - 1) > 0.1, (norm, folded_norm)  # (the folded gradients alone would differ)
    assert norm > 2 * cfg.train.clip  # (clipping acts)
    for (name, p), q in zip(trainer.model.named_parameters(), written.parameters(), strict=True):
        torch.testing.assert_close(p.grad * multipliers.get(name, 1.0), q.grad, rtol=1e-4, atol=1e-8, msg=name)
