"""AdamW with weight decay on matrices only."""

from __future__ import annotations

import torch
from torch import nn


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, device: torch.device) -> torch.optim.AdamW:
    """Decay applies to weight matrices (embeddings and linears), not to norm gains or other vectors:
    shrinking a norm's gain towards zero has no regularising meaning (as in GPT-3 and Llama)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    # The fused kernel is one launch per step instead of one per tensor group.
    optimizer = torch.optim.AdamW(groups, lr=lr, fused=device.type in ("cuda", "cpu"))
    set_hyperparameters(optimizer, weight_decay=weight_decay, betas=betas, eps=eps)
    return optimizer


def set_hyperparameters(optimizer: torch.optim.Optimizer, *, weight_decay: float, betas: tuple[float, float],
                        eps: float) -> None:
    """Give every group the config's values again (decay on its matrices' group only): loading
    a checkpoint restores the values it was saved with, and a resumed run follows its config."""
    for group in optimizer.param_groups:
        matrices = all(p.ndim >= 2 for p in group["params"])
        group.update(weight_decay=weight_decay if matrices else 0.0, betas=betas, eps=eps)
