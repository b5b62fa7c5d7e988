"""Pipeline parallelism with `torch.distributed.pipelining`: the blocks split into consecutive
stages, each rank running one stage (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019,
"PipeDream") or several "virtual" stages (interleaved 1F1B, Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters"; zero-bubble schedules, Qi et al. 2024,
"Zero Bubble Pipeline Parallelism"), over micro-batches of each rank's share of the batch.

A stage is the whole model with the blocks of other stages removed (and the embedding or the
output head where it is not the first or last stage), so every parameter keeps the name it has
in the whole model, and checkpoints move between pipelined and unpipelined layouts. The last
stage computes the loss itself (it is given the targets), through the chunked head and with
multi-token prediction's depths as one process does.

A tied output head and multi-token prediction's depths read the embedding on the last stage too:
that stage holds a copy of it, as Megatron-LM does (Shoeybi et al. 2019; Narayanan et al. 2021,
section 4.2), under the same name. The copies start equal; after each backward pass the copy's
gradient is added to the first stage's (EmbeddingCopies), whose optimizer steps the embedding,
and after the step the copy takes its weights again. Only the first stage keeps optimizer state
for it (Megatron-LM steps both copies, each with its moments: 8 bytes a parameter more on the
last rank, 4 GB for a vocabulary of 128k at width 4,096 before sharding). Checkpoints hold one
(DCP keeps one of the keys several ranks save), which every copy loads. The V-shaped schedules
run the first and the last stage on one rank, which DeepSeek-V3 (Liu et al. 2024, section 3.2.3)
chose so that multi-token prediction's depths and the main model share the embedding and head
there: the two stages hold a copy each (FSDP shards each stage as its own whole), the sum and
the sharing are local copies, no communication, and the rank's whole model and checkpoints hold
the first stage's alone.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.pipelining._backward as split_backward
import torch.distributed.pipelining.stage as pipeline_stage
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import _CustomReducer
from torch.distributed.pipelining.schedules import get_schedule_class

from scaletrain.parallel.layout import ZERO_BUBBLE, stage_blocks, stage_ids, stage_layers
from scaletrain.train.optim import local_shard

# Our names for the schedules -> torch.distributed.pipelining's.
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
             "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble",
             "dualpipev": "DualPipeV"}


def split_stages(model: nn.Module, ids: list[int], num_stages: int,
                 blocks: list[int] | None = None) -> list[nn.Module]:
    """One module per stage in ids, each holding its consecutive blocks (`blocks` of each stage,
    parallel.pp_stage_blocks, or n_layers / num_stages); the last also the embedding where it
    reads it (last_stage_embeds). Each shares the whole model's tallies (model/loss.py's Tally:
    where the trainer reads the z-loss and multi-token prediction)."""
    layers = stage_layers(stage_blocks(len(model.layers), num_stages, blocks))
    shared = {id(tally): tally for tally in (model.z_tally, model.mtp_tally) if tally is not None}
    parts = []
    for stage in ids:
        part = copy.deepcopy(model, memo=dict(shared))
        keep = {str(i) for i in layers[stage]}
        for name in [name for name in part.layers if name not in keep]:
            del part.layers[name]
        last = stage == num_stages - 1
        if stage != 0 and not (last and last_stage_embeds(model.cfg)):
            part.tok_embeddings = None
        if not last:
            part.norm, part.output, part.mtp = None, None, None
        parts.append(part)
    return parts


def last_stage_embeds(cfg) -> bool:
    """Whether the last stage reads the embedding too (and holds a copy of it): for a tied output
    head, or multi-token prediction's depths (model.mtp_depth)."""
    return cfg.tie_embeddings or bool(cfg.mtp_depth)


