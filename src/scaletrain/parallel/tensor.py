"""Tensor parallelism with sequence parallelism (Megatron-LM: Shoeybi et al. 2019; Korthikanti
et al. 2022), through DTensor's `parallelize_module`.

Inside a block, attention heads and MLP columns are split over the tp ranks (column-parallel
wq/wk/wv/w1/w3, row-parallel wo/w2); between blocks the residual stream is split along the
sequence (norms run on a sequence shard), so activations are never replicated. The output head
stays split over the vocabulary and the loss is computed on those shards (`loss_parallel`);
a tied embedding is split the same way (by vocabulary rows), so one sharded matrix serves both.
Multi-token prediction's depths (model.mtp_depth) are split as blocks, on the same sequence
shards. A mixture-of-experts block routes each rank's part of the sequence with the whole
router, the ranks summing its gradients; its routed experts are split over the tp ranks by
expert, as expert parallelism splits them (parallel/expert.py, model/moe.py).
"""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from scaletrain.model.moe import ContiguousGradient, MoE


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parallelise model (or a pipeline stage of it: parts it lacks are None) over tp_mesh."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Logits stay split over the vocabulary: the loss is computed shard-wise.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    tied = (model.output is not None and model.tok_embeddings is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, {name: style for name, style in plan.items()
                                        if getattr(model, name) is not None})
    if tied:  # both split the (vocab, dim) matrix by rows, so one sharded parameter serves both again
        model.output.weight = model.tok_embeddings.weight
    model.sequence_shards = tp_mesh.size()  # (a later stage's hidden states: one of these shards)
    for block in model.layers.values():
        _parallelize_block(block, tp_mesh)
    for depth in getattr(model, "mtp", None) or []:
        # Multi-token prediction's depths run on the residual stream's sequence shards as the
        # blocks' norms do: its norms and the projection that joins the two streams keep whole
        # weights (the projection's gradient summed over the ranks), its block is split as the
        # trunk's, and its final norm hands the shared output head a sequence shard.
        parallelize_module(depth, tp_mesh, {"hidden_norm": SequenceParallel(), "embedding_norm": SequenceParallel(),
                                            "proj": SequenceParallel(use_local_output=True),
                                            "norm": SequenceParallel()})
        depth.proj.forward = partial(_linear_on_sequence_shards, depth.proj)
        _parallelize_block(depth.block, tp_mesh)


def _linear_on_sequence_shards(linear: nn.Linear, x: DTensor) -> DTensor:
    """linear(x) for x (batch, seq, in) split along the sequence, computed with the sequence
    first: a linear layer flattens its input's leading dimensions, which torch 2.11's DTensor
    refuses where the second one is split ("Attempted to flatten multiple dimensions, with
    dimension 1 being sharded") and allows where the first is. Its output, and the gradient it
    passes back (to a pipeline stage's input, which torch sends as it is), are contiguous again."""
    return F.linear(ContiguousGradient.apply(x).transpose(0, 1), linear.weight).transpose(0, 1).contiguous()


def _parallelize_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    head_norm = SequenceParallel(sequence_dim=2, use_local_output=True)  # (batch, seq, heads, head_dim): heads split
    parallelize_module(block, tp_mesh, {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin, kv, start_pos, bias): gather x's sequence for attention; the rest are
        # not DTensors (a document bias covers whole sequences already).
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        # QK-norm normalises each head on the rank that holds it; its weight, shared by all
        # heads, stays whole and sums its gradient over the tp ranks.
        **({"attention.q_norm": head_norm, "attention.k_norm": head_norm}
           if block.attention.q_norm is not None else {}),
        "ffn_norm": SequenceParallel(),
        **(_mixture_plan() if isinstance(block.feed_forward, MoE) else {
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }),
    })
    if isinstance(block.feed_forward, MoE):
        block.feed_forward.tp_group = tp_mesh.get_group()  # (its routed experts: parallel/expert.py)


def _mixture_plan() -> dict:
    """A mixture of experts routes the rank's part of the sequence with whole weights (see
    model/moe.py): it takes the norm's output as the plain tensor of that part, and gives back
    the residual stream's plain part of the sequence, as the row-parallel w2 does."""
    return {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                               use_local_output=True)}
