"""A mixture-of-experts MLP: routed SwiGLU experts (Shazeer et al. 2017, "Outrageously Large
Neural Networks"; top-k routing as in GShard, Lepikhin et al. 2021, and Mixtral, Jiang et al.
2024), optional shared experts every token goes through (DeepSeekMoE, Dai et al. 2024), and a
load-balancing loss (Switch Transformer, Fedus et al. 2022, eq. 4).

Each token goes to the moe_top_k experts of highest router probability (computed in float32),
their outputs weighted by those probabilities renormalised over the k (Mixtral), or by the
probability itself when k = 1 (Switch), so that the router learns from the loss either way.
With model.moe_score = "sigmoid" the probability is each expert's own sigmoid of its logit
instead of a softmax over all (DeepSeek-V3, Liu et al. 2024, eq. 15), chosen and weighted alike.
No token is dropped (no capacity limit): each expert computes on exactly the tokens sent to it,
the rows gathered by expert, so the FLOPs are those of model/flops.py's active parameters
exactly. All experts' matmuls run as one grouped GEMM (`torch._grouped_mm`, the kernel
torch's MoE training uses) where it is known to work — on CPUs, and in bf16 on Hopper GPUs
(widths multiples of 8) — and as one matmul per expert elsewhere (bit-identical on CPUs, where
both are tested; on GPUs they are different kernels). The outputs are put back in token
order by a permutation, not a scatter-add, so the result does not depend on the order of
floating-point additions (runs resume bit-exactly on GPUs too).

With model.moe_groups = G and model.moe_group_limit = M < G, each token chooses its experts
from its M best groups of consecutive experts only (DeepSeek-V3's node-limited routing: with a
group per node, a token's all-to-all reaches at most M nodes); the weights are unchanged.

With model.moe_bias_update = γ > 0, routing is also balanced without a loss (DeepSeek-V3,
Liu et al. 2024, section 2.1.2): each expert has a bias, added to its probability only to choose
the top k, and after each optimizer step moved by γ up for each expert that received fewer
assignments than the mean over the whole global batch (every micro-batch of every rank) and
down for each that received more (`update_expert_bias`). The bias is a buffer of the model,
checkpointed with it.

The load-balancing loss of each forward, E · Σ_i f_i P_i (f_i: the share of the token-expert
assignments that went to expert i, P_i: the mean router probability of expert i, sigmoid scores
first normalised to sum to one per token; 1 when balanced), enters the objective — not the loss
the trainer reports, which stays the cross-entropy the scaling laws fit — from inside the block:
a training forward passes its output through an identity whose backward also sends the
balancing loss the gradient `balance_weight` (set by the trainer: model.moe_aux_loss, over the
micro-batches of a step unless the pipeline schedule scales gradients itself), and tallies its
value (`balance_tally`). So a pipeline stage trains its blocks' routers without the loss, which
only the last stage has (as Megatron-LM's MoE layers do). Under context parallelism (`cp_group`)
f_i counts the assignments of the whole sequences, gathered over the cp ranks, so that the mean of
the ranks' losses is the loss of the whole micro-batch.

Under tensor parallelism (`tp_group`) a block takes the rank's part of the sequences (sequence
parallelism's split of the residual stream) and routes it with the whole router (and shared
experts), as data parallelism would: the tp ranks sum those weights' gradients (an all-reduce
in the backward pass), f_i counts over them too, and the balancing loss's weight is divided by
tp (each rank's loss is over its part of the tokens, and the parts' gradients are summed). The
routed experts are split over the tp ranks instead, by expert, as expert parallelism splits
them (and together with it, over ep x tp ranks): each rank holds 1/tp of them and the tokens
travel to their experts by all-to-all, where whole experts on every tp rank would hold tp
copies of what is most of a mixture's weights (torchtitan's experts likewise take the tp
ranks into expert parallelism).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.loss import compute_dtype


class Experts(nn.Module):
    """`count` SwiGLU experts as three stacked weights, (count, hidden, dim) for w1 and w3 and
    (count, dim, hidden) for w2 — each expert's slice laid out as an nn.Linear's weight."""

    def __init__(self, count: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(count, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(count, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(count, hidden_dim, dim))
        # Under expert parallelism and tensor parallelism (parallel/expert.py) the weights are
        # DTensors split by expert over this group (the ep ranks, each with its tp ranks), and
        # tokens travel to their experts' rank and back; `ep` of its ranks train on other data.
        self.ep_group = None
        self.ep = 1

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (assignments, dim) sorted by expert, counts[e] of them for expert e (a tensor of
        every expert's count, this rank's assignments)."""
        weights = [w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3)]
        if self.ep_group is None:
            return _run(x, counts, *weights)
        return _expert_parallel(x, counts, weights, self.ep_group, self.ep)


