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
is not orthogonalising the matrix. Under FSDP (rows split over the shard group) the matrices are
shared out among the group's ranks: largest first, each successive bucket of as many matrices
as ranks gives one to each, every rank sends its rows of each matrix to the matrix's owner and
the owner returns each rank's rows of the result (two all-to-alls a bucket). Each rank then
runs the iterations on about 1/n of the matrices, and receives and sends about 2/n of them,
against every matrix whole on every rank for an all-gather (Moonlight's distributed Muon); the
result is the same to the bit (the same iterations on the same matrices, sent in the dtype they
run in). Under tensor parallelism, alone or with FSDP, the update is gathered whole on every rank
of the mesh, orthogonalised there and cut back to the rank's shard. Experts sharded by expert
(expert parallelism, and FSDP's shards of them, both split dimension 0) are whole matrices
already and are orthogonalised where they lie. The iterations cost 4m²n + 2m³ FLOPs each for an
m × n matrix (m ≤ n), 20m to 30m per entry over five, small beside a step's 6 · tokens per
parameter at large batches (m = 4096 against a million tokens a step: about 2%, on whichever
rank runs them).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from scaletrain.model.loss import training_dtype

# Jordan et al. 2024: the quintic's coefficients and iteration count.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# Not Muon's: the token embedding and the output head (their rows are looked up or scored one by one).
ADAMW_ONLY = ("tok_embeddings", "output")


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, device: torch.device, kind: str = "adamw", momentum: float = 0.95,
                    width_mult: float = 1.0, depth_mult: float = 1.0, depth_alpha: float = 1.0,
                    exclude: list[torch.Tensor] = (), embedding_decay: bool = True) -> torch.optim.AdamW:
    """Decay applies to weight matrices (embeddings and linears), not to norm gains or other vectors:
    shrinking a norm's gain towards zero has no regularising meaning (as in GPT-3 and Llama).
    kind "muon": the blocks' matrices go to Muon (see the module's docstring). width_mult: muP's
    (model.mup_base_dim), by which every matrix but the embedding learns more slowly (AdamW's by
    1 / m, Muon's hidden matrices by 1 / sqrt(m)) and decays by as much more (weight_decay
    times m, or sqrt(m)): the decay per step, lr x weight_decay, and the timescale of the
    weights' average it sets, stay the base width's (Wang and Aitchison 2024, "How to set AdamW's
    weight decay as you scale model and dataset size"; CompleteP's reference code scales the
    hidden matrices' decay so), and for the head and routers, whose muP multiplier 1 / m is
    folded into the weight, it is what the multiplier written out would decay. Adam's eps is
    eps / m wherever muP's gradients shrink as 1 / width (the blocks' matrices, the embedding,
    the norms: the backward pass through a readout of 1 / m), so that it stays as small beside
    them as at the base width (CompleteP's reference code; Everett et al. 2024, "Scaling
    exponents across parameterizations and optimizers", on eps at width), and eps for the
    folded head and routers, whose gradients do not shrink (m times the written-out weight's,
    whose eps is eps / m). depth_mult and depth_alpha: depth-wise muP's
    (model.mup_base_layers, see depth_factors). Each group's share of the learning rate, of the
    weight decay and of Adam's eps is the optimizer's `lr_scales`, `decay_scales` and `eps_scales`
    (see set_lr and set_hyperparameters). exclude: parameters stepped otherwise (a pipeline's copy
    of the embedding). embedding_decay False: the token embedding in a group of its own, not
    decayed (train.embedding_decay)."""
    skipped = {id(p) for p in exclude}
    named = [(name.replace("_orig_mod.", ""), p) for name, p in model.named_parameters()
             if p.requires_grad and id(p) not in skipped]
    muon = [(name, p) for name, p in named if kind == "muon" and p.ndim >= 2 and name.split(".")[0] not in ADAMW_ONLY]
    chosen = {id(p) for _, p in muon}
    params = [(name, p) for name, p in named if id(p) not in chosen]
    # (Yang et al. 2022, table 3: under Adam a matrix whose fan-in grows m times steps 1 / m as
    # far; the embedding's fan-in, the vocabulary, does not grow.)
    matrices = [(name.split(".")[0] == "tok_embeddings" or width_mult == 1, name, p) for name, p in params if p.ndim >= 2]

    def folded(name: str) -> bool:  # (the head and the routers: muP's 1 / m in the weight)
        return folded_multiplier(name, width_mult) != 1
    def undecayed(name: str) -> bool:  # (train.embedding_decay = false: the embedding's own group)
        return not embedding_decay and name.split(".")[0] == "tok_embeddings"
    # (extra keys of the group, its members, its (lr, weight decay, eps) factors for the width)
    kinds = [({}, [(name, p) for unscaled, name, p in matrices if not unscaled and not folded(name)],
              (1 / width_mult, width_mult, 1 / width_mult)),
             ({}, [(name, p) for unscaled, name, p in matrices if not unscaled and folded(name)],
              (1 / width_mult, width_mult, 1.0)),
             ({}, [(name, p) for unscaled, name, p in matrices if unscaled and not undecayed(name)],
              (1.0, 1.0, 1 / width_mult)),
             ({}, [(name, p) for name, p in params if p.ndim < 2], (1.0, 1.0, 1 / width_mult)),
             ({}, [(name, p) for unscaled, name, p in matrices if undecayed(name)], (1.0, 0.0, 1 / width_mult))]
    if kind == "muon":
        # Muon's update is orthogonal, its spectral norm 0.2 lr sqrt(max(rows, columns)): muP's
        # spectral condition (Yang, Simon and Bernstein 2023: sqrt(fan-out / fan-in)) asks
        # lr / sqrt(m) of the hidden matrices and lr / m of the routers, whose fan-out stays.
        kinds += [({"muon": True}, [(name, p) for name, p in muon if not folded(name)],
                   (1 / math.sqrt(width_mult), math.sqrt(width_mult), 1 / width_mult)),  # (eps: unused)
                  ({"muon": True}, [(name, p) for name, p in muon if folded(name)], (1 / width_mult, width_mult, 1.0))]
    groups = []  # (group, (lr, decay, eps) scales)
    for extra, members, (lr_scale, decay_scale, eps_scale) in kinds:
        # Under depth-wise muP each kind splits by where in the model its members sit.
        roles = [None] if depth_mult == 1 else [None, "inner", "residual"]
        for role in roles:
            share = [p for name, p in members if depth_mult == 1 or depth_role(name) == role]
            factors = depth_factors(role, depth_mult, depth_alpha)
            if share:
                groups.append(({"params": share, **extra},
                               (lr_scale * factors[0], decay_scale * factors[1], eps_scale * factors[2])))
    # The fused kernel is one launch per step instead of one per tensor group.
    fused = device.type in ("cuda", "cpu")
    optimizer = (Muon if kind == "muon" else torch.optim.AdamW)([group for group, _ in groups], lr=lr, fused=fused)
    # Not keys of the groups, which checkpoints save and loading expects: the config's to give.
    optimizer.lr_scales = [scales[0] for _, scales in groups]
    optimizer.decay_scales = [scales[1] for _, scales in groups]
    optimizer.eps_scales = [scales[2] for _, scales in groups]
    set_hyperparameters(optimizer, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum)
    set_lr(optimizer, lr)
    return optimizer


# The parameters through which a block writes into the residual stream (attention's output
# projection, the MLP's, each expert's and the shared experts').
_RESIDUAL = re.compile(r"\.(attention\.wo|feed_forward\.(experts\.|shared\.)?w2)(\.weight)?$")


def depth_role(name: str) -> str | None:
    """Where a parameter sits for depth-wise muP: "residual" (a trunk block's output projections,
    which carry its residual multiplier), "inner" (the trunk blocks' other matrices and norms), or
    None (the embedding, the final norm, the head, the multi-token-prediction modules)."""
    if not name.startswith("layers."):
        return None
    return "residual" if _RESIDUAL.search(name) else "inner"


def depth_factors(role: str | None, depth_mult: float, alpha: float) -> tuple[float, float, float]:
    """(learning rate, weight decay, Adam's eps) factors of depth-wise muP for a parameter of
    `role` (depth_role). CompleteP's table 1 (Dey et al. 2025) for a block's output multiplied by
    d^-alpha: its matrices and norms learn at lr d^(alpha - 1), Adam's eps d^-alpha. Here the
    multiplier s = d^-alpha is folded into the output projections W' = s W, which then take
    lr s d^(alpha - 1) = lr / d, decay / s (AdamW decays by lr x decay) and eps / s (W' has
    gradients 1 / s as large; Adam's steps do not depend on the gradient's scale otherwise):
    the same training, step for step, as the multiplier would give."""
    if role is None or depth_mult == 1:
        return 1.0, 1.0, 1.0
    if role == "inner":
        return depth_mult ** (alpha - 1), 1.0, depth_mult ** -alpha
    return 1 / depth_mult, depth_mult ** alpha, 1.0


def folded_multiplier(name: str, width_mult: float = 1.0, depth_mult: float = 1.0, depth_alpha: float = 1.0) -> float:
    """The constant multiplier folded into parameter `name` (s, where the weight held is s times the
    weight with the multiplier written out): muP's output multiplier 1 / m in the output head and
    the routers (model.mup_base_dim), depth-wise muP's residual multiplier d^-alpha in the blocks'
    output projections (model.mup_base_layers, see depth_factors); 1 elsewhere. The gradient of
    the written-out weight is s times that of the folded one, which is what gradient clipping
    and the logged gradient norms count (Trainer._written_out_squares)."""
    name = name.replace("_orig_mod.", "")
    if width_mult != 1 and (name == "output.weight" or name.endswith("router.weight")):
        return 1 / width_mult
    if depth_mult != 1 and depth_role(name) == "residual":
        return depth_mult ** -depth_alpha
    return 1.0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of this step, times each group's share of it (muP's, or 1)."""
    for group, scale in zip(optimizer.param_groups, getattr(optimizer, "lr_scales", None)
                            or [1.0] * len(optimizer.param_groups), strict=True):
        group["lr"] = lr * scale


def set_hyperparameters(optimizer: torch.optim.Optimizer, *, weight_decay: float, betas: tuple[float, float],
                        eps: float, momentum: float = 0.95) -> None:
    """Give every group the config's values again (decay on its matrices' groups only, each times
    its group's share under depth-wise muP): loading a checkpoint restores the values it was saved
    with, and a resumed run follows its config."""
    ones = [1.0] * len(optimizer.param_groups)
    for group, decay, eps_scale in zip(optimizer.param_groups, getattr(optimizer, "decay_scales", ones),
                                       getattr(optimizer, "eps_scales", ones), strict=True):
        matrices = all(p.ndim >= 2 for p in group["params"])
        group.update(weight_decay=weight_decay * decay if matrices else 0.0, betas=betas, eps=eps * eps_scale)
        if group.get("muon"):
            group["momentum"] = momentum


def orthogonalise_dtype(device_type: str) -> torch.dtype:
    """The dtype orthogonalise computes in on devices of `device_type`: train.dtype = auto's."""
    return training_dtype("auto", torch.device(device_type))


