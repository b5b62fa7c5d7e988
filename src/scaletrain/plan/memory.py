"""Bytes one device holds while training, predicted from the config alone — arithmetic, no torch.

Components (per device, in bytes):
- parameters, gradients: float32, N / (FSDP shards × tensor-parallel ranks); norm weights stay
  whole under tensor parallelism;
- optimizer: AdamW's two float32 moments per parameter and a float32 step count per tensor; with
  train.optimizer = "muon", the blocks' matrices keep one float32 momentum instead, and the
  optimizer's step works on one matrix at a time (train/optim.py): for the largest, whole (as it
  gathers it) or the rank's own stack of experts, 20 bytes per entry on top of the gradients —
  the new momentum, its Nesterov mix, the iteration's two working copies and the orthogonalised
  update, 4 bytes each in float32; 28 when FSDP alone splits the matrices, whose step sends
  each rank's rows of a bucket of them (about one matrix's worth) to their owners and takes
  its rows of the results back: the mix, the buffer sent, the matrix received, two working
  copies, the result and the rows returned (counted from the code, not measured);
- ema: with train.ema_decay, the moving average of the weights, float32 as the parameters and
  sharded alike (an evaluation swapping it in holds one more copy of the rank's weights, but
  no activations for a backward pass: not the peak);
- weight copies: the bf16 copies that autocast (or FSDP's bf16 all-gather) makes of the matmul
  weights and that the backward pass keeps — all of them on one device, two blocks' worth
  under FSDP (one in use, one prefetched; FSDP wraps every run of more than one process, and
  over a single shard, as under tensor parallelism alone, it still gathers, into a bf16 copy,
  and frees), all of the rank's blocks under FSDP with pipelining
  (which keeps them gathered from forward to backward: parallel/apply.py); where FSDP gathers
  float32 parameters under 16-bit compute (parallel.fsdp_param_dtype = float32), two blocks'
  float32 gathers and autocast's 16-bit copy of every block's matmul weights, whole, as on one
  device (the backward pass keeps them, and FSDP cannot free them: counted from the code, not
  measured);
- activations: what each block saves for the backward pass, per token (below), times tokens
  per micro-batch and layers, over tensor × context parallel ranks;
- loss: the output head's logits and their gradient at the loss (float32 log-softmax), or one
  chunk's with train.loss_chunk_tokens (then also the head's float32 weight gradient, and in
  bf16 a chunk's bf16 part of it before it is summed in);
- multi-token prediction (model.mtp_depth): its modules' parameters, gradients and optimizer
  state as the blocks', its projections and norms whole under tensor parallelism, all on the
  last pipeline stage, which also holds a copy of the embedding (as for a tied head: its weights
  and gradient, stepped by the first stage's optimizer; beside the embedding itself on rank 0
  under the V-shaped schedules; checked
  against real runs': one process, tp = 2, pp = 2), and per depth the activations of one more dense
  block (recomputed as the blocks are) and one more loss — an estimate, not a tally: the joined
  inputs and the depths' norms are left out and the loss counts its gradient, which is more
  (tests: 1.06–1.08 of what autograd saves for the depths in float32, 1.28–1.31 in bf16, at
  width 128 and a vocabulary of 512; a larger vocabulary weighs the loss more): on the safe
  side.

Per token and layer, a block of width d, h query heads, key/value width k (kv heads × head
dim) and MLP width F saves, with bf16 compute (residual stream float32), 18d + 4k + 8F + 4h + 8
bytes without recomputation: for each of its two norms the float32 input (4d) and the bf16 copy
the projections read (2d); rotated q, k and v (2d + 4k); the attention output and its (batch,
seq, dim) copy for wo (2d each) and the attention's float32 log-sum-exp (4h); w1, w3, silu(w1)
and their product (2F each); two float32 norm scales (8). The norms keep their input and
1 / rms only, as CUDA's fused kernel does (model/llama.py's RMSNorm does so on other devices
too; torch's composite rms_norm would also keep the normalised input, 8d more). In float32:
28d + 8k + 16F + 4h + 8 (the norms' outputs are then float32 copies, 4d each). QK-norm adds
4d + 4k + 4h + 4·(kv heads) either way: the float32 input of q's and k's norms and one scale
per head. Under FSDP's bf16 parameters (parallel.fsdp_param_dtype = auto under bf16, in every run
of more than one process: FSDP wraps the model whenever there is a mesh) the residual stream
between blocks is bf16 and the norms keep their bf16 input (model/llama.py's RMSNorm normalises
an input of its weight's dtype as it is, accumulating in float32): 14d + 4k + 8F + 4h + 8, QK-norm
2d + 2k + 4h + 4·(kv heads), selective recomputation 2d less, full 2d. Under float16, FSDP
gathers float16 parameters but each block hands the stream on in float32 (parallel/fsdp.py): the
float32 tally, with QK-norm's 16-bit q and k (2d + 2k + ...; measured on 2 gloo ranks). Under context parallelism (cp ranks) attention
saves the keys and values of the whole sequence it gathered, cp times the local ones: 4k·(cp - 1)
more per local token (8k·(cp - 1) in float32). This is the tally of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", section 4.1) redone for this SwiGLU block, whose attention kernel
keeps no score matrix; tests check it against the bytes autograd actually saves. Selective
recomputation keeps the outputs of matmuls and attention and the block input: 12d + 4k + 4F +
4h in bf16, 20d + 8k + 8F + 4h in float32 (a mixture: in place of the MLP's 4F + 2d, or 8F + 4d,
the float32 router logits, 4E, and the outputs of the experts' grouped GEMMs, 4(k + S)F_e +
2(k + [S > 0])d, twice that in float32); full recomputation keeps the block input (4d) and
rebuilds one block at a time (both 2d less under the bf16 stream; tests check each, in float32,
bf16 and the bf16 stream, against the storages a forward pass leaves alive for the backward).
Attention within documents (model.document_mask) adds one
additive mask per micro-batch, shared by the blocks, of each local query over the whole
sequence's keys: T bytes per local token in the compute dtype's size, 2T in bf16, 4T in float32;
a sliding window shorter than the sequence (model.sliding_window) one such mask of a sequence,
shared by the micro-batch's sequences too (with model.full_attention_layers and documents, the
documents' mask beside the window's: two, on a pipeline rank that holds blocks of both kinds). With model.attention_kernel = "flex" on CUDA (no
context parallelism) there is no such mask, nor repeated heads: FlexAttention's block mask is
a few bytes a block of 128 x 128 scores, and it takes grouped heads as they are.
On CUDA, whose masked kernel takes no grouped heads, its keys and values are repeated to every
query head and saved so (without recomputation): 4d per token in place of 4k in bf16, and under
context parallelism 4d·(cp + ½) in place of 4k·cp, each of a rank's two query chunks with its
own copy of the keys up to its end (tests measure both with the CPU taking CUDA's path). Under
context parallelism a block's backward pass also holds, for a moment, the gradients of the
whole sequence's keys and values and their slices' (twice the gathered 4k·cp a local token),
and the gathered keys and values again where they are recomputed: added to the peak, from
parallel/context.py's code, not measured.

A mixture-of-experts block (model/moe.py; E experts of width F_e, k per token, S shared
experts) saves, in place of the MLP's 8F (bf16) or 16F (float32), per token: the float32
router input (4d, bf16 only: in float32 it is the norm's output, already counted; and then the
norm's bf16 output is not saved unless shared experts read it, -2d), the router's
probabilities (4E; with sigmoid scores also their sum, 4, which the balance loss divides by), the chosen experts' indices and the two permutations (24k), the chosen
weights (4k; 8k + 4 when renormalised over k > 1), the k rows gathered for the experts (2kd,
float32 4kd), each expert's w1, w3, silu(w1) and product over its rows (8kF_e, float32 16kF_e),
the k float32 expert outputs weighted at the end (4kd) and the shared experts' 8SF_e (16SF_e).
Every expert runs on every rank, rows or not, so autocast's bf16 copies of all the experts'
weights are kept (without FSDP); under FSDP a rank gathers its E/ep experts in bf16. Counted
against autograd by the same tests as the dense block, with each recomputation.

Peak = parameters + optimizer + weight copies + the larger of (activations + loss, plus the
gradients when micro-batches accumulate into them) and (gradients + one block's activations):
with gradients set to None after each step, a single micro-batch's backward starts holding
none. Under a pipeline with FSDP the accumulating gradients are the stage's whole, not its
shards: torch's pipeline stages turn FSDP's gradient reduction (and resharding) off for every
backward but the step's last, so each rank holds its stage's unsharded float32 gradients
beside the micro-batches' activations (its bf16 weights stay gathered too, counted below;
under expert parallelism its own experts only). The CUDA caching allocator adds fragmentation
on top, which this does not model.

Pipeline parallelism (pp ranks) gives each rank its stages' blocks (L/pp, or the counts of
parallel.pp_stage_blocks), the embedding to the rank of the first stage and the final norm and output head (and the loss) to the rank of the last; the
V-shaped schedules put both on rank 0. The first rank holds the activations of several
micro-batches at once, each of its blocks (in_flight_microbatches): all of them under
GPipe and breadth-first looping; pp under 1F1B (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters", section 2.2), times 1 + (pp - 1)/(pp·v) when it
interleaves v stages a rank (Korthikanti et al. 2022, section 4.2.3); pp under the zero-bubble
schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism": ZB-H1 and ZB-V keep 1F1B's
peak, a micro-batch's activations counted until its weights' gradients are taken); pp + 1/2
under DualPipeV as torch schedules it, one stage's micro-batch (half a rank's blocks) more
than ZB-V (the DeepSeek-V3 technical report, 2024, table 2, gives pp + 1 for the
two-directional DualPipe). The last rank holds one micro-batch and its loss under 1F1B,
((v - 1)·pp + 1)/v under interleaving (the same count of warm-up chunks, for the last rank),
pp under interleaved zero bubble (as every rank does), and every micro-batch with its loss
under GPipe and breadth-first looping, which keep each loss until its backward. Each count is
the peak of the action lists torch's schedules run, which tests/test_plan.py walks. The ranks
between hold pp - r micro-batches under 1F1B (rank r), (2 (pp - 1 - r) + (v - 1) pp + 1)/v under
interleaving, and are counted with the first rank's count under the zero-bubble schedules (an
upper bound). Every rank is estimated with its own blocks (a mixture
of experts with dense first blocks: its own share of mixture blocks), and the estimate is that
of the rank with the largest peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scaletrain.config import effective_window
from scaletrain.model.flops import attention_linear_params, moe_layers, param_counts
from scaletrain.parallel.layout import V_SHAPED, stage_blocks, stage_ids, stage_layers


@dataclass
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    weight_copies: int
    activations: int
    loss: int
    peak: int
    ema: int = 0
    # A pipeline with FSDP: the stage's gradients whole (float32) while its micro-batches run,
    # where `gradients` are the shards the step leaves (0 otherwise).
    gradients_whole: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def parameter_tensors(cfg: Any) -> int:
    """Parameter tensors of model/llama.py's Transformer (AdamW keeps a step count for each)."""
    per_layer = 7 + 2 + (2 if cfg.qk_norm else 0)  # wq wk wv wo w1 w2 w3, two norms, q/k norms
    # A mixture's MLP: the router and the three stacked expert weights (+ the shared experts' three).
    per_moe_layer = per_layer + 1 + (3 if cfg.moe_shared_experts else 0) if moe_layers(cfg) else 0
    per_depth = per_layer + 1 + 3  # multi-token prediction: a dense block, the projection, three norms
    return ((cfg.n_layers - moe_layers(cfg)) * per_layer + moe_layers(cfg) * per_moe_layer + _mtp(cfg) * per_depth
            + 1 + 1 + (0 if cfg.tie_embeddings else 1))  # embedding, final norm, head


