"""The parallel layout for a model on given hardware, chosen by search — arithmetic, no torch.

The candidates are layouts train accepts (each passes parallel/layout.py's checks: tp
dividing the heads, key/value heads, MLP width, vocabulary and the sequence, enough
micro-batches for the schedule): tp within a node (over a node's links, as torchtitan and
Megatron-LM keep it), pp under 1F1B or interleaved 1F1B with two or four stages a rank
(micro-batches at least pp, a multiple of it when interleaved), the blocks split evenly over
the stages or, where they do not divide, with lighter first and last stages
(parallel.pp_stage_blocks, as Llama 3 split its 126 blocks on 16 stages), and also split so
that the head's rank does no more work than the others (the head weighed by its FLOPs in
blocks' worth; Megatron-LM's account-for-loss option counts the loss as one block more), the
data-parallel ranks split every way between FSDP shards and replicas, micro-batches of 1 to
64 sequences (powers of two), and for each the least recomputation (none, selective, full;
then chunking the loss) whose predicted peak fits in the usable memory. Not searched: GPipe
and breadth-first looping, which hold every micro-batch's activations for the bubble of 1F1B
and interleaving; the zero-bubble schedules, since torch cannot split a compiled block's
backward pass into the inputs' and the weights' halves as they do (the configs the planner
writes compile the blocks, and the speed of uncompiled ones is not modelled); and context
parallelism unless asked for (`allow_cp`) or needed: where no layout without it fits, as for
sequences of hundreds of thousands of tokens whose activations no recomputation brings within
a device, or for fewer sequences a step than the other layouts need on so many devices (Llama
3's 128K stage: 128 sequences on 16,384 GPUs). parallel/context.py's attention reaches the
flash kernel on GPUs through SDPA's bottom-right causal mask, but that path has not been
measured on a GPU here, and its keys' and values' all-gathers are timed as if nothing
overlapped them. The fastest by plan/timing.py wins; among layouts within 1% of it, the
simplest (fewest kinds of parallelism, smaller tp, no recomputation), since the difference is
below what the model can tell apart. Each layout is timed and sized in what train computes it
in (layout_dtype): on a device without bfloat16 (V100, T4), 16-bit compute is float16, which
train offers on data-parallel layouts of a dense model only; the others are timed in float32
there (left out when train.dtype = float16 is asked for).

The global batch is either fixed (a config's, which every layout must split evenly) or a
target in sequences: each layout takes the multiple of its data-parallel ranks x micro-batch
nearest it, with micro-batches no larger than the target allows (so that a large micro-batch
cannot grow the batch beyond the rule's). Nor can many data-parallel ranks, of one sequence each:
layouts whose batch exceeds the target by more than MAX_BATCH_GROWTH are left out while any
layout keeps within it (on 4,096 devices a rule's 527 sequences would otherwise have become
4,096 under plain FSDP, faster per token than tp 8 but 7.8x the batch the learning rate was
chosen for, which takes more tokens to reach the same loss: McCandlish et al. 2018); where
none does, the layouts of the smallest batch compete.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from scaletrain.config import effective_window, float16_problems, float8_problem
from scaletrain.errors import UserError
from scaletrain.model.flops import block_train_flops_per_token, moe_layers, mtp_train_flops_per_token
from scaletrain.parallel.layout import ends_light_blocks, stage_blocks, stage_ids
from scaletrain.plan.hardware import Device
from scaletrain.plan.memory import MemoryEstimate
from scaletrain.plan.timing import Efficiency, PlanLayout, StepTime, step_time

USABLE_MEMORY = 0.9  # of the device's memory: the rest for the CUDA context, NCCL and the allocator's fragmentation
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
RECOMPUTE = ("none", "selective", "full")
LOSS_CHUNK = 8192  # tokens at a time, when the whole micro-batch's logits do not fit
MAX_BATCH_GROWTH = 2.0  # a searched batch's largest multiple of the rule's (see the module's docstring)


class PlanError(UserError, ValueError):
    """Nothing fits, or the request cannot be planned; the message says what would."""


@dataclass
class Candidate:
    layout: PlanLayout
    global_batch: int  # sequences per step
    memory: MemoryEstimate
    time: StepTime
    dtype: str = "bf16"  # what it computes in (layout_dtype)

    @property
    def seconds_per_token(self) -> float:
        return 1 / self.time.tokens_per_s

    @property
    def complexity(self) -> tuple:
        lay = self.layout
        kinds = (lay.tp > 1) + (lay.cp > 1) + (lay.pp > 1) + (lay.ep > 1) + (lay.dp_replicate > 1 and lay.dp_shard > 1)
        return (kinds, RECOMPUTE.index(lay.recompute), lay.loss_chunk_tokens > 0, lay.tp, lay.pp, lay.cp, lay.ep,
                lay.pp_stages_per_rank, lay.pp_stage_blocks is not None, -lay.micro_batch)

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "global_batch": self.global_batch,
                "microbatches": self.layout.microbatches(self.global_batch), "memory": self.memory.as_dict(),
                "time": self.time.to_dict(), "dtype": self.dtype}


def divisors(n: int) -> list[int]:
    """n's divisors, ascending (in sqrt(n) steps: a count of a billion devices is refused, not searched for a day)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def _tp_sizes(cfg: Any, seq_len: int, cp: int, gpus_per_node: int) -> list[int]:
    sizes = (cfg.n_heads, cfg.kv_heads, cfg.hidden_dim, cfg.vocab, seq_len // cp,
             *((cfg.moe_experts,) if moe_layers(cfg) else ()))  # (a mixture's experts split over tp too)
    return [tp for tp in divisors(gpus_per_node) if all(size % tp == 0 for size in sizes)]


