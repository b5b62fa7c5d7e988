"""The next-token loss, whole or in chunks.

`cross_entropy` takes logits (batch, seq, vocab) that the output head produced: simple, but the
logits of a micro-batch are held twice over (in the compute dtype, and in float32 for the
log-softmax), plus their gradient — at 8 × 2048 tokens and a 32,768-token vocabulary that is
2 GiB each in float32.

`chunked_cross_entropy` takes the final hidden states and the head's weight instead and runs
head and loss `chunk` tokens at a time. Each chunk's gradients (with respect to the hidden
states and to the weight) are computed in the forward pass, while its logits are at hand, so
no logits survive a chunk and the backward pass only scales what was stored — the approach of
Liger Kernel's fused linear cross-entropy (Hsu et al. 2024), here in plain PyTorch.
The loss is the same to float32 rounding: log-sum-exp and the softmax gradient are computed
in float32 from logits in the compute dtype, as `cross_entropy` does.

Both take `z_loss`, the weight of PaLM's auxiliary loss z · log²Z per token, Z the softmax's
normaliser (Chowdhery et al. 2022, section 5: it "encourages the softmax normalizer log(Z) to
be close to 0", which they found to increase the stability of training). It enters the
gradient only: the value returned stays the cross-entropy, so that logged losses, evaluations
and scaling-law fits mean the same with it or without. Its gradient, 2·z·log Z·softmax per
token, is the softmax's own scaled by 1 + 2·z·log Z in the chunked loss. Under tensor
parallelism (the vocabulary split, logits a DTensor) log Z comes from each rank's columns and
two all-reduces of a number per row, and autograd takes the gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

IGNORE = -100  # targets that mark padding: no loss, no gradient


def training_dtype(choice: str, device: torch.device) -> torch.dtype:
    """What train.dtype = `choice` computes in on `device`: auto is bfloat16 on a GPU that has it,
    float16 on one without, float32 elsewhere."""
    if choice == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return getattr(torch, choice)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `t` run in: autocast's where it is on, else t's own."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


class Tally:
    """A sum of per-token values and their count since the last reset, kept on the device
    (nothing waits for them until read): what enters the gradient but not the loss returned, for
    the train records — the z-loss's log²Z per real token, multi-token prediction's losses."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, values: torch.Tensor, counted: torch.Tensor) -> None:
        """Add values (detached, in float32) where `counted` (0 or 1, or a weight) says."""
        total, count = (values.detach().float() * counted).sum(), counted.sum()
        self.total = total if self.total is None else self.total + total
        self.count = count if self.count is None else self.count + count


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0,
                  tally: Tally | None = None) -> torch.Tensor:
    """Mean next-token loss of logits (batch, seq, vocab) against targets (batch, seq), in
    float32 (a bf16 log-softmax over a large vocabulary loses precision); -100 marks padding.
    With `z_loss`, the gradient of the z-loss too (see the module's docstring), its log²Z added
    to `tally`."""
    flat, targets = logits.float().flatten(0, 1), targets.flatten()
    if z_loss and torch.is_grad_enabled() and flat.requires_grad:
        if isinstance(flat, DTensor):
            return _with_split_z_loss(F.cross_entropy(flat, targets), flat, targets, z_loss, tally)
        return _ZLossCrossEntropy.apply(flat, targets, z_loss, tally)
    return F.cross_entropy(flat, targets)


def _with_split_z_loss(loss: torch.Tensor, logits: DTensor, targets: torch.Tensor, z_loss: float,
                       tally: Tally | None = None) -> torch.Tensor:
    """`loss` plus z·(mean log²Z − the same, detached) for logits whose vocabulary is split over
    tensor-parallel ranks (a DTensor, under loss_parallel): the z-loss's gradient, and nothing
    added to the value. log Z is taken from each rank's own columns — the rows' maximum and sum
    of exponentials all-reduced over the ranks — not by DTensor's log-sum-exp, which gathers the
    whole vocabulary's float32 logits onto every rank. Its backward keeps the exponentials of the
    rank's columns, a float32 copy of its logits, as the loss's peak holds anyway
    (plan/memory.py)."""
    log_norm = _split_log_norm(logits.to_local(), logits.device_mesh.get_group())
    valid = targets != IGNORE
    if tally is not None:
        tally.add(log_norm.detach().float().square(), valid)
    square = (log_norm.square() * valid).sum() / valid.sum().clamp(min=1)
    return add_replicated(loss, z_loss * (square - square.detach()))