def fsdp_dtype(compute: str, setting: str = "auto", processes: int = 1) -> str | None:
    """What FSDP gathers parameters in ("bf16", "fp16" or "fp32"), as train chooses it: FSDP wraps
    the model in every run of more than one process (None for one: the weights stay float32),
    gathering them in parallel.fsdp_param_dtype (`setting`), whose "auto" is the compute dtype
    (`compute`: "bf16", "fp16", or "fp32" and "tf32" for float32)."""
    if processes <= 1:
        return None
    if setting != "auto":
        return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[setting]
    return compute if compute in ("bf16", "fp16") else "fp32"


def _mtp(cfg: Any) -> int:
    """Multi-token prediction's depths (model.mtp_depth)."""
    return getattr(cfg, "mtp_depth", 0) or 0


def block_bytes_per_token(cfg: Any, bf16: bool, recompute: str, moe: bool = False, cp: int = 1,
                          gather_dtype: str | None = None) -> float:
    """Bytes one block saves per token for its backward pass (see the module's docstring): a
    dense block, or with `moe` a mixture-of-experts one; per local token under `cp`-way context
    parallelism; `gather_dtype`: what FSDP gathers the parameters in (fsdp_dtype): under "bf16" the
    residual stream is bf16 and the norms keep their bf16 input, 2d a norm less than a float32
    copy; under "bf16" and "fp16" QK-norm keeps 16-bit q and k."""
    d, k, f, lse = cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.hidden_dim, 4 * cfg.n_heads
    stream = 2 if bf16 and gather_dtype == "bf16" else 4  # bytes of a value of the residual stream
    if recompute == "full":
        return stream * d
    if recompute == "selective":  # the block's input and its matmuls' and attention's outputs
        size = 2 if bf16 else 4  # (of a matmul's output)
        attention = (10 * d + 4 * k if bf16 else 16 * d + 8 * k) + lse - (4 - stream) * d
        if not moe:
            return attention + 2 * size * f + size * d
        experts, top_k, width, shared = cfg.moe_experts, cfg.moe_top_k, cfg.expert_dim, cfg.moe_shared_experts
        # The float32 router logits, the experts' (and shared experts') w1, w3 and w2 outputs.
        return attention + 4 * experts + 2 * size * (top_k + shared) * width + size * (top_k + bool(shared)) * d
    # QK-norm keeps the input of q's and k's norms (float32; 16-bit with 16-bit parameters) and a scale per head.
    heads = 2 if bf16 and gather_dtype in ("bf16", "fp16") else 4
    qk = heads * (d + k) + 4 * cfg.n_heads + 4 * cfg.kv_heads if cfg.qk_norm else 0
    gathered = (4 if bf16 else 8) * k * (cp - 1)  # the rest of the sequence's keys and values
    common = (18 * d + 4 * k if bf16 else 28 * d + 8 * k) + lse + 8 + qk + gathered - 2 * (4 - stream) * d
    if not moe:
        return common + (8 if bf16 else 16) * f
    experts, top_k, width, shared = cfg.moe_experts, cfg.moe_top_k, cfg.expert_dim, cfg.moe_shared_experts
    routing = 4 * experts + 24 * top_k + (8 * top_k + 4 if top_k > 1 else 4 * top_k)
    if getattr(cfg, "moe_score", "softmax") == "sigmoid":  # the balance loss's per-token sum of the scores
        routing += 4
    if bf16:
        mlp = (4 * d - (0 if shared else 2 * d)) + 6 * top_k * d + 8 * (top_k + shared) * width
    else:
        mlp = 8 * top_k * d + 16 * (top_k + shared) * width
    return common + routing + mlp


