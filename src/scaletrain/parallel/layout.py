"""The process layout — sizes of pp x dp_replicate x dp_shard x cp x tp — and the checks that a
layout can split a model and batch evenly. Arithmetic, no torch: the planner searches layouts
with the same checks that train applies before any process group starts."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from scaletrain.config import ConfigError, ParallelConfig, RunConfig

# Outermost first, as init_device_mesh lays ranks out (row-major): tensor parallelism, the most
# communication-hungry, on neighbouring ranks (one node); pipeline stages farthest apart.
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class Layout:
    """Sizes of each mesh dimension, resolved against the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # a split of dp_shard: groups of ep neighbouring dp_shard ranks share out the experts

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on each dimension of the mesh."""
        coords = {}
        for dim, size in reversed(list(zip(DIMS, self.sizes))):
            rank, coords[dim] = divmod(rank, size)
        return coords

    def dp_rank(self, rank: int) -> int:
        """Which share of each step's global batch `rank` trains on: ranks that differ only in
        tp, cp or pp coordinates take the same sequences."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]


V_SHAPED = ("zbv_zero_bubble", "dualpipev")  # rank r runs stages r and 2 pp - 1 - r (the others loop: r, r + pp, ...)
# The schedules that split each backward pass into the inputs' gradients and, later, the weights'.
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def stage_ids(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages rank pp_rank runs: a loop (r, r + pp, ...) or, for V-shaped schedules, (r, 2 pp - 1 - r)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def stage_blocks(n_layers: int, num_stages: int, given: Sequence[int] | None = None) -> list[int]:
    """Blocks of each pipeline stage, first to last: `given` (parallel.pp_stage_blocks), else an
    even split (check_layout refuses a pipeline whose blocks do not divide without one given)."""
    if given:
        return list(given)
    if n_layers % num_stages:
        raise ValueError(f"{n_layers} blocks do not split evenly into {num_stages} stages; give the blocks of each")
    return [n_layers // num_stages] * num_stages


def stage_layers(blocks: Sequence[int]) -> list[range]:
    """The blocks' indices each stage holds, consecutive, from blocks per stage."""
    ends = [0, *itertools.accumulate(blocks)]
    return [range(start, end) for start, end in zip(ends, ends[1:])]


def ends_light_blocks(n_layers: int, num_stages: int) -> list[int]:
    """A split of n_layers blocks into num_stages that no even split reaches: every stage ceil(n /
    stages) blocks but the ends, which give up the surplus a block at a time, the last stage
    first (it runs the output head and the loss), then the first (the embedding, and under 1F1B
    the most micro-batches in flight), then the next inwards. Llama 3's 126 blocks on 16 stages:
    7, 8 x 14, 7, as Meta split them (Llama Team 2024, "The Llama 3 Herd of Models", section
    3.3.2)."""
    if n_layers < num_stages:
        raise ValueError(f"{n_layers} blocks do not fill {num_stages} stages")
    per_stage = -(-n_layers // num_stages)
    blocks = [per_stage] * num_stages
    order = [i for pair in zip(reversed(range(num_stages)), range(num_stages)) for i in pair]
    for i in itertools.islice(itertools.cycle(order), per_stage * num_stages - n_layers):
        blocks[i] -= 1
    return blocks


def _product_text(sizes: dict[str, int | str]) -> str:
    return " x ".join(f"{size}" for size in sizes.values())


def resolve_layout(cfg: ParallelConfig, world_size: int) -> Layout:
    """The layout cfg asks for on world_size processes, or a ConfigError saying which constraint fails."""
    names = "parallel.pp x dp_replicate x dp_shard x cp x tp"
    fixed = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
    if cfg.dp_shard == -1:
        if world_size % fixed:
            sizes = {"pp": cfg.pp, "dp_replicate": cfg.dp_replicate, "cp": cfg.cp, "tp": cfg.tp}
            raise ConfigError(f"parallel.pp x dp_replicate x cp x tp = {_product_text(sizes)} = {fixed} does not "
                              f"divide the {world_size} processes; with parallel.dp_shard = -1 the other dimensions "
                              "must divide the number of processes")
        return Layout(cfg.dp_replicate, world_size // fixed, cfg.tp, cfg.pp, cfg.cp, cfg.ep)
    layout = Layout(cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp, cfg.cp, cfg.ep)
    if layout.world_size != world_size:
        raise ConfigError(f"{names} = {' x '.join(map(str, layout.sizes))} = {layout.world_size}, but {world_size} "
                          "processes were started; their product must equal the number of processes (or set "
                          "parallel.dp_shard = -1 to use all remaining ones)")
    return layout


def check_layout(layout: Layout, cfg: RunConfig) -> None:
    """Refuse, before any process group starts, a layout that cannot split this model and batch
    evenly: each constraint in one sentence."""
    model, parallel, seq_len = cfg.model, cfg.parallel, cfg.data.seq_len
    if cfg.train.cuda_graphs and layout.world_size > 1:
        raise ConfigError(f"train.compile_mode = {cfg.train.compile_mode!r} replays CUDA graphs, which one process "
                          f"can do but {layout.world_size} sharing parameters and collectives cannot; use 'default' or "
                          "'max-autotune-no-cudagraphs'")
    for name, batch in cfg.batch_names():
        sequences = batch // seq_len
        if sequences % (layout.dp * cfg.train.micro_batch):
            # (a smaller micro-batch that splits every batch of the run, where the ranks take whole
            # sequences and no pipeline counts its micro-batches)
            per_rank = sequences // layout.dp if sequences % layout.dp == 0 and layout.pp == 1 else 0
            smaller = max((k for k in range(1, cfg.train.micro_batch) if per_rank and all(
                other // seq_len % (layout.dp * k) == 0 for _, other in cfg.batch_names())), default=None)
            raise ConfigError(f"{name} = {batch} holds {sequences} sequences, which do not split into "
                              f"{layout.dp} data-parallel ranks x train.micro_batch = {cfg.train.micro_batch}; use a "
                              f"multiple of {layout.dp * cfg.train.micro_batch * seq_len} tokens"
                              + (f", or train.micro_batch = {smaller} (the same batch, each rank's {per_rank} "
                                 f"sequences in micro-batches of {smaller})" if smaller else ""))
    if model.mtp_depth and layout.cp > 1 and 2 * model.mtp_depth >= seq_len:
        raise ConfigError(f"model.mtp_depth = {model.mtp_depth} would leave a context-parallel rank no position to "
                          f"predict; with parallel.cp = {layout.cp} it must be below data.seq_len / 2 = {seq_len // 2}")
    if layout.ep > 1:
        if not model.moe:
            raise ConfigError(f"parallel.ep = {layout.ep} splits the experts of a mixture of experts, but "
                              "model.moe_experts = 0 (a dense model); set parallel.ep = 1")
        if layout.dp_shard % layout.ep:
            raise ConfigError(f"parallel.ep = {layout.ep} does not divide the {layout.dp_shard} dp_shard ranks; expert "
                              "parallelism splits each group of ep of them")
        if model.moe_experts % layout.ep:
            raise ConfigError(f"model.moe_experts = {model.moe_experts} is not divisible by parallel.ep = "
                              f"{layout.ep}; each expert-parallel rank holds the same number of experts")
    if layout.cp > 1:
        if model.sliding_window is not None and model.sliding_window < seq_len:
            raise ConfigError(f"model.sliding_window = {model.sliding_window} with parallel.cp = {layout.cp}: context "
                              "parallelism's attention over chunks of the sequence takes no window; set "
                              "parallel.cp = 1, or a window of at least data.seq_len")
        if seq_len % (2 * layout.cp):
            raise ConfigError(f"data.seq_len = {seq_len} is not divisible by 2 x parallel.cp = {2 * layout.cp}; "
                              "context parallelism splits each sequence into 2 x cp equal chunks")
    if layout.tp > 1 and model.moe and model.moe_experts % (layout.ep * layout.tp):
        split = f"parallel.ep x tp = {layout.ep} x {layout.tp}" if layout.ep > 1 else f"parallel.tp = {layout.tp}"
        raise ConfigError(f"model.moe_experts = {model.moe_experts} is not divisible by {split}; tensor parallelism "
                          "splits a mixture's experts over its ranks (with expert parallelism's), each holding the "
                          "same number of them")
    if layout.tp > 1:
        local_seq = seq_len // layout.cp
        sizes = {"model.n_heads": model.n_heads, "model.n_kv_heads": model.kv_heads, "the MLP width (model.ffn_dim)":
                 model.hidden_dim, "model.vocab_size": model.vocab,
                 "data.seq_len" if layout.cp == 1 else "data.seq_len / parallel.cp": local_seq}
        for name, size in sizes.items():
            if size % layout.tp:
                raise ConfigError(f"{name} = {size} is not divisible by parallel.tp = {layout.tp}; tensor "
                                  "parallelism splits it evenly over the tp ranks")
    if layout.pp > 1:
        if cfg.train.compile and parallel.pp_schedule in ZERO_BUBBLE:
            raise ConfigError(f"parallel.pp_schedule = {parallel.pp_schedule!r} takes each block's gradients in two "
                              "passes, the inputs' and then the weights', which torch cannot do through a block that "
                              "train.compile = true compiled; set train.compile = false, or use 1f1b or "
                              "interleaved_1f1b")
        stages = layout.pp * parallel.stages_per_rank
        given = parallel.pp_stage_blocks
        if given and len(given) != stages:
            raise ConfigError(f"parallel.pp_stage_blocks lists {len(given)} stages, but parallel.pp = {layout.pp} x "
                              f"{parallel.stages_per_rank} stages per rank = {stages}; give one count per stage")
        if given and sum(given) != model.n_layers:
            raise ConfigError(f"parallel.pp_stage_blocks = {list(given)} holds {sum(given)} blocks, but the model has "
                              f"model.n_layers = {model.n_layers}; the counts must add up to it")
        if not given and model.n_layers < stages:
            raise ConfigError(f"model.n_layers = {model.n_layers} blocks are fewer than the {stages} pipeline stages "
                              f"(parallel.pp = {layout.pp} x {parallel.stages_per_rank} stages per rank), each of "
                              "which needs one; lower parallel.pp or the stages per rank")
        if not given and model.n_layers % stages:
            raise ConfigError(f"model.n_layers = {model.n_layers} is not divisible into {stages} pipeline stages "
                              f"(parallel.pp = {layout.pp} x {parallel.stages_per_rank} stages per rank); set "
                              "parallel.pp_stage_blocks to the blocks of each stage (e.g. "
                              f"{ends_light_blocks(model.n_layers, stages)}), or a pp (times the stages per rank) "
                              "that divides them")
        for name, batch in cfg.batch_names():
            microbatches = batch // seq_len // (layout.dp * cfg.train.micro_batch)
            need = None
            if parallel.pp_schedule in ("1f1b", "zbv_zero_bubble", "dualpipev") and microbatches < stages:
                need = f"at least the {stages} pipeline stages"
            elif parallel.pp_schedule not in ("gpipe", "1f1b") and microbatches % layout.pp:
                need = f"a multiple of parallel.pp = {layout.pp}"
            if need:
                raise ConfigError(f"parallel.pp_schedule = {parallel.pp_schedule!r} needs the micro-batches per step "
                                  f"on each pipeline ({name} = {batch}: {batch // seq_len} sequences / {layout.dp} "
                                  f"data-parallel ranks / train.micro_batch = {cfg.train.micro_batch} = "
                                  f"{microbatches}) to be {need}; lower train.micro_batch or raise {name}")
