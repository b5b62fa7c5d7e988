"""How long one training step takes, predicted from the model, the layout and the device —
arithmetic, no torch.

Per micro-batch, each device runs its share of the model: its stages' blocks (L/pp, or the
counts of parallel.pp_stage_blocks) and, on the last pipeline stage, the output head and
multi-token prediction's depths (a block, a projection and a pass through the head each, so
they add the same time at any pp), over micro_batch x seq_len / cp tokens, the matmuls split
over tp ranks. A pipeline goes at the pace of its slowest rank, the one timed: with equal
stages the last; with unequal ones whichever the blocks and the head make slowest (a mixture
with dense first blocks counted with each rank's own). Each rank then reduces and steps its own
parameters, and the slowest of those ends the step.

- Compute: matmul and attention FLOPs (model/flops.py: 6 N per token, attention counted over
  the causal half, the work FlashAttention does; see scores_computed for masked attention,
  over all of the scores with SDPA's mask and over a window's blocks with FlexAttention's) at
  `Efficiency.matmul` of the device's dense
  peak, plus the elementwise work (norms, rotary, SiLU, residual adds, casts) as memory traffic
  — `Efficiency.elementwise` bytes for each byte a block saves for its backward pass
  (plan/memory.py) — and the loss's logits traffic, at the device's memory bandwidth. The
  forward pass is a third of it, the backward two thirds. Recomputation adds the forward
  again: all of it for full recomputation, the elementwise part for selective (and in a mixture
  block, whose attention is compiled alone inside the eager selective region, the attention's
  projections too: inductor runs them as out= matmuls, which the policy cannot keep).
- Tensor parallelism (Megatron-style with sequence parallelism, Korthikanti et al. 2022,
  section 4.2.2): per block, an all-gather and a reduce-scatter of the micro-batch's bf16
  activations around attention and around the MLP, forward and backward (8 collectives, 12 with
  recomputation, selective included: it keeps matmul and attention outputs, not what the
  collectives return), and one pair at the output head; none overlapped with compute.
- Context parallelism as parallel/context.py does it: per block, keys and values all-gathered
  in the forward (again when recomputing), their gradients all-reduced in the backward, not
  overlapped; each query chunk attends to the keys up to its end under a bottom-right causal
  mask (flash on GPUs), timed as the causal half of the scores.
- FSDP (ZeRO-3, Rajbhandari et al. 2020) over dp_shard x cp: each block's parameters are
  all-gathered in bf16 for the forward and again for the backward, and gradients
  reduce-scattered in float32, for every micro-batch (under pipelining, once a step: the stages
  keep parameters gathered and reduce after the last micro-batch). FSDP prefetches the next
  block's parameters during the current block's compute: only what exceeds the forward (or
  backward) compute is exposed, plus the first block's gather. dp_replicate adds an all-reduce
  of each gradient shard across replicas, overlapped like the reduce-scatter.
- Pipeline parallelism: the step takes (micro-batches + bubble) x one stage's micro-batch
  time; the bubble is pp - 1 micro-batches for GPipe and 1F1B (Narayanan et al. 2021, section
  2.2), (pp - 1) / v with v stages a rank (interleaved 1F1B and breadth-first looping), a third
  of that for interleaved zero bubble (Qi et al. 2023, ZB-H1: (p-1)(F+B-W) against 1F1B's
  (p-1)(F+B+W), with the forward F, the inputs' gradients B and the weights' W alike), (pp - 1)
  / 6 for ZB-V (the last rank waits (pp - 1) forwards of a stage, half a rank's blocks, for
  its first; the paper's zero assumes steps that do not synchronise, and each step here ends
  with the gradients' norm) and (pp - 1) / 3 for DualPipeV (the DeepSeek-V3 report's bubble of
  DualPipe, (PP/2-1)(F&B+B-3W) with B the whole backward, 2024, table 2, with PP/2 = pp and
  the overlapped forward and backward F&B taking as long as both: torch runs them one after
  the other). Each is the makespan of torch's action lists for these schedules with F = B = W,
  which tests/test_plan.py simulates. Activations between stages cost one send each way per
  micro-batch and stage (the residual stream, bf16 under FSDP's bf16 parameters, which every
  pipeline has), counted as exposed.
- Expert parallelism (a mixture of experts, model/moe.py): per mixture block and micro-batch,
  the k routed copies of each token's bf16 activations go to their experts' ranks and back
  (GShard's dispatch and combine, Lepikhin et al. 2021), an all-to-all each way in the forward,
  again in the backward and in a recomputation (selective too), (ep - 1)/ep of them leaving each rank, not
  overlapped. FSDP gathers and reduces each rank's E/ep experts over the dp_shard/ep ranks
  holding them and the rest of the block over dp_shard. Expert matmuls are timed at the dense
  matmuls' efficiency, as the grouped GEMM model/moe.py uses on Hopper runs them (its per-expert
  fallback on other GPUs does not, on small experts); routing, permutations and imbalance
  between experts are not modelled beyond the bytes the block saves.
- The optimizer: fused AdamW reads the parameter, gradient and both moments and writes back
  three of them (float32): 28 bytes per local parameter, plus the gradient-norm pass and the
  zeroing of gradients (4 each), at memory bandwidth.

Collectives follow the ring algorithm: an all-gather or reduce-scatter of B bytes over n ranks
moves (n - 1)/n x B through each rank's link, an all-reduce twice that (Patarasuk and Yuan 2009),
at `Efficiency.link` of the link's bandwidth, plus `Efficiency.latency` each. A group lies
within one node when its ranks, laid out as the mesh lays them (parallel/layout.py: tp
innermost, then cp, dp_shard, dp_replicate, pp), span at most a node's devices; otherwise its
ring crosses nodes at the per-device network bandwidth.

The two free constants of Efficiency were fitted to two measurements of a plain Llama
(whole-model torch.compile, SDPA, fused AdamW, bf16) on one H200 with torch 2.11 (issue 6's
reference table): 126M parameters (width 768, 12 layers) at 501k tokens/s and 1.1B (width 2048,
16 layers) at 72.5k tokens/s, which the defaults reproduce. Everything else — other shapes,
devices, layouts, communication — is prediction; BENCHMARKS.md compares it with published
measurements at scale. Not modelled: kernel efficiency falling for narrow tensor-parallel
matmuls, communication slowing compute it overlaps with, stragglers, data loading.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from scaletrain.config import effective_window
from scaletrain.model.flops import (attention_flops_per_token, attention_linear_params, block_train_flops_per_token,
                                    moe_layers, mtp_train_flops_per_token, param_counts, train_flops_per_token)
from scaletrain.parallel.layout import V_SHAPED
from scaletrain.plan.hardware import Device
from scaletrain.plan.memory import (MemoryEstimate, activation_bytes_per_token, fsdp_dtype, pipeline_ranks,
                                    training_memory)



@dataclass(frozen=True)
class Efficiency:
    """What a device achieves of its datasheet figures (see the module's docstring)."""

    matmul: float = 0.719
    """Fraction of dense peak FLOP/s that matmuls and attention reach."""
    elementwise: float = 11.03
    """Bytes of memory traffic of elementwise work per byte a block saves for its backward pass."""
    link: float = 0.82
    """Fraction of a node's link bandwidth a collective's data moves at (NCCL's bus bandwidth:
    ~370 of NVLink 4's 450 GB/s each way on 8 H100s, nccl-tests issue 212)."""
    network: float = 0.92
    """The same across nodes (46-48 of 50 GB/s on 400 Gb/s InfiniBand, nccl-tests issue 290)."""
    latency: float = 20e-6
    """Seconds each collective costs beyond its bytes."""


@dataclass(frozen=True)
class PlanLayout:
    """A layout as the planner chooses it: mesh sizes, the pipeline schedule, the micro-batch
    and the recomputation."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    loss_chunk_tokens: int = 0
    ep: int = 1  # expert parallelism: a mixture's experts split over ep of the dp_shard ranks
    optimizer: str = "adamw"  # train.optimizer: Muon keeps one moment of the blocks' matrices, not two
    ema: bool = False  # train.ema_decay: a moving average of the weights is kept
    pp_stage_blocks: tuple[int, ...] | None = None  # blocks of each pipeline stage (None: an even split)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each data-parallel rank runs per step of `global_batch` sequences."""
        return global_batch // (self.dp * self.micro_batch)

    @classmethod
    def of(cls, cfg: Any, layout: Any) -> PlanLayout:
        """The layout a RunConfig `cfg` trains with on the resolved mesh sizes `layout`
        (parallel/layout.py's Layout)."""
        chunk = cfg.train.loss_chunk_tokens if layout.tp == 1 else 0  # train ignores it there
        return cls(layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp, layout.pp, cfg.train.micro_batch,
                   cfg.parallel.recompute, cfg.parallel.pp_schedule, cfg.parallel.stages_per_rank, chunk, layout.ep,
                   cfg.train.optimizer, cfg.train.ema_decay > 0,
                   tuple(cfg.parallel.pp_stage_blocks) if cfg.parallel.pp_stage_blocks and layout.pp > 1 else None)

    def memory_layout(self, global_batch: int) -> dict:
        """training_memory's keyword arguments for this layout (all but the recomputation)."""
        return dict(micro_steps=self.microbatches(global_batch), fsdp=self.dp_shard * self.cp, tp=self.tp, cp=self.cp,
                    pp=self.pp, pp_schedule=self.pp_schedule, pp_stages_per_rank=self.pp_stages_per_rank,
                    pp_stage_blocks=self.pp_stage_blocks,
                    loss_chunk_tokens=self.loss_chunk_tokens, ep=self.ep, optimizer=self.optimizer, ema=self.ema)

    def memory(self, cfg: Any, seq_len: int, global_batch: int, dtype: str = "bf16",
               fsdp_param_dtype: str = "auto") -> MemoryEstimate:
        """plan/memory.py's prediction of the bytes per device of this layout, computing in `dtype`
        ("bf16", "fp16", "fp32"), FSDP gathering parameters as parallel.fsdp_param_dtype says."""
        return training_memory(cfg, seq_len, self.micro_batch, bf16=dtype in ("bf16", "fp16"),
                               recompute=self.recompute, gather_dtype=fsdp_dtype(dtype, fsdp_param_dtype, self.world_size),
                               **self.memory_layout(global_batch))

    def to_dict(self) -> dict:
        """As JSON keeps it (the blocks of each stage a list), so that a plan read back compares equal."""
        out = asdict(self)
        out["pp_stage_blocks"] = list(self.pp_stage_blocks) if self.pp_stage_blocks else None
        return out


@dataclass
class StepTime:
    """Seconds of one optimizer step on the slowest device, by what they are spent on."""

    compute: float  # forward and backward of every micro-batch, recomputation included
    recompute: float  # of which recomputation
    tensor_parallel: float  # exposed communication, by kind
    context_parallel: float
    expert_parallel: float  # the mixture's all-to-alls
    data_parallel: float  # FSDP gathers and reductions, and replicas' all-reduce, beyond what overlaps
    pipeline_bubble: float
    pipeline_sends: float
    optimizer: float
    total: float
    tokens_per_s: float
    mfu: float  # model FLOPs (attention over the whole score matrix) / (time x peak x devices)
    mfu_causal: float  # attention counted over its causal half

    def to_dict(self) -> dict:
        return asdict(self)


def collective(kind: str, nbytes: float, ranks: int, bandwidth: float, efficiency: Efficiency) -> float:
    """Seconds of a ring all_gather / reduce_scatter / all_reduce of `nbytes` (the whole
    tensor) over `ranks` ranks whose links carry `bandwidth` bytes/s each way (achieved: see
    group_bandwidth)."""
    if ranks <= 1:
        return 0.0
    factor = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[kind]
    return factor * (ranks - 1) / ranks * nbytes / bandwidth + efficiency.latency


def group_bandwidth(layout: PlanLayout, dim: str, device: Device, gpus_per_node: int,
                    efficiency: Efficiency = Efficiency()) -> float:
    """Achieved per-device bandwidth of the groups along mesh dimension `dim` (or "fsdp":
    dp_shard x cp): the node's links when the group's ranks lie within a node, the network
    otherwise."""
    # ep: neighbouring dp_shard ranks; efsdp: those holding the same experts, ep apart.
    inner = {"tp": 1, "cp": layout.tp, "fsdp": layout.tp, "dp_shard": layout.tp * layout.cp,
             "ep": layout.tp * layout.cp, "efsdp": layout.tp * layout.cp,
             "dp_replicate": layout.tp * layout.cp * layout.dp_shard,
             "pp": layout.tp * layout.cp * layout.dp}[dim]
    size = {"tp": layout.tp, "cp": layout.cp, "fsdp": layout.dp_shard * layout.cp, "dp_shard": layout.dp_shard,
            "ep": layout.ep, "efsdp": layout.dp_shard, "dp_replicate": layout.dp_replicate, "pp": layout.pp}[dim]
    if inner * size <= gpus_per_node:
        return device.intra_node * efficiency.link
    return device.inter_node * efficiency.network


def bubble_microbatches(schedule: str, pp: int, stages_per_rank: int) -> float:
    """Idle micro-batch times a pipeline step adds (see the module's docstring)."""
    if pp == 1:
        return 0.0
    return {"gpipe": pp - 1, "1f1b": pp - 1, "interleaved_1f1b": (pp - 1) / stages_per_rank,
            "looped_bfs": (pp - 1) / stages_per_rank, "interleaved_zero_bubble": (pp - 1) / (3 * stages_per_rank),
            "zbv_zero_bubble": (pp - 1) / 6, "dualpipev": (pp - 1) / 3}[schedule]


FLEX_BLOCK = 128  # the side of FlexAttention's blocks of scores (model/llama.py's flex_block_mask)


def scores_computed(cfg: Any, seq_len: int, cp: int = 1) -> float:
    """The share of a block's seq_len x seq_len attention scores its kernel computes, on average
    over the blocks: half for causal attention (FlashAttention's lower triangle; under context
    parallelism each rank's chunks of it, masked or not). Masked attention (model.document_mask,
    or a sliding window shorter than the sequence) without context parallelism: all of them with
    SDPA's mask (its memory-efficient kernel computes every score and masks it); with
    attention_kernel = "flex" (FlexAttention, Dong et al. 2024) the blocks of FLEX_BLOCK x
    FLEX_BLOCK scores a window reaches, each query block's ceil((W - 1) / 128) + 1 at most, and
    within documents half (it skips more, by as much as the data's documents are shorter than the
    sequence: an upper bound). Blocks of model.full_attention_layers attend without the window."""
    window = getattr(cfg, "sliding_window", None)
    windowed = effective_window(window, seq_len) is not None
    documents = getattr(cfg, "document_mask", False)
    if cp > 1 or not (windowed or documents):
        return 0.5
    flex = getattr(cfg, "attention_kernel", "sdpa") == "flex"
    whole = 0.5 if flex or not documents else 1.0  # (a block without the window)
    if not windowed:
        return whole
    if flex:
        rows, reach = math.ceil(seq_len / FLEX_BLOCK), math.ceil((window - 1) / FLEX_BLOCK) + 1
        blocks = reach * (reach + 1) / 2 + (rows - reach) * reach if reach < rows else rows * (rows + 1) / 2
        within = min(0.5, blocks * FLEX_BLOCK ** 2 / seq_len ** 2)
    else:
        within = 1.0
    full = len(getattr(cfg, "full_attention_layers", None) or ())
    return ((cfg.n_layers - full) * within + full * whole) / cfg.n_layers


def step_time(cfg: Any, seq_len: int, global_batch: int, layout: PlanLayout, device: Device,
              efficiency: Efficiency = Efficiency(), gpus_per_node: int | None = None,
              dtype: str = "bf16") -> StepTime:
    """Predicted seconds of one step training model `cfg` (ModelConfig's fields) on
    `global_batch` sequences of `seq_len` tokens with `layout` on devices `device`, computing in
    `dtype`: "bf16", "fp16" (at the catalog's 16-bit peak, as bf16), "tf32" or "fp32"."""
    gpus_per_node = gpus_per_node or device.gpus_per_node
    lay = layout
    rate = "bf16" if dtype == "fp16" else dtype  # (the catalog's 16-bit peak: float16's where bf16 is missing)
    peak = device.peak[rate] * efficiency.matmul
    bf16 = dtype in ("bf16", "fp16")  # 16-bit activations
    act_bytes = 2 if bf16 else 4  # (a parameter as FSDP gathers it, too)
    if global_batch % (lay.dp * lay.micro_batch):
        raise ValueError(f"{global_batch} sequences do not split into {lay.dp} data-parallel ranks x micro-batches "
                         f"of {lay.micro_batch}")
    micro_steps = lay.microbatches(global_batch)
    tokens = lay.micro_batch * seq_len / lay.cp  # per device and micro-batch
    d, kv_width = cfg.dim, cfg.kv_heads * cfg.head_dim
    bandwidth = device.memory_bandwidth
    head_matmul = cfg.vocab * cfg.dim
    again = lay.recompute != "none"
    activations = tokens * d * act_bytes  # the norms' outputs, gathered; the projections' outputs, scattered
    tp_bw = group_bandwidth(lay, "tp", device, gpus_per_node, efficiency)
    half_kv = lay.micro_batch * seq_len * kv_width / lay.tp * act_bytes
    cp_bw = group_bandwidth(lay, "cp", device, gpus_per_node, efficiency)
    pp_bw = group_bandwidth(lay, "pp", device, gpus_per_node, efficiency) if lay.pp > 1 else 0.0
    routed = tokens / lay.tp * getattr(cfg, "moe_top_k", 0) * d * act_bytes
    ep_bw = group_bandwidth(lay, "ep", device, gpus_per_node, efficiency)

    scores = scores_computed(cfg, seq_len, lay.cp)

    def one_microbatch(own: Any, layers: float, last: bool) -> tuple[float, ...]:
        """(forward, backward, recomputation, tp, cp, ep, sends) of one micro-batch on a rank of
        `layers` blocks (as `own`'s are: a mixture's share of mixture blocks) that runs the last
        stage (`last`: the output head and multi-token prediction's depths, a block, a projection
        and another pass through the head each) or not."""
        beyond_causal = (scores - 0.5) * attention_flops_per_token(own, seq_len)  # (masked attention's kernels)
        block_flops = block_train_flops_per_token(own, seq_len, causal=True) + beyond_causal
        elementwise = efficiency.elementwise * activation_bytes_per_token(own, bf16, "none")  # per token and block
        depths = (getattr(cfg, "mtp_depth", 0) or 0) if last else 0
        mtp_flops = mtp_train_flops_per_token(cfg, seq_len, causal=True) + depths * beyond_causal if last else 0
        # -- compute ------------------------------------------------------------------------------
        blocks_matmul = tokens * (layers * block_flops + mtp_flops) / lay.tp / peak
        blocks_elementwise = tokens * (layers + depths) * elementwise / lay.tp / bandwidth
        head = tokens * (6 * head_matmul / lay.tp / peak
                         + (1 + depths) * cfg.vocab / lay.tp * (act_bytes + 12) / bandwidth) if last else 0.0
        recompute = {"none": 0.0, "selective": blocks_elementwise / 3,
                     "full": (blocks_matmul + blocks_elementwise) / 3}[lay.recompute]
        mixtures = moe_layers(own) * layers / cfg.n_layers  # (the rank's mixture blocks)
        if lay.recompute == "selective" and mixtures:
            # A mixture block compiles its attention alone, inside the block's eager selective
            # region, where inductor's matmuls run as out= variants the policy cannot keep: the
            # attention's projections are computed again (parallel/recompute.py; under train.compile,
            # which planned configs set).
            recompute += tokens * mixtures * 2 * attention_linear_params(own) / lay.tp / peak
        forward = (blocks_matmul + blocks_elementwise + head) / 3
        backward = 2 * forward + recompute
        # -- communication inside the micro-batch -------------------------------------------------
        # Recomputation (selective too: it keeps matmul and attention outputs, not collectives'
        # results) runs each block's forward collectives again.
        tp_collectives = (layers + depths) * (12 if again else 8) + (2 * (1 + depths) if last else 0)  # (+ the head's)
        tp_time = tp_collectives * collective("all_gather", activations, lay.tp, tp_bw, efficiency)
        # Keys, then values, of whole sequences: all-gathered forward, their gradients reduce-scattered
        # backward (each rank receiving its own chunks' sums).
        cp_time = 2 * (layers + depths) * ((2 if again else 1) * collective("all_gather", half_kv, lay.cp, cp_bw, efficiency)
                                           + collective("reduce_scatter", half_kv, lay.cp, cp_bw, efficiency))
        sends = 0.0
        if lay.pp > 1:  # the residual stream (FSDP's parameters' dtype), out and back, at each of the rank's stages
            sends = 2 * lay.pp_stages_per_rank * (tokens * d * act_bytes / lay.tp / pp_bw + efficiency.latency)
        # Each routed copy of a token's activations to its expert's rank and back, forward and backward,
        # over the ep x tp ranks the experts split over (a tp rank routes its part of the sequences).
        ep_time = 0.0
        split = lay.ep * lay.tp
        if split > 1 and mixtures:
            all_to_alls = mixtures * (6 if again else 4)
            ep_time = all_to_alls * ((split - 1) / split * routed / ep_bw + efficiency.latency)
        return forward, backward, recompute, tp_time, cp_time, ep_time, sends

    # The pipeline's pace is its slowest rank's micro-batch: with stages of equal blocks the last's
    # (the head's). Then each rank's gradients are reduced and stepped: the step ends with the slowest.
    shard = lay.dp_shard * lay.cp
    fsdp_bw = group_bandwidth(lay, "fsdp", device, gpus_per_node, efficiency)
    efsdp_bw = group_bandwidth(lay, "efsdp", device, gpus_per_node, efficiency)
    rep_bw = group_bandwidth(lay, "dp_replicate", device, gpus_per_node, efficiency)

    def reduce_and_step(own: Any, layers: float, first: bool, last: bool, forward: float,
                        backward: float) -> tuple[float, float]:
        """(exposed data-parallel communication, optimizer) of a rank of `layers` blocks."""
        stage_params = _stage_parameters(own, lay.pp, layers, first, last) / lay.tp  # one tp rank's, unsharded
        experts = _routed_expert_parameters(own) * layers / cfg.n_layers / lay.tp  # gathered 1/ep over dp_shard / ep
        gather = collective("all_gather", (stage_params - experts) * act_bytes, shard, fsdp_bw, efficiency)
        reduce = collective("reduce_scatter", (stage_params - experts) * 4, shard, fsdp_bw, efficiency)
        if experts:
            gather += collective("all_gather", experts / lay.ep * act_bytes, shard // lay.ep, efsdp_bw, efficiency)
            reduce += collective("reduce_scatter", experts / lay.ep * 4, shard // lay.ep, efsdp_bw, efficiency)
        reduce += collective("all_reduce", stage_params * 4 / shard, lay.dp_replicate, rep_bw, efficiency)
        if lay.pp == 1:  # gathered for each micro-batch's forward and backward, reduced after each
            first_block = gather / max(1.0, layers)
            per_micro = max(0.0, gather - forward) + max(0.0, gather + reduce - backward) + first_block
            data_parallel = micro_steps * per_micro
        else:  # gathered once (overlapping the first micro-batch), reduced after the last
            data_parallel = max(0.0, gather - forward) + max(0.0, reduce - backward)
        return data_parallel, 36 * stage_params / shard / bandwidth

    # (each rank's model, blocks, and whether it runs the first stage and the last)
    ranks = [(own, held["blocks"], held["embedding"], held["head"])
             for own, held in pipeline_ranks(cfg, lay.pp, micro_steps, lay.pp_schedule, lay.pp_stages_per_rank,
                                             lay.pp_stage_blocks)] if lay.pp > 1 else [(cfg, cfg.n_layers, True, True)]
    timed = [one_microbatch(own, layers, last) for own, layers, _, last in ranks]
    paces = [t[0] + t[1] + sum(t[3:]) for t in timed]
    slowest = max(range(len(ranks)), key=lambda i: paces[i])
    forward, backward, recompute, tp_time, cp_time, ep_time, sends = timed[slowest]
    microbatch = paces[slowest]
    data_parallel, optimizer = max((reduce_and_step(*rank, *t[:2]) for rank, t in zip(ranks, timed)), key=sum)

    bubble = bubble_microbatches(lay.pp_schedule, lay.pp, lay.pp_stages_per_rank) * microbatch
    copies = 0.0
    # The embedding's copies sum their float32 gradients (within rank 0 under the V-shaped schedules: no link).
    if lay.pp > 1 and (cfg.tie_embeddings or getattr(cfg, "mtp_depth", 0)) and lay.pp_schedule not in V_SHAPED:
        copies = collective("all_reduce", cfg.vocab * d * 4 / lay.tp / shard, 2, pp_bw, efficiency)
    total = micro_steps * microbatch + bubble + data_parallel + optimizer + copies

    step_tokens = global_batch * seq_len
    world = lay.world_size
    mfu = step_tokens * train_flops_per_token(cfg, seq_len) / (total * device.peak[rate] * world)
    mfu_causal = step_tokens * train_flops_per_token(cfg, seq_len, causal=True) / (total * device.peak[rate] * world)
    return StepTime(compute=micro_steps * (forward + backward), recompute=micro_steps * recompute,
                    tensor_parallel=micro_steps * tp_time, context_parallel=micro_steps * cp_time,
                    expert_parallel=micro_steps * ep_time,
                    data_parallel=data_parallel, pipeline_bubble=bubble, pipeline_sends=micro_steps * sends + copies,
                    optimizer=optimizer, total=total, tokens_per_s=step_tokens / total, mfu=mfu,
                    mfu_causal=mfu_causal)


def _routed_expert_parameters(cfg: Any) -> float:
    """The routed experts' weights, all blocks (0 for a dense model)."""
    return moe_layers(cfg) * cfg.moe_experts * 3 * cfg.dim * cfg.expert_dim if moe_layers(cfg) else 0


def _stage_parameters(cfg: Any, pp: int, layers: float, first: bool, last: bool) -> float:
    """Parameters of a pipeline rank of `layers` blocks (every expert of a mixture), with the
    embedding where it runs the first stage and, where it runs the last, the output head, final
    norm, multi-token prediction's depths and the copy of the embedding that stage reads (for a
    tied head, or depths); without pipelining one embedding, tied to the head or beside it."""
    counts = param_counts(cfg)
    blocks = counts["total"] - counts["mtp"] - cfg.vocab * cfg.dim * (1 if cfg.tie_embeddings else 2) - cfg.dim
    if pp == 1:
        matrices = 1 if cfg.tie_embeddings else 2
    else:
        matrices = int(first) + int(last) * (int(not cfg.tie_embeddings) + int(cfg.tie_embeddings or counts["mtp"] > 0))
    return blocks * layers / cfg.n_layers + (counts["mtp"] + cfg.dim if last else 0) + cfg.vocab * cfg.dim * matrices