def activation_bytes_per_token(cfg: Any, bf16: bool, recompute: str, cp: int = 1,
                               gather_dtype: str | None = None) -> float:
    """Bytes a block saves per (local) token for its backward pass, on average over the model's
    blocks (all alike but in a mixture of experts with dense first blocks)."""
    sparse = moe_layers(cfg)
    dense = block_bytes_per_token(cfg, bf16, recompute, cp=cp, gather_dtype=gather_dtype) if sparse < cfg.n_layers else 0
    mixture = block_bytes_per_token(cfg, bf16, recompute, moe=True, cp=cp, gather_dtype=gather_dtype) if sparse else 0
    return ((cfg.n_layers - sparse) * dense + sparse * mixture) / cfg.n_layers


def _largest_block_bytes_per_token(cfg: Any, bf16: bool, cp: int = 1, gather_dtype: str | None = None) -> float:
    """What the largest block saves per token without recomputation (the block being rebuilt):
    a mixture's, or a dense first block's when it saves more."""
    kinds = [moe for moe, count in ((False, cfg.n_layers - moe_layers(cfg)), (True, moe_layers(cfg))) if count]
    return max(block_bytes_per_token(cfg, bf16, "none", moe=moe, cp=cp, gather_dtype=gather_dtype) for moe in kinds)