def orthogonalise(update: torch.Tensor) -> torch.Tensor:
    """The Newton–Schulz quintic of Jordan et al. 2024 on the last two dimensions (a stack of
    matrices is a batch), in bfloat16 on a GPU as they run it (float16 on one without: its
    matrices are normalised, within float16's range), in float32 elsewhere."""
    dtype = orthogonalise_dtype(update.device.type)
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
    the dimensions before the last two: the experts of a stack). (Strided shards, FSDP's under
    tensor parallelism, are not `is_shard()` in torch 2.13: their dimension is read instead.)"""
    return not isinstance(p, DTensor) or all(pl.is_replicate() or getattr(pl, "dim", p.ndim) < p.ndim - 2
                                             for pl in p.placements)


def _row_shard_dim(p: torch.Tensor) -> int | None:
    """The mesh dimension over which FSDP splits the rows of the matrix `p`, when that is its only
    split (replicas aside); None otherwise."""
    if not isinstance(p, DTensor) or p.ndim != 2:
        return None
    split = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if len(split) == 1 and type(p.placements[split[0]]) is Shard and p.placements[split[0]].dim == 0:
        return split[0]
    return None


def _rows(total: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of `total` that rank `rank` of `ranks` holds under Shard(0) (torch.chunk's split)."""
    size = -(-total // ranks)
    start = min(rank * size, total)
    return start, min(start + size, total)


def _orthogonalise_shared_out(params: list[DTensor], local_update, group):
    """Yields (j, this rank's rows of the orthogonalised update of matrix j of `params`) for
    every j, a bucket at a time (params split by rows over `group`; local_update(j): this rank's
    rows of matrix j's update, made when its bucket comes), the work shared out among the
    group's ranks (see the module's docstring)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    dtype = orthogonalise_dtype(params[0].device_mesh.device_type)
    order = sorted(range(len(params)), key=lambda j: -params[j].numel())
    for first in range(0, len(order), n):
        bucket = order[first:first + n]  # bucket[r] is rank r's to orthogonalise
        shape = [params[j].shape for j in bucket]
        mine = [local_update(j).to(dtype).reshape(-1) for j in bucket]
        sent = [part.numel() for part in mine] + [0] * (n - len(bucket))
        came = [0] * n
        if me < len(bucket):
            rows, cols = shape[me]
            came = [(_rows(rows, n, r)[1] - _rows(rows, n, r)[0]) * cols for r in range(n)]
        whole = torch.empty(sum(came), dtype=dtype, device=mine[0].device)
        dist.all_to_all_single(whole, torch.cat(mine), came, sent, group=group)
        del mine
        result = orthogonalise(whole.view(shape[me])).reshape(-1) if me < len(bucket) else whole
        back = torch.empty(sum(sent), dtype=dtype, device=whole.device)
        dist.all_to_all_single(back, result, sent, came, group=group)
        del whole, result
        for j, part in zip(bucket, back.split(sent[:len(bucket)])):
            yield j, part.view(local_shard(params[j]).shape).to(params[j].dtype)


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
        keep = None if skip is None else skip > 0
        params = [p for p in group["params"] if p.grad is not None]
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:  # (and a count of steps, as AdamW's state has)
                state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] = torch.zeros((), device=local_shard(p).device)
            buffer, grad = local_shard(state["momentum_buffer"]), local_shard(p.grad)
            momentum = buffer * mu + grad
            buffer.copy_(momentum if keep is None else torch.where(keep, buffer, momentum))
            buffers.append(state["momentum_buffer"])
            state["step"] += 1 if skip is None else (skip <= 0).float()
            del momentum

        def nesterov(i: int) -> torch.Tensor:
            # This rank's part of the gradient plus mu times the new momentum (when the step is
            # skipped the update this makes is discarded below, whatever it is).
            return local_shard(params[i].grad) + local_shard(buffers[i]) * mu

        for i, update in _orthogonalised(params, nesterov):
            param = local_shard(params[i])
            stepped = param * (1 - lr * decay)
            stepped.add_(update, alpha=-lr * 0.2 * math.sqrt(max(params[i].shape[-2:])))
            del update
            param.copy_(stepped if keep is None else torch.where(keep, param, stepped))


def _orthogonalised(params: list[torch.Tensor], nesterov):
    """Yields (i, parameter i's update orthogonalised, as this rank's part: a plain tensor shaped
    like its shard), for every i; nesterov(i) is this rank's part of the update before it. Each
    update is made when it is needed and handed on when it is ready, so that few are held at once."""
    shared: dict = {}  # (mesh, dimension) -> indices of matrices split by rows over it
    for i, p in enumerate(params):
        if _whole_where_it_lies(p):
            yield i, orthogonalise(nesterov(i))
        elif (dim := _row_shard_dim(p)) is not None:
            shared.setdefault((p.device_mesh, dim), []).append(i)
        else:
            # (Made on the local shards and gathered: the same values, without DTensor's dispatch.)
            update = DTensor.from_local(nesterov(i), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
            whole = orthogonalise(update.full_tensor())
            yield i, local_shard(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None))
            del whole
    for (mesh, dim), indices in shared.items():
        for j, part in _orthogonalise_shared_out([params[i] for i in indices],
                                                 lambda j: nesterov(indices[j]), mesh.get_group(dim)):
            yield indices[j], part
