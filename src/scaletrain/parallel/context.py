"""Context parallelism: each sequence split over the cp ranks, keys and values all-gathered for
attention — the scheme Llama 3 was trained with for long contexts (Llama Team 2024, "The Llama 3
Herd of Models", section 3.3.2).

Under a causal mask the later positions of a sequence attend to more keys, so cutting it into
cp consecutive pieces would leave the last rank with most of the work. The sequence is cut into
2 x cp chunks instead and rank r takes chunks r and 2 cp - 1 - r: every rank holds one early
and one late chunk and does the same work. Each rank computes queries, keys and values for its
own tokens (with their true rotary positions) and gathers every rank's keys and values, in
sequence order (the backward pass sums their gradients back). Each of its two query chunks then
attends to the keys up to its own end only, under a causal mask aligned to the bottom right
(query i of the chunk sees the keys up to the chunk's start + i): the early chunk reads few
keys, the late one most, and no rank computes scores the mask would discard beyond the
diagonal blocks. Gradients of the parameters are averaged over the cp ranks by FSDP, whose
shard group includes them.

This runs on any device and backend (PyTorch's built-in `context_parallel` has no CPU kernel).
The bottom-right mask is SDPA's CausalBias: on GPUs the flash kernel computes it without
materialising the mask (grouped-query heads included); elsewhere it is materialised for the
math kernel. Attention within documents (model.document_mask) takes each chunk's rows of the
bias each rank builds for its own queries over the whole sequence's keys (the trainer hands
every rank the document ids of whole sequences).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from scaletrain.model.llama import CoreAttention, attend
from scaletrain.model.moe import MoE


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Positions (seq_len / cp,) of the tokens rank cp_rank holds: chunks cp_rank and 2 cp - 1 - cp_rank."""
    chunk = seq_len // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's part of a (batch, seq, ...) tensor, in the order of local_positions."""
    chunks = tensor.chunk(2 * cp, dim=1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=1)


class _GatherSequence(torch.autograd.Function):
    """All-gather (batch, heads, seq / cp, head_dim) over the cp group into the whole sequence in
    position order (rank r holds chunks r and 2 cp - 1 - r); the backward pass sums the ranks'
    gradients of the whole, each rank receiving only its own two chunks' sums (a reduce-scatter
    of the chunks put in rank order: half an all-reduce's traffic)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        pieces = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        halves = [piece.chunk(2, dim=2) for piece in pieces]
        return torch.cat([halves[j][0] if j < cp else halves[2 * cp - 1 - j][1] for j in range(2 * cp)], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        chunks = grad.chunk(2 * cp, dim=2)
        pieces = [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=2) for r in range(cp)]  # (rank r's)
        mine = torch.empty_like(pieces[0])
        dist.reduce_scatter_tensor(mine, torch.cat(pieces), group=ctx.group)  # (rank r's: rows r B to (r + 1) B)
        return mine, None


class ContextParallelAttention(CoreAttention):
    """Attention of this rank's queries to the keys and values of the whole sequence."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int):
        super().__init__()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.chunk = seq_len // (2 * cp)
        self.chunks = (rank, 2 * cp - 1 - rank)  # which chunks of the sequence this rank's queries are

    def forward(self, q, k, v, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """mask: None (causal), or the document_bias of this rank's queries (in the order of
        local_positions) over the keys of the whole sequences."""
        if not causal and (mask is None or mask.dtype == torch.bool):  # what decoding with a KV cache passes
            raise NotImplementedError("context parallelism runs training and evaluation only (no KV cache)")
        if q.shape[2] != 2 * self.chunk:  # (its chunks' positions and masks are those of data.seq_len)
            raise ValueError(f"context parallelism was set up for {2 * self.chunk} tokens a rank (data.seq_len / cp); "
                             f"this input has {q.shape[2]}: pad inputs to data.seq_len")
        k = _GatherSequence.apply(k, self.group)  # (batch, kv_heads, seq, head_dim), in position order
        v = _GatherSequence.apply(v, self.group)
        out = []
        for local, (index, queries) in enumerate(zip(self.chunks, q.split(self.chunk, dim=2))):
            end = (index + 1) * self.chunk  # the keys up to this chunk's last position
            if mask is None:
                chunk_mask = causal_lower_right(self.chunk, end)
            else:  # this chunk's rows, up to its end (a view: every block shares the one bias)
                chunk_mask = mask[:, :, local * self.chunk:(local + 1) * self.chunk, :end]
            out.append(attend(queries, k[:, :, :end], v[:, :, :end], chunk_mask))
        return torch.cat(out, dim=2)


def apply_cp(model: nn.Module, group: dist.ProcessGroup, seq_len: int) -> None:
    """Make model (or a pipeline stage of it) attend across the cp ranks of `group`. Its inputs
    must be this rank's part of each sequence (shard_sequence); the rotary positions of those
    tokens are passed to every forward."""
    device = model.rope_cos.device
    positions = local_positions(seq_len, dist.get_rank(group), dist.get_world_size(group)).to(device)
    depths = [depth.block for depth in getattr(model, "mtp", None) or []]  # (multi-token prediction's)
    for block in [*model.layers.values(), *depths]:
        block.attention.core = ContextParallelAttention(group, seq_len)
        if isinstance(block.feed_forward, MoE):  # its balancing loss counts the whole sequences' assignments
            block.feed_forward.cp_group = group

    def add_positions(module, args, kwargs):
        return args, {**kwargs, "positions": positions}

    model.register_forward_pre_hook(add_positions, with_kwargs=True)
    if depths:  # its depths weigh each rank's share of the positions they predict
        model.cp_group = group