def _block_weights(cfg: Any, ep: int = 1) -> tuple[float, float]:
    """The matmul weights that autocast or FSDP's gather turns into bf16 copies, of all blocks
    and of the largest: every expert (1/ep of them under expert parallelism, each rank
    gathering its own), not the router (float32)."""
    attention = attention_linear_params(cfg)
    sparse = moe_layers(cfg)
    dense = attention + 3 * cfg.dim * cfg.hidden_dim
    if not sparse:
        return cfg.n_layers * dense, dense
    mixture = attention + 3 * cfg.dim * cfg.expert_dim * (cfg.moe_experts / ep + cfg.moe_shared_experts)
    return (cfg.n_layers - sparse) * dense + sparse * mixture, max(mixture, dense if sparse < cfg.n_layers else 0)


# Schedules that run every micro-batch's forward before any backward: each rank holds them all.
ALL_IN_FLIGHT = ("gpipe", "looped_bfs")


def in_flight_microbatches(pp: int, microbatches: int, schedule: str = "1f1b", stages_per_rank: int = 1) -> float:
    """Micro-batches whose activations the first pipeline rank holds at its peak, each of its
    blocks (see the module's docstring); 1 without pipelining."""
    if pp == 1:
        return 1
    if schedule in ALL_IN_FLIGHT:
        count = microbatches
    elif schedule == "dualpipev":
        count = pp + 1 / 2
    elif schedule in (*V_SHAPED, "interleaved_zero_bubble") or stages_per_rank == 1:
        count = pp
    else:
        count = pp * (1 + (pp - 1) / (pp * stages_per_rank))
    return min(count, microbatches)


def last_rank_microbatches(pp: int, microbatches: int, schedule: str = "1f1b", stages_per_rank: int = 1) -> float:
    """Micro-batches whose activations the last pipeline rank holds at its peak, each of its
    blocks, under the schedules that give it the last stage alone (not the V-shaped ones)."""
    if schedule in ALL_IN_FLIGHT:
        return microbatches
    if schedule == "interleaved_zero_bubble":
        return in_flight_microbatches(pp, microbatches, schedule, stages_per_rank)
    return min(((stages_per_rank - 1) * pp + 1) / stages_per_rank, microbatches)