def _run(x: torch.Tensor, counts: list[int] | torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
         w3: torch.Tensor) -> torch.Tensor:
    """Each expert on its rows of x (counts[e] rows for expert e, in order). Experts without rows
    run too, on none: every weight then has a gradient (zeros), as data parallelism's
    reductions expect on every rank."""
    dtype = compute_dtype(x)
    if _grouped(x, w1, dtype):
        offsets = torch.as_tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        rows, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))  # as autocast would cast them

        def matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return ContiguousGradient.apply(torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets))
        return matmul(F.silu(matmul(rows, w1)) * matmul(rows, w3), w2)
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    return torch.cat([F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
                      for e, rows in enumerate(x.split(counts))])


def _grouped(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs these experts: on CPUs (float32 and bf16, checked
    against the per-expert matmuls in tests), and in bf16 on CUDA devices of compute
    capability 9 (Hopper); on either only where the widths (the model's and the experts') are
    whole multiples of 16 bytes, the strides it takes ("strides should be multiple of 16 bytes")."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:  # no rows: the loop (a grouped backward refuses
        return False                                            # the empty, expanded gradients they get)
    if any(width * dtype.itemsize % 16 for width in w.shape[-2:]):
        return False
    if x.device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return (x.device.type == "cuda" and torch.version.hip is None  # ROCm reports capability 9 too (MI200/MI300)
            and dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] == 9)