class EmbeddingCopies:
    """The embedding's two copies, in the first and the last stage: after a backward pass the
    first's gradient holds the sum of both, the first's optimizer steps it, and the copy then
    takes its weights. On two ranks (looping schedules) that is one reduce and one broadcast
    between them; on one (V-shaped schedules: its first and last stage), two local copies.
    Every rank builds one (the pairs' groups are made together); `held` is the copy this rank
    holds where it runs the last stage (else None): no optimizer steps it, and a norm over the
    whole model must not count it."""

    def __init__(self, mesh: DeviceMesh, first_holder: int, last_holder: int, parts: list[nn.Module], last: bool):
        embeddings = [part.tok_embeddings.weight for part in parts if part.tok_embeddings is not None]
        self.weight = embeddings[0] if embeddings else None  # the first stage's where this rank runs it
        self.held = embeddings[-1] if last else None
        self.group = None
        self.source = None  # the global rank of this pair's first-stage copy
        if first_holder == last_holder:  # both on this rank, or neither
            return
        me = dist.get_rank()
        # Ranks that differ only in their pp coordinate hold the same shard of the embedding: one
        # pair of them per coordinate of the other dimensions. Every rank makes every pair's group.
        ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0).flatten(1)
        for column in ranks.unbind(1):
            pair = [int(column[first_holder]), int(column[last_holder])]
            group = dist.new_group(pair)
            if me in pair:
                self.group, self.source = group, pair[0]

    @property
    def local(self) -> bool:
        """Both copies on this rank."""
        return self.held is not None and self.held is not self.weight

    def sum_gradients(self) -> None:
        """Add the copy's gradient to the first stage's (on the ranks that hold one)."""
        if self.local:
            local_shard(self.weight.grad).add_(local_shard(self.held.grad))
        elif self.weight is not None and self.group is not None:
            dist.reduce(local_shard(self.weight.grad), dst=self.source, group=self.group)

    @torch.no_grad()
    def share_weights(self) -> None:
        """After the optimizer's step (or whatever else set the weights): the copy takes the first
        stage's embedding."""
        if self.local:
            local_shard(self.held).copy_(local_shard(self.weight))
        elif self.weight is not None and self.group is not None:
            dist.broadcast(local_shard(self.weight), src=self.source, group=self.group)


def build_schedule(parts: list[nn.Module], ids: list[int], num_stages: int, schedule: str, microbatches: int,
                   group, device: torch.device):
    """The schedule that runs this rank's stages: `.step(inputs, targets=..., target=...,
    losses=[...])` trains on a batch (gradients averaged over its micro-batches). The last stage
    is given the targets as a keyword (the schedule cuts those into micro-batches too) and returns
    the loss, which is what the schedule's own `target` and loss function then pass on."""
    stages = [PipelineStage(part, stage, num_stages, device, group=group) for part, stage in zip(parts, ids)]
    for stage in stages:
        _no_p2p_to_self(stage, dist.get_rank(group))
    cls = get_schedule_class(SCHEDULES[schedule])
    if schedule in ZERO_BUBBLE:
        _mend_split_backward()
    # The last stage's outputs (losses, not batches) are not put together: `losses` has them.
    # (The reducer's class is torch's own, not exported in torch 2.11-2.13.)
    options = dict(n_microbatches=microbatches, loss_fn=_the_loss, output_merge_spec=_CustomReducer(None, _nothing))
    return cls(stages[0] if schedule in ("gpipe", "1f1b") else stages, **options)


def _mend_split_backward() -> None:
    """Zero-bubble schedules run torch's inputs' half of each split backward pass and this
    project's weights' half (weights_pass): torch's own gave wrong or no gradients on a last stage
    with multi-token prediction's depths (see there)."""
    pipeline_stage.stage_backward_weight = weights_pass


def weights_pass(weights, param_groups: list[dict]) -> tuple[torch.Tensor | None, ...]:
    """The weights' half of a split backward pass, from what the inputs' half (torch's
    stage_backward_input) left: for each group of weights, the graph nodes where its part of the
    graph meets the inputs' (`intermediates`) and the gradients each received (`grads`). Each node
    is given its gradients again and nothing else, so that a node below another of its group's is
    not counted twice, and every output of a node counts, not its first alone (torch 2.11 did both,
    and trained wrong gradients of the embedding under two or more multi-token prediction depths,
    whose chained lookups make such groups). The graph is kept until every group is done: one
    group's path can run through another's, which torch 2.11-2.13 had freed ("Trying to backward
    through the graph a second time"); it goes when the pass ends, having held no more than it held
    when the pass began."""
    weights = list(weights)
    position = {split_backward._get_grad_fn_or_grad_acc(weight): i for i, weight in enumerate(weights)}
    for group in param_groups:
        edges, given, hooks = [], [], []
        for node, received in zip(group.pop("intermediates"), group.pop("grads", None) or []):
            for i, grad in enumerate(received):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    given.append(grad)
            hooks.append(node.register_prehook(lambda _grads, received=received: received))
        try:
            if edges:
                found = torch.autograd.grad(edges, [GradientEdge(node, 0) for node in group["params"]],
                                            grad_outputs=given, retain_graph=True)
                for node, grad in zip(group["params"], found, strict=True):
                    weight = weights[position[node]]
                    if weight.grad is None:
                        weight.grad = grad
                    else:
                        weight.grad += grad
        finally:
            for hook in hooks:
                hook.remove()
    return tuple(weight.grad for weight in weights)


def _nothing(_merged, _output) -> None:
    return None


def _the_loss(loss: torch.Tensor, _target) -> torch.Tensor:
    """The schedule's loss function: the last stage computed the loss already."""
    return loss


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
