"""The optimizers: AdamW, with weight decay on matrices only; or Muon for the blocks' weight
matrices with AdamW for the rest.

**Muon** (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks") replaces
each weight matrix's update by its momentum made orthogonal: five Newton–Schulz iterations of
the quintic X ← aX + (bA + cA²)X, A = XXᵀ, with (a, b, c) = (3.4445, −4.7750, 2.0315), after
scaling X to unit Frobenius norm, bring every singular value near 1. It applies to the matrices
inside the blocks (attention, MLP, experts each on its own, router); the embedding, the output
head and the vectors keep AdamW, as in Jordan et al. and in Moonlight (Liu et al. 2025, "Muon is
Scalable for LLM Training"). Each update is scaled by 0.2 · sqrt(max(rows, columns)), Moonlight's
rule that gives it AdamW's typical root-mean-square, so train.lr and train.weight_decay mean
what they mean for AdamW (Moonlight reused AdamW's; decay is decoupled, as AdamW's).

Under FSDP or tensor parallelism a rank holds a shard of a matrix, and orthogonalising a shard
is not orthogonalising the matrix: the update is gathered whole on every rank of the shard group
(one all-gather of the matrices per step, as large as FSDP's gather of the parameters), made
orthogonal there and cut back to the rank's shard. Experts sharded by expert (expert
parallelism, and FSDP's shards of them, both split dimension 0) are whole matrices already and
are orthogonalised where they lie. Every rank of a group repeats the same iterations: each costs
4m²n + 2m³ FLOPs for an m × n matrix (m ≤ n), 20m to 30m per entry over five, small beside a
step's 6 · tokens per parameter at large batches (m = 4096 against a million tokens a step:
about 2%), and left undivided here.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Jordan et al. 2024: the quintic's coefficients and iteration count.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# Not Muon's: the token embedding and the output head (their rows are looked up or scored one by one).
ADAMW_ONLY = ("tok_embeddings", "output")


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, device: torch.device, kind: str = "adamw",
                    momentum: float = 0.95) -> torch.optim.AdamW:
    """Decay applies to weight matrices (embeddings and linears), not to norm gains or other vectors:
    shrinking a norm's gain towards zero has no regularising meaning (as in GPT-3 and Llama).
    kind "muon": the blocks' matrices go to Muon (see the module's docstring)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    muon = [p for name, p in named if kind == "muon" and p.ndim >= 2
            and name.replace("_orig_mod.", "").split(".")[0] not in ADAMW_ONLY]
    chosen = {id(p) for p in muon}
    params = [p for _, p in named if id(p) not in chosen]
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    # The fused kernel is one launch per step instead of one per tensor group.
    fused = device.type in ("cuda", "cpu")
    if kind == "muon":
        optimizer = Muon([*groups, {"params": muon, "muon": True}], lr=lr, fused=fused)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, fused=fused)
    set_hyperparameters(optimizer, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum)
    return optimizer


def set_hyperparameters(optimizer: torch.optim.Optimizer, *, weight_decay: float, betas: tuple[float, float],
                        eps: float, momentum: float = 0.95) -> None:
    """Give every group the config's values again (decay on its matrices' group only): loading
    a checkpoint restores the values it was saved with, and a resumed run follows its config."""
    for group in optimizer.param_groups:
        matrices = all(p.ndim >= 2 for p in group["params"])
        group.update(weight_decay=weight_decay if matrices else 0.0, betas=betas, eps=eps)
        if group.get("muon"):
            group["momentum"] = momentum


def orthogonalise(update: torch.Tensor) -> torch.Tensor:
    """The Newton–Schulz quintic of Jordan et al. 2024 on the last two dimensions (a stack of
    matrices is a batch), in bfloat16 on a GPU as they run it, in float32 elsewhere."""
    dtype = torch.bfloat16 if update.is_cuda else torch.float32
    x = update.to(dtype)
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(update.dtype)


def _whole_where_it_lies(p: torch.Tensor) -> bool:
    """Whether each rank's part of `p` is made of whole matrices (sharded, if at all, only along
    the dimensions before the last two: the experts of a stack)."""
    return not isinstance(p, DTensor) or all(not pl.is_shard() or pl.dim < p.ndim - 2 for pl in p.placements)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor is its own)."""
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.AdamW):
    """AdamW for the groups without "muon", Muon (Nesterov momentum, orthogonalised) for those
    with it: one optimizer, so that its state saves, loads and reshards as AdamW's does. Like
    the fused AdamW, a step whose `found_inf` (set by the trainer) is nonzero changes nothing."""

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [group for group in groups if not group.get("muon")]
        try:
            super().step()
        finally:
            self.param_groups = groups
        skip = getattr(self, "found_inf", None)
        for group in groups:
            if group.get("muon"):
                self._muon_step(group, skip)

    def _muon_step(self, group: dict, skip: torch.Tensor | None) -> None:
        lr, decay, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # (and a count of steps, as AdamW's state has)
                state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] = torch.zeros((), device=local_shard(p).device)
            buffer = state["momentum_buffer"]
            momentum = buffer * mu + p.grad
            nesterov = p.grad + momentum * mu
            if _whole_where_it_lies(p):
                update = orthogonalise(local_shard(nesterov))
            else:
                whole = orthogonalise(nesterov.full_tensor())
                update = local_shard(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None))
                del whole
            del nesterov
            param, buffer, momentum = local_shard(p), local_shard(buffer), local_shard(momentum)
            stepped = param * (1 - lr * decay)
            stepped.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape[-2:])))
            del update
            if skip is not None:
                keep = skip > 0
                stepped, momentum = torch.where(keep, param, stepped), torch.where(keep, buffer, momentum)
            param.copy_(stepped)
            buffer.copy_(momentum)
            state["step"] += 1 if skip is None else (skip <= 0).float()