def rank_microbatches(pp: int, microbatches: int, schedule: str, stages_per_rank: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, each of its blocks:
    in_flight_microbatches on the first, last_rank_microbatches on the last (where it runs the last
    stage alone) and between them pp - r under 1F1B, (2 (pp - 1 - r) + (v - 1) pp + 1) / v under
    interleaved 1F1B (torch's warm-up count, 2 a rank fewer than the one before), every one under
    GPipe and breadth-first looping, and the first rank's count under the zero-bubble schedules,
    which tests/test_plan.py's walk of torch's action lists finds an upper bound there."""
    if schedule in V_SHAPED or rank == 0:
        return in_flight_microbatches(pp, microbatches, schedule, stages_per_rank)
    if rank == pp - 1:
        return last_rank_microbatches(pp, microbatches, schedule, stages_per_rank)
    if schedule == "1f1b":
        return min(pp - rank, microbatches)
    if schedule == "interleaved_1f1b":
        return min((2 * (pp - 1 - rank) + (stages_per_rank - 1) * pp + 1) / stages_per_rank, microbatches)
    return in_flight_microbatches(pp, microbatches, schedule, stages_per_rank)


def training_memory(cfg: Any, seq_len: int, micro_batch: int, *, micro_steps: int = 1, bf16: bool = True,
                    recompute: str = "none", fsdp: int = 1, tp: int = 1, cp: int = 1, pp: int = 1,
                    pp_schedule: str = "1f1b", pp_stages_per_rank: int = 1,
                    pp_stage_blocks: Sequence[int] | None = None,
                    loss_chunk_tokens: int = 0, ep: int = 1, optimizer: str = "adamw",
                    ema: bool = False, cuda: bool = True, gather_dtype: str | None = None) -> MemoryEstimate:
    """Predicted bytes per device for training model `cfg` (any object with ModelConfig's
    fields) on micro-batches of `micro_batch` sequences of `seq_len` tokens, gradients
    accumulated over `micro_steps` of them (the micro-batches a pipeline runs per step),
    parameters sharded over `fsdp` ranks (dp_shard × cp) and split over `tp`, each sequence
    split over `cp`, the blocks over `pp` pipeline ranks (`pp_stage_blocks` of each stage, else
    evenly), a mixture's experts over `ep` of the FSDP ranks (sharded over all `fsdp` of them
    either way); `ema`: train.ema_decay's moving average of the weights is kept; `cuda`: on a
    CUDA device, where attention within documents repeats grouped key/value heads (model/llama.py's
    attend), not elsewhere; `gather_dtype`: what FSDP gathers the parameters in, "bf16", "fp16" or
    "fp32" (fsdp_dtype: FSDP wraps the model in every run of more than one process), None for one
    process, whose weights stay float32. Under pipelining, the estimate of the pipeline rank with
    the largest peak."""
    common = dict(micro_steps=micro_steps, bf16=bf16, recompute=recompute, fsdp=fsdp, tp=tp, cp=cp,
                  loss_chunk_tokens=loss_chunk_tokens, ep=ep, optimizer=optimizer, ema=ema, cuda=cuda,
                  gather_dtype=gather_dtype)
    if pp == 1:
        return rank_memory(cfg, seq_len, micro_batch, **common)
    estimates = [rank_memory(rank_cfg, seq_len, micro_batch, **common, pp=pp, **held)
                 for rank_cfg, held in pipeline_ranks(cfg, pp, micro_steps, pp_schedule, pp_stages_per_rank,
                                                      pp_stage_blocks)]
    return max(estimates, key=lambda e: e.peak)


def pipeline_ranks(cfg: Any, pp: int, micro_steps: int, schedule: str, stages_per_rank: int,
                   given: Sequence[int] | None = None) -> list[tuple[Any, dict]]:
    """What each pipeline rank holds, as rank_memory's arguments: its blocks, whether it runs the
    first stage (the embedding) and the last (the head, and the embedding's copy where that
    stage reads it), and the micro-batches in flight at its peak (rank_microbatches). A mixture
    with dense first blocks has stages of unequal weight: each rank's model is one whose blocks
    are mixtures in the proportion of its own."""
    stages = pp * (2 if schedule in V_SHAPED else stages_per_rank)
    layers = stage_layers(stage_blocks(cfg.n_layers, stages, given))
    copy = bool(cfg.tie_embeddings or _mtp(cfg))  # the last stage holds a copy of the embedding
    out = []
    for rank in range(pp):
        ids = stage_ids(schedule, rank, pp, stages // pp)
        held = [layer for stage in ids for layer in layers[stage]]
        first, last = 0 in ids, stages - 1 in ids
        count = rank_microbatches(pp, micro_steps, schedule, stages_per_rank, rank)
        # (GPipe and breadth-first looping keep every micro-batch's loss until its backward; under
        # a V rank 0 runs the last stage, whose loss's backward follows at once)
        losses = (count if schedule in ALL_IN_FLIGHT else 1) if last else 0
        out.append((mixture_share(cfg, held), dict(blocks=len(held), layers=held, in_flight=count, losses=losses,
                                                   embedding=first, head=last, embedding_copy=copy and last)))
    return out


def mixture_share(cfg: Any, held: list[int]) -> Any:
    """`cfg` where every rank holds blocks alike; for a mixture with dense first blocks, the model
    whose blocks are mixtures in the proportion of `held`'s (rank_memory and the step time count
    a rank's blocks as their share of the model's), so that each pipeline rank is counted with
    the mixture blocks it holds."""
    return _MixtureShare(cfg, held) if 0 < moe_layers(cfg) < cfg.n_layers else cfg


class _MixtureShare:
    def __init__(self, cfg: Any, held: list[int]):
        mixtures = sum(1 for layer in held if layer >= cfg.moe_dense_layers)
        self._cfg, self.moe_dense_layers = cfg, cfg.n_layers - mixtures * cfg.n_layers / len(held)

    def __getattr__(self, name: str):
        return getattr(self._cfg, name)


def rank_memory(cfg: Any, seq_len: int, micro_batch: int, *, micro_steps: int = 1, bf16: bool = True,
                recompute: str = "none", fsdp: int = 1, tp: int = 1, cp: int = 1, loss_chunk_tokens: int = 0,
                pp: int = 1, in_flight: float = 1, losses: float = 1, embedding: bool = True,
                head: bool = True, layers: Sequence[int] | None = None, ep: int = 1, optimizer: str = "adamw", ema: bool = False,
                embedding_copy: bool = False, cuda: bool = True, blocks: float | None = None,
                gather_dtype: str | None = None) -> MemoryEstimate:
    """One rank's bytes (arguments as training_memory's): `blocks` blocks (L/pp unless given), the embedding and the
    output head (with the final norm) where it holds them, the activations of `in_flight`
    micro-batches of its blocks and, with the head, of `losses` micro-batches' loss.
    embedding: the rank holds the embedding (the first pipeline stage's, which its optimizer
    steps); embedding_copy: it holds the last pipeline stage's copy of it too (parallel/pipeline.py):
    its weights and gradient, no optimizer state. layers: the indices of the rank's blocks (a
    pipeline rank's), which tell what attention masks it builds; None: every kind in proportion."""
    counts = param_counts(cfg)
    held = cfg.n_layers / pp if blocks is None else blocks
    share = held / cfg.n_layers  # of the model's blocks
    outer = cfg.vocab * cfg.dim  # the embedding, and the output head unless tied to it
    norms = 2 * cfg.dim + (2 * cfg.head_dim if cfg.qk_norm else 0)
    # Multi-token prediction's depths sit beside the head (on the last pipeline stage): their
    # blocks' matrices, split under tp as the trunk's; their norms (a block's and three more) and
    # projections, whole under tp.
    depth_whole = _mtp(cfg) * (norms + 3 * cfg.dim + 2 * cfg.dim * cfg.dim) if head else 0
    depth_split = counts["mtp"] - _mtp(cfg) * (norms + 3 * cfg.dim + 2 * cfg.dim * cfg.dim) if head else 0
    # Matrices whole under tp too (every tp rank holds all of them): a mixture's routers and shared
    # experts (its routed experts split over tp).
    routing = moe_layers(cfg) * cfg.dim * (cfg.moe_experts + 3 * cfg.moe_shared_experts * cfg.expert_dim) \
        if moe_layers(cfg) else 0
    trunk = (counts["total"] - counts["mtp"] - cfg.n_layers * norms - routing - cfg.dim
              - outer * (1 if cfg.tie_embeddings else 2))
    # vocab x dim matrices here (a tied head reads the embedding, or its copy)
    matrices = embedding + embedding_copy + (head if not cfg.tie_embeddings else 0)
    split = (trunk * share + depth_split + outer * matrices) / (fsdp * tp)  # split over tp too
    whole_matrices = routing * share + (_mtp(cfg) * 2 * cfg.dim * cfg.dim if head else 0)
    # Norm weights: whole under tp.
    whole = ((cfg.n_layers * norms + routing) * share + depth_whole + (cfg.dim if head else 0)) / fsdp
    local = split + whole
    parameters = gradients = round(4 * local)
    depth_tensors = _mtp(cfg) * (7 + 2 + (2 if cfg.qk_norm else 0) + 1 + 3)  # a dense block, projection, 3 norms
    tensors = parameter_tensors(cfg) - depth_tensors - 2 - (0 if cfg.tie_embeddings else 1)  # the blocks' tensors
    tensors = (tensors * share + (depth_tensors if head else 0) + int(embedding) + int(embedding_copy)
               + int(head) * (1 if cfg.tie_embeddings else 2))  # head: norm (+ matrix)
    muon = (trunk * share / tp + depth_split / tp + whole_matrices) / fsdp if optimizer == "muon" else 0  # one moment
    stepped = local - (outer / (fsdp * tp) if embedding_copy else 0)
    optimizer_bytes = round(8 * stepped - 4 * muon + 4 * (tensors - int(embedding_copy)))
    stepping = _muon_step_bytes(cfg, fsdp, tp, ep) if optimizer == "muon" else 0
    head_matmul = outer if head else 0
    # Multi-token prediction's matmul weights a depth: a dense block's (split under tp) and the projection's.
    depth_matmul = 2 * cfg.dim * (cfg.n_heads + cfg.kv_heads) * cfg.head_dim + 3 * cfg.dim * cfg.hidden_dim \
        + 2 * cfg.dim * cfg.dim * tp
    depths_matmul = _mtp(cfg) * depth_matmul if head else 0
    if not bf16:
        weight_copies = 0
    elif fsdp > 1 or gather_dtype is not None:  # FSDP (every run of more than one process, over one shard too):
        # two blocks gathered in bf16 (all of the rank's when pipelining), the root's embedding and head
        every, largest = _block_weights(cfg, ep)
        gathered = (every * share + depths_matmul) if pp > 1 else 2 * max(largest, depth_matmul if _mtp(cfg) else 0)
        weight_copies = round(2 * (gathered + outer * matrices) / tp)
        if gather_dtype == "fp32":  # gathered in float32; and autocast's 16-bit copy of every block's matmul
            # weights, whole, which the backward pass keeps (as on one device): FSDP cannot free them
            weight_copies = round((4 * (gathered + outer * matrices) + 2 * (every * share + head_matmul
                                                                            + depths_matmul)) / tp)
    else:
        weight_copies = round(2 * (_block_weights(cfg)[0] * share + head_matmul + depths_matmul) / tp)
    tokens = micro_batch * seq_len / cp
    per_layer = activation_bytes_per_token(cfg, bf16, recompute, cp, gather_dtype) * tokens / tp
    activations = round(in_flight * held * per_layer)
    if _mtp(cfg) and head:  # each depth counted as a dense block over the rank's tokens (not measured: see above)
        activations += round(_mtp(cfg) * block_bytes_per_token(cfg, bf16, recompute, cp=cp, gather_dtype=gather_dtype)
                             * tokens / tp)
    window = getattr(cfg, "sliding_window", None)
    windowed = effective_window(window, seq_len) is not None
    documents = getattr(cfg, "document_mask", False)
    unwindowed = set(getattr(cfg, "full_attention_layers", None) or ()) if windowed else set()  # (blocks without it)
    full = len(unwindowed)
    if layers is None:  # the rank's blocks without the window, in the model's proportion; masks of every kind
        held_full, kinds = held * full / cfg.n_layers, {i in unwindowed for i in range(cfg.n_layers)}
    else:  # the masks its own blocks take (multi-token prediction's depths attend as the last block)
        held_full = sum(i in unwindowed for i in layers)
        kinds = {i in unwindowed for i in [*layers, *([cfg.n_layers - 1] if head and _mtp(cfg) else [])]}
    masked = documents or windowed
    if masked and cuda and cp == 1 and getattr(cfg, "attention_kernel", "sdpa") == "flex":
        masked = False  # (FlexAttention's block mask: a few bytes a block of 128 x 128 scores; grouped heads kept)
    if masked:  # one bias for all blocks: (batch, 1, T / cp, T) within documents, (1, 1, T, T) a sliding window's
        rows = tokens if documents else tokens / micro_batch
        # (With full_attention_layers and documents, two where the rank has blocks of both kinds: the
        # window's and the documents' alone; model/llama.py's attention_masks.)
        masks = int(windowed and False in kinds) + int(documents and (not windowed or True in kinds))
        activations += round(masks * in_flight * rows * seq_len * (2 if bf16 else 4))
    if masked and cuda and cfg.kv_heads < cfg.n_heads and recompute == "none":
        held_masked = held if documents else held - held_full  # (causal blocks: flash's)
        # On CUDA the masked kernel is given keys and values repeated to every query head, and saves
        # those: 4d a token in place of 4k (bf16), and under cp each of a rank's two query chunks its
        # own copy of the keys up to its end, (2 cp + 1) chunks of keys for 2 of queries.
        keys = cp + 0.5 if cp > 1 else 1
        repeated = (4 if bf16 else 8) * (cfg.dim * keys - cfg.kv_heads * cfg.head_dim * cp) * tokens / tp
        depths_masked = documents or cfg.n_layers - 1 not in (getattr(cfg, "full_attention_layers", None) or ())  # (the last block's)
        activations += round(in_flight * (held_masked + (_mtp(cfg) if head and depths_masked else 0)) * repeated)
    one_block = _largest_block_bytes_per_token(cfg, bf16, cp, gather_dtype) * tokens / tp
    if recompute == "full":
        activations += round(one_block)  # the block being rebuilt
    # Under context parallelism a block's backward holds the gradients of the whole sequence's keys
    # and values (and their copy in rank order, reduce-scattered: parallel/context.py), the chunks'
    # gradient of each slice of them passing through, and, when recomputed, the gathered keys and values
    # rebuilt: transient, but cp times the local keys' size, beside every saved activation.
    kv_bytes = (2 if bf16 else 4) * 2 * cfg.kv_heads * cfg.head_dim * tokens * cp / tp  # gathered K and V
    cp_backward = round(kv_bytes * (2 + (recompute != "none"))) if cp > 1 else 0
    vocab = cfg.vocab / tp
    rows = min(loss_chunk_tokens, tokens) if loss_chunk_tokens else tokens
    # Logits in the compute dtype, float32 copy, saved log-softmax and its gradient; a chunk's
    # logits and gradient, plus the stored hidden-state gradient, when chunked.
    loss = rows * vocab * ((2 if bf16 else 0) + 4 + 4 + 4)
    if loss_chunk_tokens:  # + the float32 weight gradient, and in bf16 a chunk's contribution before it is added
        loss += tokens * cfg.dim * (2 if bf16 else 4) + (6 if bf16 else 4) * vocab * cfg.dim
    loss = round(losses * (1 + _mtp(cfg)) * loss) if head else 0  # (each depth's loss: another head's)
    # Under a pipeline torch's stages keep FSDP from reducing until the step's last backward
    # (stage.py: no gradient sync, no resharding, on every other): each rank holds its stage's
    # gradients whole, in float32 (the reduce dtype), while its micro-batches run.
    # (whole: its own experts under expert parallelism, 1/ep of them, split over tp as the others)
    routed = moe_layers(cfg) * 3 * cfg.dim * cfg.expert_dim * cfg.moe_experts if moe_layers(cfg) else 0
    unsharded = ((trunk - routed * (1 - 1 / ep)) * share + depth_split + outer * matrices) / tp + whole * fsdp
    whole_gradients = round(4 * unsharded) if pp > 1 and fsdp > 1 else 0
    accumulating = whole_gradients or (gradients if micro_steps > 1 else 0)
    averaged = parameters if ema else 0
    peak = parameters + averaged + optimizer_bytes + weight_copies + max(activations + loss + accumulating + cp_backward,
                                                                         gradients + max(round(one_block), stepping))
    return MemoryEstimate(parameters, gradients, optimizer_bytes, weight_copies, activations, loss, round(peak),
                          averaged, whole_gradients)


