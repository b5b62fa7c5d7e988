"""Activation recomputation: keep fewer activations for the backward pass, recompute the rest.

"full" keeps only each block's input and recomputes the whole block in the backward pass
(Chen et al. 2016); "selective" keeps the outputs of matmuls and attention — the expensive
ops — and recomputes the cheap element-wise ones (norms, activations, rope), in the spirit of
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models".
`checkpoint_wrapper` strips its own prefix from state-dict keys, so checkpoints load the same
with or without recomputation.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils import checkpoint as _checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# Ops whose outputs "selective" keeps: recomputing them would cost as much as the forward.
SAVED_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
             _aten._scaled_dot_product_flash_attention.default,
             _aten._scaled_dot_product_efficient_attention.default,
             _aten._scaled_dot_product_cudnn_attention.default,
             _aten._scaled_dot_product_flash_attention_for_cpu.default,
             _aten._grouped_mm.default,  # a mixture's experts (model/moe.py)
             # model.attention_kernel = "flex": the policy sees its operator eagerly and within compiled
             # blocks; called compiled on its own (train.compile = false, on CUDA) it may not, and be
             # recomputed (not measured: no GPU here).
             torch.ops.higher_order.flex_attention}


# Selective recomputation replays a block's ops in the order and number its forward ran them.
# FSDP marks its hooks with the profiler's record_function ops, which run a different number of
# times in the forward and in the recomputation where an FSDP unit sits inside the block (a
# mixture's experts: parallel/fsdp.py), and the replay stops ("invocation index ... not found in
# storage"). They annotate and compute nothing: left out of the replay, the part of torch's fix
# (pytorch/pytorch#196862; torchtitan#3427, DeepSeek-V3 under FSDP x EP) that this layout needs.
# Its other part, FSDP's all-gather internals left out too, is not taken: they run as often in the
# replay as in the forward where the forward does not prefetch (parallel/fsdp.py sets none), as
# tests/test_moe.py's ep 2 x tp 2 x FSDP 2 layout under selective recomputation checks. (The set is
# torch.utils.checkpoint's, public since 2.5; should a torch lack it, nothing is added.)
_RECORD_FUNCTION_OPS = (torch.ops.profiler._record_function_enter.default,
                        torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction)


# Under train.compile a dense block is compiled whole, its selective region traced with it, so the
# policy sees the block's aten ops before inductor lowers them. A mixture block compiles its
# attention alone (parallel/apply.py), inside the block's eager region: the policy sees what the
# compiled code calls, attention's kernel (kept) and inductor's matmuls as out= variants, which
# cannot be replayed from a cache (the compiled code reads the buffer it passed, not what the op
# returns) and are computed again; plan/timing.py counts them. (So under torch's default,
# torch._inductor.config.wrap_inductor_compiled_regions = False; with it the compiled attention
# would be one op to the policy, recomputed whole.)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Wrap each block of model.layers, and the block of each multi-token prediction depth, for
    recomputation ("none", "selective" or "full")."""
    if mode == "none":
        return
    if mode == "full":
        wrap = checkpoint_wrapper
    elif mode == "selective":
        getattr(_checkpoint, "SAC_IGNORED_OPS", set()).update(_RECORD_FUNCTION_OPS)  # (above: why)
        wrap = partial(checkpoint_wrapper, context_fn=partial(create_selective_checkpoint_contexts, _policy))
    else:
        raise ValueError(f"recompute mode {mode!r}; valid: none, selective, full")
    for name, block in model.layers.items():
        model.layers[name] = wrap(block)
    for depth in getattr(model, "mtp", None) or []:
        depth.block = wrap(depth.block)
