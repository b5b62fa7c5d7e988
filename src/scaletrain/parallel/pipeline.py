"""Pipeline parallelism with `torch.distributed.pipelining`: the blocks split into consecutive
stages, each rank running one stage (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019,
"PipeDream") or several "virtual" stages (interleaved 1F1B, Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters"; zero-bubble schedules, Qi et al. 2024,
"Zero Bubble Pipeline Parallelism"), over micro-batches of each rank's share of the batch.

A stage is the whole model with the blocks of other stages removed (and the embedding or the
output head where it is not the first or last stage), so every parameter keeps the name it has
in the whole model, and checkpoints move between pipelined and unpipelined layouts.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from scaletrain.model.loss import cross_entropy
from scaletrain.parallel.layout import stage_ids

# Our names for the schedules -> torch.distributed.pipelining's.
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
             "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble",
             "dualpipev": "DualPipeV"}
def split_stages(model: nn.Module, ids: list[int], num_stages: int) -> list[nn.Module]:
    """One module per stage in ids, each holding n_layers / num_stages consecutive blocks."""
    per_stage = len(model.layers) // num_stages
    parts = []
    for stage in ids:
        part = copy.deepcopy(model)
        keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
        for name in [name for name in part.layers if name not in keep]:
            del part.layers[name]
        if stage != 0:
            part.tok_embeddings = None
        if stage != num_stages - 1:
            part.norm, part.output = None, None
        parts.append(part)
    return parts


def build_schedule(parts: list[nn.Module], ids: list[int], num_stages: int, schedule: str, microbatches: int,
                   group, device: torch.device, z_loss: float = 0.0, z_tally=None):
    """The schedule that runs this rank's stages: `.step(inputs, target=..., losses=[...])`
    trains on a batch (gradients averaged over its micro-batches); the z-loss's log²Z goes to
    `z_tally` (model/loss.py's Tally)."""
    stages = [PipelineStage(part, stage, num_stages, device, group=group) for part, stage in zip(parts, ids)]
    for stage in stages:
        _no_p2p_to_self(stage, dist.get_rank(group))
    cls = get_schedule_class(SCHEDULES[schedule])
    loss_fn = partial(cross_entropy, z_loss=z_loss, tally=z_tally)
    if schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)


def _no_p2p_to_self(stage: PipelineStage, me: int) -> None:
    """torch 2.11 and 2.12 open a pipeline's links by sending a tensor to each stage's
    neighbours, the one on the same rank too (V-shaped schedules), which gloo cannot do ("Pair is
    not connected"); later releases open them otherwise. Leave those sends out."""
    ops_of = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if ops_of is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops_of() if op.group_peer != me]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@torch.no_grad()
def forward_only(parts: list[nn.Module], ids: list[int], num_stages: int, schedule: str, group,
                 inputs: torch.Tensor | None, documents: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run one batch forward through the pipeline, stage after stage, with no micro-batching:
    what evaluation needs. (The schedules' own `eval` hangs for V-shaped schedules in torch 2.13,
    and it would need eval batches shaped like training ones.) Returns the last stage's output
    on the rank that runs it, else None. inputs: the batch on the rank that runs stage 0;
    documents: its document ids, on every rank (None: causal attention over whole sequences)."""
    pp = dist.get_world_size(group)
    owner = {stage: rank for rank in range(pp) for stage in stage_ids(schedule, rank, pp, len(ids))}
    me = dist.get_rank(group)
    x = inputs
    for stage, part in sorted(zip(ids, parts), key=lambda pair: pair[0]):
        if stage > 0 and owner[stage - 1] != me:
            header = torch.empty(5, dtype=torch.int64, device=part.rope_cos.device)
            dist.recv(header, group_src=owner[stage - 1], group=group)
            x = torch.empty(header[1:4].tolist(), dtype=_DTYPES[int(header[0])], device=header.device)
            dist.recv(x, group_src=owner[stage - 1], group=group)
        x = part(x, documents=documents)
        if stage < num_stages - 1 and owner[stage + 1] != me:
            x = x.contiguous()
            header = torch.tensor([_DTYPES.index(x.dtype), *x.shape, 0], dtype=torch.int64, device=x.device)
            dist.send(header, group_dst=owner[stage + 1], group=group)
            dist.send(x, group_dst=owner[stage + 1], group=group)
    return x if num_stages - 1 in ids else None