def add_replicated(loss: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """loss + term, where loss may be a replicated DTensor (under loss_parallel) and term is a
    plain tensor that every rank holds the same (DTensor adds no plain tensor to itself)."""
    if isinstance(loss, DTensor):
        term = DTensor.from_local(term, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return loss + term


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (a loss under loss_parallel) as this rank's plain tensor, which
    holds all of it (differentiable); a plain tensor as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def _split_log_norm(local: torch.Tensor, group) -> torch.Tensor:
    """log Z of each row of logits whose vocabulary is split over the ranks of `group`, from this
    rank's columns `local`: the rows' maximum and sum of exponentials all-reduced (the same on
    every rank; differentiable with respect to `local`)."""
    with torch.no_grad():
        top = local.amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return top + _SummedOnEveryRank.apply(torch.exp(local - top[:, None]).sum(dim=-1), group).log()


@torch.no_grad()
def target_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) in float32 at every position of `targets` (batch, seq) that is not IGNORE,
    in order, from logits (batch, seq, vocab). Logits whose vocabulary is split over
    tensor-parallel ranks (a DTensor sharded on it) are not gathered: from each rank's columns,
    the rows' maximum, sum of exponentials and the target's logit (where the rank holds it) are
    all-reduced, three numbers a row, where the whole vocabulary's logits would be a micro-batch
    times the vocabulary on every rank."""
    scored = targets != IGNORE
    wanted = targets[scored]
    if not isinstance(logits, DTensor):
        return torch.log_softmax(logits[scored].float(), dim=-1).gather(-1, wanted[:, None])[:, 0]
    mesh = logits.device_mesh
    if mesh.ndim != 1 or not logits.placements[0].is_shard(logits.ndim - 1):
        return target_log_probs(logits.full_tensor(), targets)
    local, group = logits.to_local()[scored].float(), mesh.get_group()
    width = local.shape[-1]  # (the vocabulary splits evenly: parallel/layout.py checks it)
    first = mesh.get_local_rank() * width
    here = (wanted >= first) & (wanted < first + width)
    picked = local.gather(-1, (wanted - first).clamp(0, width - 1)[:, None])[:, 0] * here
    dist.all_reduce(picked, group=group)
    return picked - _split_log_norm(local, group)


class _SummedOnEveryRank(torch.autograd.Function):
    """All-reduce (sum) forward; the gradient passes as it is: every rank computes the same
    function of the sum, so each already holds the whole gradient with respect to its own part."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ZLossCrossEntropy(torch.autograd.Function):
    """F.cross_entropy's value, and its gradient plus the z-loss's, keeping what it keeps for
    the backward pass (the log-softmax) and one log Z per row."""

    @staticmethod
    def forward(ctx, logits, targets, z_loss, tally):
        log_probs = F.log_softmax(logits, dim=-1)
        valid = targets != IGNORE
        safe = torch.where(valid, targets, 0)[:, None]
        count = valid.sum().clamp(min=1)
        log_norm = logits[:, 0] - log_probs[:, 0]
        if tally is not None:
            tally.add(log_norm.detach().float().square(), valid)
        ctx.save_for_backward(log_probs, safe, valid, log_norm, count)
        ctx.z_loss = z_loss
        return -(log_probs.gather(1, safe)[:, 0] * valid).sum() / count

    @staticmethod
    def backward(ctx, grad_output):
        log_probs, safe, valid, log_norm, count = ctx.saved_tensors
        grad = log_probs.exp().mul_((1 + 2 * ctx.z_loss * log_norm)[:, None])
        grad.scatter_add_(1, safe, -torch.ones_like(safe, dtype=grad.dtype))
        grad.mul_((valid * (grad_output / count))[:, None])
        return grad, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int, z_loss: float = 0.0, tally: Tally | None = None) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, targets) for hidden (batch, seq, dim), weight
    (vocab, dim), without holding more than `chunk` tokens' logits at once. Under autocast the
    product is taken in the autocast dtype, as nn.Linear would."""
    device, dtype = hidden.device.type, compute_dtype(hidden)
    flat_hidden, flat_targets = hidden.flatten(0, 1), targets.flatten()
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        with torch.no_grad():
            total, _, _ = _chunks(flat_hidden.to(dtype), weight.to(dtype), flat_targets, chunk, gradients=False)
        return total / (flat_targets != IGNORE).sum().clamp(min=1)
    with torch.autocast(device, enabled=False), torch.no_grad():
        count = (flat_targets != IGNORE).sum().clamp(min=1)
        total, grad_hidden, grad_weight = _chunks(flat_hidden.to(dtype), weight.to(dtype), flat_targets, chunk,
                                                  gradients=True, z_loss=z_loss, tally=tally)
    # Two nodes of the graph, one for the hidden states and one (worth 0) for the weight, joined by
    # an addition: a zero-bubble schedule's weights' pass starts from the node where a weight's
    # path meets the inputs', and torch 2.11 cannot start from a custom function (it reads its
    # _input_metadata); from an addition it can.
    return (_Precomputed.apply(flat_hidden, total / count, grad_hidden, count)
            + _Precomputed.apply(weight, torch.zeros_like(total), grad_weight, count))


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
            gradients: bool, z_loss: float = 0.0,
            tally: Tally | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed loss over the rows and, if asked, the gradients of that sum (and of z_loss times
    the rows' summed log²Z, which go to `tally`) with respect to hidden (in hidden's dtype) and
    weight (float32)."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if gradients else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if gradients else None
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start:start + chunk], targets[start:start + chunk]
        logits = (h @ weight.T).float()  # (chunk, vocab)
        valid = t != IGNORE
        safe = torch.where(valid, t, 0)[:, None]
        log_norm = torch.logsumexp(logits, dim=-1)
        total += ((log_norm - logits.gather(1, safe)[:, 0]) * valid).sum()
        if gradients:
            # d(loss)/d(logits) = softmax - one_hot(target), zero on padding.
            grad = logits.sub_(log_norm[:, None]).exp_()
            if z_loss:
                grad.mul_((1 + 2 * z_loss * log_norm)[:, None])
                if tally is not None:
                    tally.add(log_norm.detach().float().square(), valid)
            grad.scatter_add_(1, safe, -torch.ones_like(safe, dtype=grad.dtype))
            grad.mul_(valid[:, None])
            grad = grad.to(h.dtype)
            grad_hidden[start:start + chunk] = grad @ weight
            if h.dtype == torch.float32:
                grad_weight.addmm_(grad.T, h)
            else:  # in the compute dtype, as autocast's unchunked head does (a float32 matmul would run
                grad_weight += grad.T @ h  # at a fraction of the tensor cores' rate), summed in float32
    return total, grad_hidden, grad_weight


class _Precomputed(torch.autograd.Function):
    """`value`, whose gradient with respect to x is `gradient` / count, both computed already (by
    the chunked loss's forward pass)."""

    @staticmethod
    def forward(ctx, x, value, gradient, count):
        # (Kept on ctx, not saved: scaled in place, once — for the head's weight that is vocab x
        # dim in float32, which a second copy would double.)
        ctx.gradient, ctx.count, ctx.scaled, ctx.dtype = gradient, count, False, x.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        if not ctx.scaled:
            ctx.gradient.mul_(grad_output / ctx.count)
            ctx.scaled = True
        return ctx.gradient.to(ctx.dtype), None, None, None
