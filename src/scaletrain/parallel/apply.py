"""`parallelize(model, mesh, ...)`: the one place a single-device model becomes distributed.

With pipeline parallelism the model is first cut into this rank's stages; then each piece
gets, in order (each step wraps what the previous one built): tensor parallelism (turns weights
into DTensors on the tp mesh), context parallelism (attention across the cp ranks), activation
recomputation around each block, per-block torch.compile, then FSDP over the data-parallel and
context-parallel ranks (which shards what the blocks have become).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.config import RunConfig
from scaletrain.model.moe import MoE
from scaletrain.parallel.context import apply_cp
from scaletrain.parallel.expert import apply_ep, expert_mesh
from scaletrain.parallel.fsdp import apply_fsdp
from scaletrain.parallel.layout import Layout, stage_ids
from scaletrain.parallel.pipeline import (EmbeddingCopies, build_schedule, forward_only, last_stage_embeds,
                                          split_stages)
from scaletrain.parallel.recompute import apply_recompute
from scaletrain.parallel.tensor import apply_tp


@dataclass
class ParallelModel:
    """What one rank holds of the model."""

    module: nn.Module
    """Every parameter this rank holds, under its name in the whole model: for the optimizer,
    checkpoints and gradient clipping. Without pipelining it is also what runs forward."""
    parts: list[nn.Module]
    """What runs forward: [module], or this rank's pipeline stages."""
    schedule: Any = None
    """The pipeline schedule, when pp > 1."""
    first: bool = True
    """This rank runs the first pipeline stage (it takes the inputs)."""
    last: bool = True
    """This rank runs the last pipeline stage (it takes the targets and computes the loss)."""
    forward: Callable[[torch.Tensor | None], torch.Tensor | None] | None = None
    """Under pipelining, a forward pass of a whole batch through every stage (for evaluation):
    takes the inputs where `first`, returns the logits where `last`."""
    make_schedule: Callable[[int], Any] | None = None
    """Under pipelining, a schedule of the same stages for another number of micro-batches."""
    schedules: dict[int, Any] = field(default_factory=dict)
    embedding_copies: EmbeddingCopies | None = None
    """Under pipelining, where the last stage holds a copy of the embedding (parallel/pipeline.py)."""

    def schedule_for(self, microbatches: int):
        """The schedule that runs `microbatches` micro-batches a step (a batch that grows over
        training, train.batch_ramp, takes several): built once each."""
        if microbatches not in self.schedules:
            self.schedules[microbatches] = self.make_schedule(microbatches)
        return self.schedules[microbatches]

    def sum_gradients(self) -> None:
        """After a backward pass: what the gradients of parameters held twice need (the
        embedding's copies under pipelining)."""
        if self.embedding_copies is not None:
            self.embedding_copies.sum_gradients()

    def share_weights(self) -> None:
        """After the optimizer's step, or anything else that set the weights (a checkpoint loaded,
        the moving average swapped in): what parameters held twice need (the embedding's copy
        under pipelining takes the first stage's weights). Every rank calls it."""
        if self.embedding_copies is not None:
            self.embedding_copies.share_weights()

    def unstepped(self) -> list[torch.Tensor]:
        """The parameters no optimizer steps here (the embedding's copy: see share_weights)."""
        held = self.embedding_copies.held if self.embedding_copies is not None else None
        return [held] if held is not None else []

    def counts(self, param: torch.Tensor) -> bool:
        """Whether a norm over the whole model counts param: not where it is the second copy of
        something held twice."""
        return self.embedding_copies is None or param is not self.embedding_copies.held


def _holder(parts: list[nn.Module]) -> nn.Module:
    """One module whose children are the stages' pieces, named as in the whole model (of a piece
    two stages hold, the embedding's copies, the first stage's)."""
    holder = nn.Module()
    holder.layers = nn.ModuleDict()
    for part in sorted(parts, key=lambda p: min(map(int, p.layers))):
        for name, child in part.named_children():
            if name == "layers":
                holder.layers.update(child)
            elif child is not None and getattr(holder, name, None) is None:
                setattr(holder, name, child)
    return holder


def parallelize(model: nn.Module, mesh: DeviceMesh | None, layout: Layout, cfg: RunConfig,
                device: torch.device, param_dtype: torch.dtype = torch.float32,
                stream_dtype: torch.dtype | None = None) -> ParallelModel:
    parallel = cfg.parallel
    parts, ids, num_stages = [model], [0], 1
    if layout.pp > 1:
        pp_rank = mesh["pp"].get_local_rank()
        num_stages = layout.pp * parallel.stages_per_rank
        ids = stage_ids(parallel.pp_schedule, pp_rank, layout.pp, parallel.stages_per_rank)
        parts = split_stages(model, ids, num_stages, parallel.pp_stage_blocks)
    for part in parts:
        if layout.tp > 1:
            apply_tp(part, mesh["tp"])
        if layout.cp > 1:
            apply_cp(part, mesh["cp"].get_group(), cfg.data.seq_len)
        split = expert_mesh(mesh, layout.ep, layout.tp) if cfg.model.moe else None
        if split is not None:
            apply_ep(part, split, layout.ep)
        apply_recompute(part, parallel.recompute)
        if cfg.train.compile:
            mode = None if cfg.train.compile_mode == "default" else cfg.train.compile_mode
            for block in part.layers.values():
                # A mixture's routing waits on the host, and torch's grouped GEMM traces in bf16
                # only: a mixture block compiles its attention, the rest runs eagerly.
                (block.attention if isinstance(block.feed_forward, MoE) else block).compile(mode=mode)
            for depth in getattr(part, "mtp", None) or []:  # multi-token prediction's (dense) blocks
                depth.block.compile(mode=mode)
        if mesh is not None:
            apply_fsdp(part, mesh, param_dtype=param_dtype, reshard_after_forward=layout.pp == 1,
                       stream_dtype=stream_dtype)
    if layout.pp == 1:
        return ParallelModel(module=model, parts=parts)
    microbatches = cfg.seqs_per_step // (layout.dp * cfg.train.micro_batch)
    make_schedule = partial(build_schedule, parts, ids, num_stages, parallel.pp_schedule, group=mesh["pp"].get_group(),
                            device=device)
    schedule = make_schedule(microbatches)
    first, last = 0 in ids, num_stages - 1 in ids
    copies = None
    if last_stage_embeds(cfg.model):
        last_holder = next(rank for rank in range(layout.pp)
                           if num_stages - 1 in stage_ids(parallel.pp_schedule, rank, layout.pp, parallel.stages_per_rank))
        copies = EmbeddingCopies(mesh, 0, last_holder, parts, last)
    return ParallelModel(module=_holder(parts), parts=parts, schedule=schedule, first=first, last=last,
                         embedding_copies=copies,
                         forward=partial(forward_only, parts, ids, num_stages, parallel.pp_schedule,
                                         mesh["pp"].get_group()),
                         make_schedule=make_schedule, schedules={microbatches: schedule})