def _muon_step_bytes(cfg: Any, fsdp: int, tp: int, ep: int) -> int:
    """Muon's working bytes in its step: 20 per entry of the largest matrix it orthogonalises
    (gathered whole when sharded) or of a rank's own stack of experts, 28 when FSDP alone splits
    the matrices and shares them out (see the module's docstring)."""
    matrices = [cfg.dim * cfg.n_heads * cfg.head_dim]
    if moe_layers(cfg) < cfg.n_layers:
        matrices.append(cfg.dim * cfg.hidden_dim)
    if moe_layers(cfg):
        matrices += [cfg.dim * cfg.expert_dim * max(cfg.moe_shared_experts, 1),
                     cfg.dim * cfg.expert_dim * cfg.moe_experts / max(ep, fsdp * tp)]
    return round((28 if fsdp > 1 and tp == 1 else 20) * max(matrices))


RECOMPUTE_ORDER = ("none", "selective", "full")


def choose_recompute(cfg: Any, seq_len: int, micro_batch: int, capacity: float, **layout: Any) -> tuple[str, MemoryEstimate]:
    """The least recomputation whose predicted peak fits in `capacity` bytes (recomputing
    costs up to a third more compute, so none is preferred whenever it fits); full when
    nothing fits, with its estimate, for the caller to report."""
    for mode in RECOMPUTE_ORDER:
        estimate = training_memory(cfg, seq_len, micro_batch, recompute=mode, **layout)
        if estimate.peak <= capacity:
            return mode, estimate
    return "full", estimate