class ContiguousGradient(torch.autograd.Function):
    """The identity; the gradient it passes back is made contiguous. The grouped GEMM's backward
    refuses the expanded gradients that, e.g., a sum's backward produces; a pipeline stage's links
    refuse the transposed ones of parallel/tensor.py's sequence-first projection."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _expert_parallel(x: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor], group,
                     ep: int) -> torch.Tensor:
    """Send each assignment to the rank of its expert (rank r of the group's n holds experts
    r·E/n ..), run the local experts on what arrives from every rank, send the results back
    (all-to-all, GShard's dispatch and combine, Lepikhin et al. 2021); rows return in x's order.
    `ep` of the group's ranks train on different data (the others, tensor-parallel ranks, on
    other parts of the same sequences)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ranks, local = dist.get_world_size(group), weights[0].shape[0]
    # An expert's gradient sums the tokens of all the group's ranks (the all-to-all's backward
    # brings them): over tensor-parallel ranks, the parts of the same sequences, as a sum should;
    # over the ep ranks, other data, which data parallelism averages over the ranks holding that
    # expert, ep times fewer than the data-parallel ranks whose mean loss it is the gradient
    # of: scale by 1 / ep. (FSDP's set_gradient_divide_factor would, but through a reduction
    # gloo does not have.)
    if ep > 1:
        weights = [_ScaleGradient.apply(w, 1 / ep) for w in weights]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] counts
    sent, came = torch.stack([counts, received]).tolist()  # one host sync for every split
    sent_splits = [sum(sent[r * local:(r + 1) * local]) for r in range(ranks)]
    arrived_splits = [sum(came[s * local:(s + 1) * local]) for s in range(ranks)]
    arrived = all_to_all_single_autograd(x, arrived_splits, sent_splits, group)  # by source, then expert
    # Regroup by local expert (then source), run, and put back in arrival order.
    expert_of_row = torch.arange(local, device=x.device).repeat(ranks).repeat_interleave(received)
    index = expert_of_row.argsort(stable=True)
    per_expert = [sum(came[s * local + e] for s in range(ranks)) for e in range(local)]
    out = _run(arrived[index], per_expert, *weights)
    back = torch.empty_like(out)
    back[index] = out
    return all_to_all_single_autograd(back, sent_splits, arrived_splits, group)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer  # the block's index in the whole model
        self.top_k, self.score = cfg.moe_top_k, cfg.moe_score
        self.groups, self.group_limit = cfg.moe_groups, cfg.group_limit
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = Experts(cfg.moe_experts, cfg.dim, cfg.expert_dim)
        self.shared = None
        if cfg.moe_shared_experts:
            from scaletrain.model.llama import FeedForward

            self.shared = FeedForward(cfg.dim, cfg.moe_shared_experts * cfg.expert_dim)
        self.aux_loss: torch.Tensor | None = None  # the last forward's balancing loss (detached in training)
        self.balance_weight = 0.0  # its gradient in the objective, per training forward
        self.balance_sum, self.balance_count = None, 0  # the values backward passes saw since the last tally
        self.cp_group = None  # context parallelism: the ranks holding the other parts of the sequences
        # Tensor parallelism (parallel/tensor.py): the ranks holding the other parts of the
        # sequences, each routing its own tokens with the whole router and shared experts, whose
        # gradients they sum (the routed experts are split over them: parallel/expert.py).
        self.tp_group = None
        if cfg.moe_bias_update:
            self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))
            # Assignments per expert since the last update (training forwards only; a recomputed
            # forward counts again, which scales every expert's count alike and moves no sign).
            self.register_buffer("load", torch.zeros(cfg.moe_experts), persistent=False)
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # a pipeline stage's shape inference (torch before 2.13: on the meta device,
            return torch.empty_like(x)  # where routing, data-dependent, cannot run): the output is shaped as x
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        with torch.autocast(x.device.type, enabled=False):  # routing decided in float32
            router, = summed_over([self.router.weight], self.tp_group)
            logits = F.linear(flat.float(), router.float())  # (tokens, experts)
        experts = self.router.out_features
        probs = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        scores = probs if self.expert_bias is None else probs + self.expert_bias  # the bias only chooses
        if self.group_limit < self.groups:
            scores = group_limited(scores.detach(), self.groups, self.group_limit, self.top_k)
        chosen = scores.topk(self.top_k, dim=-1).indices  # (tokens, k)
        weights = probs.gather(-1, chosen)  # one expert: its probability, as Switch (so the router
        if self.top_k > 1:  # learns from the loss); several: renormalised over them, as Mixtral
            weights = weights / weights.sum(dim=-1, keepdim=True)
        assignments = chosen.flatten()  # token t's j-th expert at t * k + j
        order = assignments.argsort(stable=True)  # assignments grouped by expert, tokens in order
        counts = torch.bincount(assignments, minlength=experts)
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            self.load += counts
        routed = self.experts(flat[order // self.top_k], counts)
        unsorted = torch.empty_like(routed)
        unsorted[order] = routed
        out = (unsorted.view(-1, self.top_k, dim).float() * weights[..., None]).sum(dim=1).to(flat.dtype)
        if self.shared is not None and self.tp_group is None:
            out = out + self.shared(flat)  # (a module call: float8 training converts its linears)
        elif self.shared is not None:  # its forward, on weights whose gradients sum over tp (in bf16 under float8)
            w1, w2, w3 = summed_over([self.shared.w1.weight, self.shared.w2.weight, self.shared.w3.weight],
                                     self.tp_group)
            out = out + F.linear(F.silu(F.linear(flat, w1)) * F.linear(flat, w3), w2)
        total = counts.float()  # (a copy: the routing keeps its own counts)
        for group in (self.cp_group, self.tp_group):  # f_i over the whole sequences
            if group is not None:
                dist.all_reduce(total, group=group)
        share = total / total.sum()
        # P_i over probabilities that sum to one per token (sigmoid scores normalised, as DeepSeek-V3's balance loss).
        shares = probs if self.score == "softmax" else probs / probs.sum(dim=-1, keepdim=True)
        balance = experts * (share * shares.mean(dim=0)).sum()
        if self.training and torch.is_grad_enabled():
            self.aux_loss = balance.detach()
            out = _BalanceGradient.apply(out, balance, self)
        else:  # outside training, with its graph if there is one (to add by hand)
            self.aux_loss = balance
        return out.view(batch, seq, dim)


def group_limited(scores: torch.Tensor, groups: int, limit: int, top_k: int) -> torch.Tensor:
    """The routing scores (tokens, experts) with every expert outside each token's `limit` best
    groups (of `groups` equal groups of consecutive experts) set to -inf: the best groups by the
    sum of their ceil(top_k / limit) highest scores (DeepSeek-V3's node-limited routing, Liu et
    al. 2024, section 2.1.2; DeepSeek-V2 ranked groups by their single best)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, groups, experts // groups)
    strength = grouped.topk(-(-top_k // limit), dim=-1).values.sum(dim=-1)  # (tokens, groups)
    allowed = torch.zeros(tokens, groups, dtype=torch.bool, device=scores.device)
    allowed.scatter_(1, strength.topk(limit, dim=-1).indices, True)
    return grouped.masked_fill(~allowed[..., None], -math.inf).view(tokens, experts)


class _BalanceGradient(torch.autograd.Function):
    """The identity on a block's output; its backward also gives the block's balancing loss the
    gradient moe.balance_weight (as if it had been added to the loss) and tallies its value.
    Each training forward's backward runs once, recomputed blocks' too."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, balance: torch.Tensor, moe: MoE) -> torch.Tensor:
        ctx.moe, ctx.weight, ctx.value = moe, moe.balance_weight, balance.detach()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        moe = ctx.moe
        moe.balance_sum = ctx.value if moe.balance_sum is None else moe.balance_sum + ctx.value
        moe.balance_count += 1
        return grad, (torch.full_like(ctx.value, ctx.weight) if ctx.weight else None), None


def summed_over(weights: list[torch.Tensor], group) -> list[torch.Tensor]:
    """The weights, their gradients summed over `group` (None: as they are): the ranks of a
    tensor-parallel group each train them on their own part of the sequences."""
    return weights if group is None else [_SumGradient.apply(w, group) for w in weights]


class _SumGradient(torch.autograd.Function):
    """The identity, with the gradient all-reduced (summed) over a process group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.to(torch.float32, copy=True)  # summed in float32, rounded once
        dist.all_reduce(total, group=ctx.group)
        return total.to(grad.dtype), None


class _ScaleGradient(torch.autograd.Function):
    """The identity, with the gradient multiplied by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def update_expert_bias(model: nn.Module, cfg: ModelConfig, skip: torch.Tensor | None = None) -> torch.Tensor:
    """After an optimizer step: move each mixture block's expert biases by cfg.moe_bias_update
    toward balance over the step's assignments on every rank, unless `skip` (a bool tensor: the
    step was not applied), and start counting again. The loads are summed by one all-reduce of a
    (layers, experts) table, each rank filling the rows of the blocks it holds: a pipeline stage
    holds some of them, or none (every rank takes part). Returns, per layer, the largest load
    of an expert over the mean (0 for layers without biases), on the device."""
    blocks = [m for m in model.modules() if isinstance(m, MoE) and m.expert_bias is not None]
    device = blocks[0].load.device if blocks else next(model.parameters()).device
    loads = torch.zeros(cfg.n_layers, cfg.moe_experts, device=device)
    for block in blocks:
        loads[block.layer] = block.load
    if dist.is_initialized():
        dist.all_reduce(loads)
    mean = loads.mean(dim=-1, keepdim=True)
    move = cfg.moe_bias_update * torch.sign(mean - loads)
    if skip is not None:
        move = torch.where(skip, torch.zeros_like(move), move)
    for block in blocks:
        block.expert_bias += move[block.layer]
        block.load.zero_()
    return (loads.amax(dim=-1) / mean.squeeze(-1).clamp(min=1)).detach()


def set_balance_weight(model: nn.Module, weight: float) -> None:
    """The gradient each training forward of `model`'s mixture blocks gives its balancing loss."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.balance_weight = weight


def balance_tally(model: nn.Module) -> tuple[torch.Tensor, int]:
    """(the sum of the balancing losses whose backward ran since the last tally, how many) over
    `model`'s mixture blocks, and start again; (0, 0) without any (a dense model, or a pipeline
    stage of a mixture's dense first blocks, whose rank still takes part in the mean over ranks)."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    values = [m.balance_sum for m in blocks if m.balance_sum is not None]
    total = torch.stack(values).sum() if values else torch.zeros(())
    count = sum(m.balance_count for m in blocks)
    for m in blocks:
        m.balance_sum, m.balance_count = None, 0
    return total, count


def forget_counts(model: nn.Module) -> None:
    """Drop the expert loads and balancing losses `model`'s mixture blocks have counted (of a
    pass that trained nothing)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.balance_sum, m.balance_count = None, 0
            if m.expert_bias is not None:
                m.load.zero_()