def _data_parallel(cfg: Any, dp: int, tp: int = 1) -> list[tuple[int, int]]:
    """(replicas, ep) choices for `dp` data-parallel ranks: every split into replicas x FSDP
    shards and, for a mixture, every expert-parallel group of shards that, with the tp ranks,
    divides its experts."""
    return [(replicate, ep) for replicate in divisors(dp)
            for ep in (divisors(dp // replicate) if moe_layers(cfg) else [1])
            if not moe_layers(cfg) or cfg.moe_experts % (ep * tp) == 0]


def _pipelines(cfg: Any, seq_len: int, world: int) -> list[tuple[int, str, int, tuple[int, ...] | None]]:
    """(pp, schedule, stages per rank, blocks of each stage) choices: one stage a rank under 1F1B,
    two or four interleaved; the blocks split evenly where they divide, else with lighter ends
    (parallel/layout.py's ends_light_blocks), None standing for the even split; and, where it
    differs, the split that balances the ranks with the head counted on the last
    (head_balanced_blocks)."""
    out = [(1, "1f1b", 1, None)]
    head = _head_blocks(cfg, seq_len)
    for pp in divisors(world):
        for schedule, stages in (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)):
            if 1 < pp and stages * pp <= cfg.n_layers:
                even = cfg.n_layers % (stages * pp) == 0
                base = None if even else tuple(ends_light_blocks(cfg.n_layers, stages * pp))
                out.append((pp, schedule, stages, base))
                balanced = tuple(head_balanced_blocks(cfg.n_layers, pp, stages, schedule, head))
                if balanced != (base or tuple(stage_blocks(cfg.n_layers, stages * pp))):
                    out.append((pp, schedule, stages, balanced))
    return out


def _head_blocks(cfg: Any, seq_len: int) -> float:
    """The work of the last stage's own part — the output head and loss, multi-token
    prediction's depths — in blocks' worth of matmul FLOPs."""
    depths = mtp_train_flops_per_token(cfg, seq_len, causal=True)  # (their passes through the head too)
    return (6 * cfg.vocab * cfg.dim + depths) / block_train_flops_per_token(cfg, seq_len, causal=True)


def head_balanced_blocks(n_layers: int, pp: int, stages_per_rank: int, schedule: str, head: float) -> list[int]:
    """Blocks of each stage that balance the pipeline ranks' work, the rank of the last stage
    counting `head` blocks more for the output head (its FLOPs in blocks' worth, where Megatron-LM's
    account-for-loss option counts one block): from the lighter-ends split, a block moved at a time from a stage of the busiest
    rank to one of the least busy (the later rank on a tie: the first holds the most micro-batches
    in flight), while that lowers the busiest's work."""
    stages = pp * stages_per_rank
    blocks = ends_light_blocks(n_layers, stages)
    owner = {stage: rank for rank in range(pp) for stage in stage_ids(schedule, rank, pp, stages_per_rank)}
    while True:
        work = [float(sum(blocks[s] for s in owner if owner[s] == rank)) for rank in range(pp)]
        work[owner[stages - 1]] += head
        busiest = max(range(pp), key=lambda r: work[r])
        idlest = min(reversed(range(pp)), key=lambda r: work[r])
        giver = max((s for s in owner if owner[s] == busiest and blocks[s] > 1),  # (the head's stage on a tie)
                    key=lambda s: (blocks[s], s == stages - 1), default=None)
        if giver is None or work[idlest] + 1 >= work[busiest]:
            return blocks
        taker = min((s for s in owner if owner[s] == idlest), key=lambda s: blocks[s])
        blocks[giver] -= 1
        blocks[taker] += 1


def _batch(target: int, dp: int, micro_batch: int, fixed: bool) -> int | None:
    unit = dp * micro_batch
    if fixed:
        return target if target % unit == 0 else None
    if unit > target and micro_batch > 1:  # more sequences than the target wants: only one a micro-batch
        return None
    return max(unit, round(target / unit) * unit)


def _splits(batch: int, dp: int, micro_batch: int, pp: int, stages: int) -> bool:
    """Whether `batch` sequences split into whole micro-batches on every data-parallel rank, as
    many as the pipeline schedule needs."""
    if batch % (dp * micro_batch):
        return False
    steps = batch // (dp * micro_batch)
    return pp == 1 or (steps >= pp and (stages == 1 or steps % pp == 0))  # (what train's check asks)


def layout_dtype(cfg: Any, layout: PlanLayout, device: Device, dtype: str, float8: bool = False) -> str | None:
    """What `layout` computes in on `device`, as train resolves train.dtype: `dtype` is "bf16"
    (auto or bfloat16: 16-bit), "fp16" (float16) or "fp32". 16-bit compute on a device without
    bfloat16 is float16 ("fp16": timed at the catalog's 16-bit peak, its residual stream float32
    between blocks), whose loss scaling reaches data-parallel layouts of a dense model only
    (config.float16_problems): elsewhere auto computes in float32 ("fp32") and float16 is
    refused (None). `float8`: train.float8, which float16 does not reach either, nor tensor
    parallelism (config.float8_problem: refused, None)."""
    if float8 and float8_problem(True, device.name, layout.tp) is not None:
        return None
    if dtype == "fp32" or (dtype == "bf16" and device.bf16):
        return dtype
    if float16_problems(tp=layout.tp, cp=layout.cp, pp=layout.pp, moe=bool(moe_layers(cfg)),
                        float8=float8, loss_chunk_tokens=layout.loss_chunk_tokens):
        return None if dtype == "fp16" else "fp32"
    return "fp16"


def candidates(cfg: Any, seq_len: int, batch: int, world: int, device: Device, *, fixed_batch: bool = False,
               gpus_per_node: int | None = None, efficiency: Efficiency = Efficiency(), dtype: str = "bf16",
               usable: float = USABLE_MEMORY, allow_cp: bool = False, optimizer: str = "adamw",
               ramp: tuple[int, ...] = (), ema: bool = False,
               float8: bool = False) -> tuple[list[Candidate], Candidate | None]:
    """Every layout of `world` devices that fits (each with its least recomputation), and the
    one closest to fitting when none does (for the message); `optimizer` is train.optimizer, `ema`
    whether train.ema_decay keeps a moving average of the weights.
    The layouts must also split each of `ramp`'s batches (sequences: train.batch_ramp's)."""
    gpus_per_node = gpus_per_node or device.gpus_per_node
    capacity = usable * device.memory
    fits: list[Candidate] = []
    closest: Candidate | None = None
    window = getattr(cfg, "sliding_window", None)  # (context parallelism takes no window: train refuses it)
    cps = [cp for cp in divisors(world) if cp == 1 or (allow_cp and cp <= 64 and seq_len % (2 * cp) == 0
                                                       and effective_window(window, seq_len) is None)]
    for cp in cps:
        for tp in _tp_sizes(cfg, seq_len, cp, min(gpus_per_node, world)):
            if world % (cp * tp):
                continue
            for pp, schedule, stages, blocks in _pipelines(cfg, seq_len, world // (cp * tp)):
                dp = world // (cp * tp * pp)
                for replicate, ep in _data_parallel(cfg, dp, tp):
                    for micro_batch in MICRO_BATCHES:
                        global_batch = _batch(batch, dp, micro_batch, fixed_batch)
                        if global_batch is None:
                            continue
                        if not all(_splits(b, dp, micro_batch, pp, stages) for b in (global_batch, *ramp)):
                            continue
                        chunks = (0, LOSS_CHUNK) if tp == 1 and micro_batch * seq_len // cp > LOSS_CHUNK \
                            else (0,)
                        for recompute in RECOMPUTE:
                            layout = memory = own = None
                            for chunk in chunks:
                                trial = PlanLayout(replicate, dp // replicate, tp, cp, pp, micro_batch, recompute,
                                                   schedule, stages, chunk, ep, optimizer, ema, blocks)
                                computes = layout_dtype(cfg, trial, device, dtype, float8)
                                if computes is None or (own not in (None, computes) and recompute != RECOMPUTE[-1]):
                                    # (float16 refuses it; or the chunked loss would leave float16 for float32,
                                    # which more recomputation in float16 may beat: tried last)
                                    continue
                                layout, own = trial, computes
                                memory = layout.memory(cfg, seq_len, global_batch, own)
                                if memory.peak <= capacity:
                                    break
                            if layout is None:
                                break  # (none under float16: nor with more recomputation)
                            time = step_time(cfg, seq_len, global_batch, layout, device, efficiency,
                                             gpus_per_node, own)
                            candidate = Candidate(layout, global_batch, memory, time, own)
                            if memory.peak <= capacity:
                                fits.append(candidate)
                                break
                            if closest is None or memory.peak < closest.memory.peak:
                                closest = candidate
    return fits, closest


def search(cfg: Any, seq_len: int, batch: int, world: int, device: Device, *, fixed_batch: bool = False,
           gpus_per_node: int | None = None, efficiency: Efficiency = Efficiency(), dtype: str = "bf16",
           usable: float = USABLE_MEMORY, top: int = 5, allow_cp: bool | None = None,
           optimizer: str = "adamw", ramp: tuple[int, ...] = (), ema: bool = False,
           float8: bool = False) -> list[Candidate]:
    """The best `top` layouts, best first (see the module's docstring); PlanError when none fits.
    `allow_cp`: search context parallelism too (True), never (False), or only when no layout
    without it fits (None): in memory, or splitting the batch (few sequences on many devices)."""
    searching = dict(fixed_batch=fixed_batch, gpus_per_node=gpus_per_node, efficiency=efficiency, dtype=dtype,
                     usable=usable, optimizer=optimizer, ramp=ramp, ema=ema, float8=float8)
    fits, closest = candidates(cfg, seq_len, batch, world, device, allow_cp=bool(allow_cp), **searching)
    if not fits and allow_cp is None:  # (too little memory, or too few sequences for the devices without it)
        fits, split = candidates(cfg, seq_len, batch, world, device, allow_cp=True, **searching)
        closest = split if closest is None or (split is not None and split.memory.peak < closest.memory.peak) \
            else closest
    if not fits:
        cp_too = ", or let the planner split sequences over devices (context parallelism)" if allow_cp is False else ""
        float16 = ("; train.dtype = float16 leaves out tensor, context and pipeline parallelism and the chunked loss "
                   "(its loss scaling does not reach them): train.dtype = auto would train those in float32"
                   if dtype == "fp16" else "")
        if closest is None:
            batches = f"a batch of {batch}" if not ramp else f"batches of {', '.join(map(str, (*ramp, batch)))}"
            raise PlanError(f"no layout of {world} devices splits this model and {batches} sequences of "
                            f"{seq_len} tokens evenly; use a number of devices that divides the batch"
                            + ("es (train.batch_ramp's too)" if ramp else " (or let the planner choose the batch)")
                            + cp_too + float16)
        raise PlanError(f"no layout fits on {world} x {device.name}: the least memory any needs is "
                        f"{closest.memory.peak / 1e9:.1f} GB per device ({describe(closest.layout)}), against "
                        f"{usable * device.memory / 1e9:.1f} GB usable; use more devices, devices with more memory, a "
                        "shorter sequence or a smaller model" + cp_too + float16)
    if not fixed_batch:  # (a batch far above the rule's only where every layout's is)
        within = [c for c in fits if c.global_batch <= MAX_BATCH_GROWTH * batch]
        fits = within or [c for c in fits if c.global_batch == min(c.global_batch for c in fits)]
    best = min(c.seconds_per_token for c in fits)
    near = sorted((c for c in fits if c.seconds_per_token <= 1.01 * best), key=lambda c: c.complexity)
    rest = sorted((c for c in fits if c.seconds_per_token > 1.01 * best), key=lambda c: c.seconds_per_token)
    ranked, seen = [], set()
    for c in near + rest:  # one entry per mesh shape and schedule: its best micro-batch and recomputation
        key = (c.layout.dp_replicate, c.layout.dp_shard, c.layout.tp, c.layout.cp, c.layout.pp, c.layout.ep,
               c.layout.pp_schedule)
        if key not in seen:
            seen.add(key)
            ranked.append(c)
    return ranked[:top]


def blocks_text(blocks: tuple[int, ...]) -> str:
    """'7, 8 x 14, 7': blocks per stage, runs of a count written once."""
    return ", ".join(f"{count}" if len(run) == 1 else f"{count} x {len(run)}"
                     for count, run in ((count, list(run)) for count, run in itertools.groupby(blocks)))


def describe(layout: PlanLayout) -> str:
    """'dp 4 (fsdp 4) x tp 2, micro-batch 2, selective recompute' — the sizes above 1."""
    lay = layout
    if lay.dp_replicate > 1 and lay.dp_shard > 1:
        dp = f"dp {lay.dp} (replicate {lay.dp_replicate} x fsdp {lay.dp_shard})"
    elif lay.dp_replicate > 1 and lay.cp > 1:  # (FSDP shards over dp_shard x cp: here over cp's ranks alone)
        dp = f"dp {lay.dp} (replicated, fsdp over cp)"
    elif lay.dp_replicate > 1:
        dp = f"dp {lay.dp} (replicated)"
    else:
        dp = f"dp {lay.dp} (fsdp)" if lay.dp > 1 else "dp 1"
    parts = [dp] + [f"{name} {size}" for name, size in (("ep", lay.ep), ("tp", lay.tp), ("cp", lay.cp), ("pp", lay.pp))
                    if size > 1]
    text = " x ".join(parts)
    if lay.pp > 1:
        text += f" ({lay.pp_schedule}" + (f", {lay.pp_stages_per_rank} stages a rank" if lay.pp_stages_per_rank > 1
                                           else "")
        text += (f", blocks {blocks_text(lay.pp_stage_blocks)})" if lay.pp_stage_blocks else ")")
    text += f", micro-batch {lay.micro_batch}"
    if lay.recompute != "none":
        text += f", {lay.recompute} recompute"
    if lay.loss_chunk_tokens:
        text += f", loss in chunks of {lay.loss_chunk_tokens} tokens"
    return text
