"""The training loop: one process, one device. It owns the loop; the model and data know nothing of it."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as vocabulary_split_loss

from scaletrain.config import ConfigError, RunConfig, load_config, masked_attention, validate_config
from scaletrain.config import check_float16 as config_check_float16
from scaletrain.config import float16_problems as config_float16_problems
from scaletrain.data.loader import IGNORE, Prefetcher, TokenLoader, eval_batches, eval_windows
from scaletrain.data.shards import DataError, read_index, read_indexes
from scaletrain.hf import load_hf_weights
from scaletrain.model.flops import param_counts, train_flops_per_token
from scaletrain.model.llama import FLEX_DEVICES, Transformer, document_ids, shifted_targets
from scaletrain.model.loss import Tally, cross_entropy, target_log_probs, training_dtype
from scaletrain.parallel.apply import parallelize
from scaletrain.parallel.context import shard_sequence
from scaletrain.parallel.layout import check_layout, resolve_layout
from scaletrain.parallel.mesh import any_rank, collective_timeout, init_distributed, shutdown, world
from scaletrain.plan.cost import Reliability, checkpoint_interval, expected_wall_s, whole_steps
from scaletrain.plan.hardware import peak_flops
from scaletrain.model.moe import balance_tally, forget_counts, set_balance_weight, update_expert_bias
from scaletrain.plan.memory import choose_recompute, fsdp_dtype
from scaletrain.plan.search import describe
from scaletrain.plan.timing import PlanLayout
from scaletrain.report.goodput import duration
from scaletrain.outputs import kind_of
from scaletrain.train import checkpoint, noise
from scaletrain.train.float8 import check_float8, convert_to_float8
from scaletrain.train.init_from import init_source, starts_fresh
from scaletrain.train.metrics import Heartbeat, MetricsLog, StepProfiler, TensorBoardSink, WandbSink, read_metrics
from scaletrain.train.optim import build_optimizer, folded_multiplier, local_shard, set_hyperparameters, set_lr
from scaletrain.train.resilience import (StopSignals, StoppedAtTimeLimit, StoppedBySignal, TIME_LIMIT, Watchdog,
                                         loss_spike, stop_name)
from scaletrain.train.schedule import SCHEDULE_KEYS, run_lr
from scaletrain.train.tasks import Task, load_task, task_metrics

log = logging.getLogger("scaletrain")


# Optimizer state and hyperparameters keyed by parameter name ("param_groups.layers.0.….lr"), not
# by group: under pipelining each rank's groups hold other parameters, and a checkpoint stores one
# copy of each key, so grouped entries would be rank 0's on every rank.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# The first step whose speed is set against log.plan's: the first steps compile and warm up.
PLAN_CHECK_STEP = 10
# checkpoint.interval = "auto": the first save, which measures what the interval is chosen from,
# after this many steps (or a tenth of the run, if fewer).
AUTO_FIRST_SAVE = 10


def _squares(tensors: list[torch.Tensor], parts: list[int] | None = None, count: int = 1) -> torch.Tensor:
    """The squared 2-norms (count,) of the `count` parts of a whole split over the ranks, tensor i
    in part parts[i] (all in part 0 by default). A tensor split (sharded) over some mesh
    dimensions and whole on the others adds its local squares, summed over the sharded dimensions
    one at a time — one all-reduce of the parts' vector per kind of split, however many parts; one
    with partial sums (tensor parallelism's replicated weights) is left to DTensor, a part at a
    time. (DTensor's own reduction of several dimensions at once goes through a flattened group
    that torch 2.13 fails to find for the experts' mesh under context parallelism, whose
    dimensions interleave.)"""
    parts = parts if parts is not None else [0] * len(tensors)
    by_dims: dict = {}  # (mesh, sharded dimensions) -> local parts and their part indices; partial DTensors by mesh
    for tensor, part in zip(tensors, parts, strict=True):
        if not isinstance(tensor, DTensor):
            key, local = (None, ()), tensor
        elif any(placement.is_partial() for placement in tensor.placements):
            key, local = (tensor.device_mesh, "partial"), tensor
        else:
            key = (tensor.device_mesh, tuple(d for d, placement in enumerate(tensor.placements)
                                            if not placement.is_replicate()))
            local = tensor.to_local()
        entry = by_dims.setdefault(key, ([], []))
        entry[0].append(local)
        entry[1].append(part)
    squares = []
    for (mesh, dims), (locals_, indices) in by_dims.items():
        if dims == "partial":
            for part in sorted(set(indices)):
                mine = [t for t, i in zip(locals_, indices) if i == part]
                vector = torch.zeros(count, device=mine[0].device)
                vector[part] = torch.nn.utils.get_total_norm(mine).full_tensor().float().square()
                squares.append(vector)
            continue
        each = torch.stack([n.float() for n in torch._foreach_norm(locals_)]).square()
        if count == 1:
            square = each.sum()[None]
        else:
            square = torch.zeros(count, device=each.device).index_add_(0, torch.tensor(indices, device=each.device),
                                                                       each)
        for dim in dims:
            dist.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    return torch.stack(squares).sum(dim=0)


def model_part(name: str) -> str:
    """The part of the model a parameter belongs to, for norms by part: "embedding", "layers.N",
    "mtp.K" (multi-token prediction's depths) or "head" (the final norm and output head)."""
    first, *rest = name.replace("_orig_mod.", "").split(".")
    if first in ("layers", "mtp"):
        return f"{first}.{rest[0]}"
    return "embedding" if first == "tok_embeddings" else "head"


class TrainingDiverged(RuntimeError):
    """The loss or gradient became NaN or infinite at `step`; nothing was saved over the last
    good checkpoint."""

    cause = "nonfinite"

    def __init__(self, message: str, step: int = -1):
        super().__init__(message)
        self.step = step


class LossSpike(TrainingDiverged):
    """The loss at `step` rose train.spike_sigmas running standard deviations above its running
    mean (raised only while train.rewinds last: then the run goes back to before it)."""

    cause = "spike"


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    total_steps: int
    tokens: int
    train_loss: float | None
    val_loss: float | None
    tokens_per_s: float | None
    resumed_from: int | None


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill in what the config leaves to the data (vocabulary size); check that every data
    directory exists and that a mixture's directories share one tokenizer."""
    where = "data.path" if cfg.data.mix is None else "data.mix"
    try:
        indexes = read_indexes(cfg.data.sources)
    except DataError as e:
        raise ConfigError(f"{where}: {e}") from None
    if cfg.eval.data:  # (held-out sets: the run's tokenizer, for losses in the run's tokens)
        try:  # (under names of their own: a held-out set may share a training source's name)
            read_indexes({**{f"data {name}": path for name, path in cfg.data.sources.items()},
                          **{f"eval.data {name}": path for name, path in cfg.eval.sources.items()}})
        except DataError as e:
            raise ConfigError(f"eval.data: {e}") from None
    if cfg.model.document_mask and len({index["eos_id"] for index in indexes.values()}) > 1:
        raise ConfigError(f"data.mix: the data directories end documents with different tokens "
                          f"({ {name: index['eos_id'] for name, index in indexes.items()} }), so model.document_mask "
                          "cannot tell documents apart in all of them; prepare them with one tokenizer")
    vocab_size = max(index["vocab_size"] for index in indexes.values())
    data = cfg.model_dump()
    if cfg.model.vocab_size is None:
        data["model"]["vocab_size"] = -(-vocab_size // 64) * 64
    elif cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{vocab_size} tokens in {cfg.data.path!r}; leave it unset or raise it")
    return validate_config(data)


def _check_trackers(cfg: RunConfig) -> None:
    """ConfigError now, not after the first steps, when a tracker's package is missing."""
    for wanted, package in ((cfg.log.tensorboard, "tensorboard"), (cfg.log.wandb_project, "wandb")):
        if not wanted:
            continue
        try:
            __import__(package)
        except ImportError:
            setting = "log.tensorboard = true" if package == "tensorboard" else "log.wandb_project"
            raise ConfigError(f"{setting} needs the {package} package, which is not installed; "
                              f"pip install 'scaletrain[{package}]', or leave {setting.split(' ')[0]} unset") from None


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def float16_problems(cfg: RunConfig, layout) -> list[str]:
    """What float16's loss scaling does not reach in this run (config.float16_problems)."""
    return config_float16_problems(tp=layout.tp, cp=layout.cp, pp=layout.pp, moe=cfg.model.moe,
                                   float8=cfg.train.float8, loss_chunk_tokens=cfg.train.loss_chunk_tokens)


def check_float16(cfg: RunConfig, layout) -> None:
    """ConfigError naming float16_problems, where there are any."""
    config_check_float16(float16_problems(cfg, layout))


# float16's dynamic loss scale (Micikevicius et al. 2018; torch.amp.GradScaler's constants).
LOSS_SCALE_START, LOSS_SCALE_GROWTH_STEPS = 2.0 ** 16, 2000


# State a checkpoint may lack: the CUDA generator's, when the run was checkpointed on a CPU.
OPTIONAL = ("rng.cuda", "progress.loss_stats", "progress.noise_stats", "progress.loss_scale")  # (older versions')


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":  # only the training device's generator: others may not exist on resume
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


class Trainer:
    def __init__(self, cfg: RunConfig, launched: float | None = None):
        """launched: when this process started (unix seconds; default now), from which the start
        or resume record counts its setup_s."""
        self.launched = time.time() if launched is None else launched
        self.rank, local_rank, world_size = world()
        self.is_main = self.rank == 0
        if not self.is_main:  # one console for people: rank 0's (with every rank's errors)
            log.setLevel(logging.ERROR)
        self.cfg = cfg = resolve(cfg)
        _check_trackers(cfg)
        # The layout is checked before any process group starts.
        self.layout = resolve_layout(cfg.parallel, world_size)
        check_layout(self.layout, cfg)
        self.dp_rank = self.layout.dp_rank(self.rank)
        self.cp_rank = self.layout.coordinates(self.rank)["cp"]
        self.run_dir = cfg.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self.init_from = init_source(cfg)  # checked before any process group starts
        self.device = pick_device(cfg.train.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        self.dtype = training_dtype(cfg.train.dtype, self.device)
        if self.dtype == torch.float16 and (problems := float16_problems(cfg, self.layout)):
            if cfg.train.dtype != "auto":
                check_float16(cfg, self.layout)
            # (A GPU without bfloat16, and a run float16's scaling does not reach: float32.)
            log.info("train.dtype = auto: float32 on this GPU, which has no bfloat16, where float16's loss scaling "
                     "does not reach %s", ", ".join(problems))
            self.dtype = torch.float32
        if cfg.train.float8:
            check_float8(self.device, self.layout.tp)  # before any process group starts
        if cfg.parallel.recompute == "auto":
            self.cfg = cfg = self._choose_recompute(cfg)
        self.total_steps = cfg.total_steps
        self._check_fits()
        self._check_run_dir()
        self.tasks = self._load_tasks()  # a task file that cannot be read is refused before anything starts
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # mem_gb is this run's peak, not the process's
        self.mesh = init_distributed(self.device, self.layout, collective_timeout(cfg.train.hang_timeout_s))

        torch.manual_seed(cfg.run.seed)  # every rank builds the same full model, then keeps its shard
        param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self._fsdp_dtype(cfg), torch.float32)
        model = Transformer(cfg.model).to(self.device)
        if self.init_from and self.init_from.kind == "hf":  # (another run's checkpoint loads once sharded: fit)
            # (Multi-token prediction's modules, which no Hugging Face model holds, start afresh.)
            model.load_state_dict({**model.state_dict(), **load_hf_weights(self.init_from.path, cfg.model)})
            log.info("weights from %s (checkpoint.init_from)", cfg.checkpoint.init_from)
        if cfg.train.float8:  # before sharding: FSDP then gathers float8-aware weights
            log.info("train.float8: %d linear layers compute in float8",
                     convert_to_float8(model, self.device, self.layout.tp))
        self.pipeline_primed: set[int] = set()  # the micro-batches per step of the schedules primed: see _prime_pipeline
        self.moe_balance: float | None = None  # balancing loss per MoE block and rank at the last look (1: balanced)
        self.moe_max_load: float | None = None  # with expert biases: the most loaded expert over the mean, worst block
        # The z-loss's value, which the loss leaves out: see train_step.
        self.z_tally = model.z_tally = Tally() if cfg.train.z_loss else None
        self.z_loss_value: float | None = None
        # Multi-token prediction's loss (model.mtp_depth), which the loss leaves out likewise.
        self.mtp_tally = model.mtp_tally = Tally() if cfg.model.mtp_depth else None
        model.mtp_weight = cfg.train.mtp_weight
        self.mtp_loss_value: float | None = None
        # (Set before the model is split: a pipeline's last stage computes the loss as one process does.)
        model.z_loss = cfg.train.z_loss
        if self.layout.tp == 1:  # (a vocabulary-sharded head takes loss_parallel)
            model.loss_chunk = cfg.train.loss_chunk_tokens
        # (float16 parameters under float16: each block hands the residual stream on in float32.)
        stream = torch.float32 if param_dtype == torch.float16 and self.dtype == torch.float16 else None
        self.parallel = parallelize(model, self.mesh, self.layout, cfg, self.device, param_dtype=param_dtype,
                                    stream_dtype=stream)
        self.model = self.parallel.module
        self.optimizer = build_optimizer(self.model, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                         betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps,
                                         device=self.device, kind=cfg.train.optimizer,
                                         momentum=cfg.train.muon_momentum, width_mult=cfg.model.width_mult,
                                         depth_mult=cfg.model.depth_mult, depth_alpha=cfg.model.mup_depth_alpha,
                                         exclude=self.parallel.unstepped(), embedding_decay=cfg.train.embedding_decay)
        # muP's multipliers folded into weights, by parameter: what the norms count (_written_out_squares).
        self.folded = {id(p): s for name, p in self.model.named_parameters()
                       if (s := folded_multiplier(name, cfg.model.width_mult, cfg.model.depth_mult,
                                                  cfg.model.mup_depth_alpha)) != 1}
        self.folded_weights: dict[tuple[float, ...], torch.Tensor] = {}  # their squares, by set of multipliers
        self.loader = self._new_loader()
        # The micro-batches the experts' balancing weight was last set for (see train_step).
        self.balance_micro_steps: int | None = None
        # Attention within documents: the sources share a tokenizer, so one end-of-document token.
        self.eos_id = (read_index(next(iter(cfg.data.sources.values())))["eos_id"]
                       if cfg.model.document_mask else None)
        self.token_bytes = self._token_bytes()  # (for bits per byte: see evaluate)
        for where, path in [*((f"data.path = {cfg.data.path!r}", path) for path in cfg.data.sources.values()),
                            *((f"eval.data's {name!r}", path) for name, path in cfg.eval.sources.items())]:
            try:  # fail now, not after the last step, if validation cannot run
                next(eval_batches(path, cfg.data.seq_len, cfg.eval.tokens, cfg.train.micro_batch))
            except DataError as e:
                raise ConfigError(f"{where}: {e}") from None
            held, asked = eval_windows(read_index(path)["splits"]["val"]["tokens"], cfg.data.seq_len, cfg.eval.tokens)
            if held < asked and self.is_main:
                log.warning("eval.tokens = %d, but the validation split of %s holds %d in windows of %d: each "
                            "evaluation measures those (eval records say how many: measured_tokens); prepare with a larger "
                            "--val-fraction for more", cfg.eval.tokens, path, held * cfg.data.seq_len, cfg.data.seq_len)
        self._warn_repeated_data()
        if cfg.train.warmup_steps >= self.total_steps:
            log.warning("train.warmup_steps = %d is not below the run's %d steps: the learning rate never reaches "
                        "train.lr = %g", cfg.train.warmup_steps, self.total_steps, cfg.train.lr)
        if cfg.train.batch_ramp and cfg.batch_schedule()[-1][1] != cfg.train.global_batch_tokens:
            log.warning("train.batch_ramp reaches %d tokens, beyond the run's %d: train.global_batch_tokens = %d is "
                        "never trained", cfg.train.batch_ramp[-1][1], cfg.total_tokens,
                        cfg.train.global_batch_tokens)
        if (cfg.model.attention_kernel == "flex" and masked_attention(cfg.model, cfg.data.seq_len) and self.is_main
                and (self.device.type not in FLEX_DEVICES or self.layout.cp > 1)):
            log.info("model.attention_kernel = flex: %s, attention is computed with SDPA's mask (the same attention)",
                     "under context parallelism" if self.layout.cp > 1 else
                     f"on {self.device.type}, where torch's FlexAttention has no backward")
        self.step = 0
        self.tokens = 0
        self.held_bytes: dict[str, int] | None = None
        # The first step since the last look whose gradient norm was not finite, with its loss and
        # norm (-1 when none), kept on the device: see train_step.
        self.first_bad = torch.tensor([-1.0, 0.0, 0.0], device=self.device)
        # float16's loss scale and the steps since it last changed, on the device (train.dtype).
        self.scaling = self.dtype == torch.float16
        self.loss_scale = torch.tensor([LOSS_SCALE_START, 0.0], device=self.device)
        # Loss-spike detection (train.spike_sigmas): the loss's running statistics (see
        # resilience.loss_spike) and the first spike since the last look (step, loss, mean,
        # standard deviation; -1 when none), on the device; spikes found with no rewind left, for
        # the loop to log.
        self.loss_stats = torch.zeros(4, device=self.device)
        self.first_spike = torch.tensor([-1.0, 0.0, 0.0, 0.0], device=self.device)
        self.spikes: list[dict] = []
        # The gradient noise scale (train/noise.py): its moving averages (checkpointed) and the
        # last looked-at step's estimates, where the step had a first micro-batch to measure.
        self.noise_stats = noise.new_stats()
        self.noise: dict | None = None
        # log.norms: the parts of the whole model, in order (every rank lists them all, whatever
        # its stage holds), and the last looked-at step's norms by part.
        m = cfg.model
        self.model_parts = ["embedding", *(f"layers.{i}" for i in range(m.n_layers)),
                            *(f"mtp.{k}" for k in range(m.mtp_depth)), "head"]
        self.norms: dict | None = None
        # train.ema_decay: the moving average of the weights, by state-dict name, sharded as they
        # are (made from the weights when first wanted), and the local tensors each step lerps.
        self.ema: dict[str, torch.Tensor] | None = None
        self.ema_pairs: tuple[list, list] | None = None
        self.rewinds_left = cfg.train.rewinds
        self.next_save: int | None = None  # with checkpoint.interval = "auto": the step of the next checkpoint
        self.pending: checkpoint.AsyncSave | None = None  # a checkpoint being written in the background
        self.checkpoint_group = None  # the process group of background checkpoint writes
        self.stager = None  # page-locked host buffers that background checkpoints copy into (CUDA; False: refused)
        self.plan = self._load_plan()  # (log.plan: what the run checks itself against, early)
        self.flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
        self.causal_flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len, causal=True)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak_flops = peak_flops(device_name, str(self.dtype))

    def _new_loader(self) -> Prefetcher:
        """This rank's training batches from the start of the data order. Read ahead in a thread, so
        that a step never waits for its batch (and, on a GPU, batches arrive page-locked for an
        asynchronous copy)."""
        cfg = self.cfg
        batch_seqs = (lambda step: cfg.step_batch_tokens(step) // cfg.data.seq_len) if cfg.train.batch_ramp else None
        return Prefetcher(TokenLoader(cfg.data.sources, cfg.data.seq_len, cfg.seqs_per_step, cfg.train.micro_batch,
                                      rank=self.dp_rank, world_size=self.layout.dp, seed=cfg.data_seed,
                                      weights=cfg.data.weights, batch_seqs=batch_seqs),
                          pin=self.device.type == "cuda")

    def _token_bytes(self) -> torch.Tensor | None:
        """The bytes of text of each token id, on the device (data/tokenizer.token_bytes); None
        when the tokenizer's vocabulary says no bytes (neither byte-level nor SentencePiece's)."""
        from scaletrain.data.tokenizer import load_tokenizer, token_bytes

        path = next(iter(self.cfg.data.sources.values())) / "tokenizer.json"
        counts = token_bytes(load_tokenizer(path), self.cfg.model.vocab) if path.is_file() else None
        return None if counts is None else torch.from_numpy(counts).to(self.device)

    def _load_plan(self) -> dict | None:
        """log.plan's JSON, checked to be a plan of this model (ConfigError otherwise)."""
        from scaletrain.plan.planner import against_plan

        if not self.cfg.log.plan:
            return None
        try:
            plan = json.loads(Path(self.cfg.log.plan).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"log.plan = {self.cfg.log.plan!r} is not readable JSON ({e}); give the .plan.json that "
                              "`scaletrain plan --write-config` wrote beside the config, or leave it unset") from None
        try:
            against_plan(plan, param_counts(self.cfg.model)["total"], dict.fromkeys(("tokens_per_s", "mfu",
                                                                                     "peak_memory_gb")))
        except ConfigError as e:
            raise ConfigError(f"log.plan = {self.cfg.log.plan!r}: {e}") from None
        return plan

    def check_against_plan(self, tokens_per_s: float, mfu: float | None, memory_gb: float | None) -> dict:
        """This run's speed and memory beside the plan's (planner.against_plan), and a warning
        for what falls short of it: below 80% of the planned tokens/s, above the planned peak
        memory by more than 10%, other devices than planned."""
        from scaletrain.plan.hardware import identify
        from scaletrain.plan.planner import against_plan

        against = against_plan(self.plan, param_counts(self.cfg.model)["total"],
                               {"tokens_per_s": tokens_per_s, "mfu": mfu, "peak_memory_gb": memory_gb})
        here = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        planned = identify(against["device"])  # (a catalog device; a described one goes by its name)
        same = identify(here) == planned if planned else here.lower() == against["device"].lower()
        problems = []
        if not same or against["devices"] != self.layout.world_size:
            problems.append(f"the plan is for {against['devices']} x {against['device']}, this runs on "
                            f"{self.layout.world_size} x {here}")
        planned_layout = self.plan["layout"].get("layout") or {}
        mine = PlanLayout.of(self.cfg, self.layout)
        if any(planned_layout.get(name, value) != value for name, value in mine.to_dict().items()):
            problems.append(f"the plan is for {against['layout']}, this runs {describe(mine)}")
        speed, memory = against["tokens_per_s"], against["peak_memory_gb"]
        if speed["ratio"] is not None and speed["ratio"] < 0.8:
            problems.append(f"{tokens_per_s:,.0f} tokens/s is {speed['ratio']:.2f}x the planned "
                            f"{speed['planned']:,.0f}")
        if memory["ratio"] is not None and memory["ratio"] > 1.1:
            problems.append(f"peak memory {memory_gb:.2f} GB is {memory['ratio']:.2f}x the planned "
                            f"{memory['planned']:.2f} GB")
        if problems:
            log.warning("against its plan (log.plan = %s): %s", self.cfg.log.plan, "; ".join(problems))
        return {**against, "problems": problems}

    def micro_steps(self, step: int) -> int:
        """This rank's micro-batches in the step after `step` completed ones."""
        cfg = self.cfg
        return cfg.step_batch_tokens(step) // cfg.data.seq_len // (self.layout.dp * cfg.train.micro_batch)

    def _load_tasks(self) -> list[Task]:
        """eval.tasks, tokenized as the data was."""
        if not self.cfg.eval.tasks:
            return []
        from scaletrain.data.tokenizer import load_tokenizer

        data = next(iter(self.cfg.data.sources.values()))
        index = read_index(data)
        tokenizer = load_tokenizer(data)
        return [load_task(path, tokenizer, index["eos_id"], self.cfg.data.seq_len, self.cfg.eval.task_examples,
                          index.get("bos_id")) for path in self.cfg.eval.tasks]

    def _fsdp_dtype(self, cfg: RunConfig) -> str | None:
        """What FSDP gathers parameters in, "bf16", "fp16" or "fp32" (plan/memory.py's fsdp_dtype,
        from parallel.fsdp_param_dtype; auto: the compute dtype); None for one process."""
        compute = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")
        return fsdp_dtype(compute, cfg.parallel.fsdp_param_dtype, self.layout.world_size)

    def _choose_recompute(self, cfg: RunConfig) -> RunConfig:
        """parallel.recompute = auto: the planner's choice for this device's memory."""
        mode = "none"
        if self.device.type == "cuda":
            capacity = 0.9 * torch.cuda.get_device_properties(self.device).total_memory
            layout = PlanLayout.of(cfg, self.layout).memory_layout(cfg.seqs_per_step)
            mode, estimate = choose_recompute(cfg.model, cfg.data.seq_len, cfg.train.micro_batch, capacity,
                                              bf16=self.dtype != torch.float32, gather_dtype=self._fsdp_dtype(cfg),
                                              **layout)
            log.info("parallel.recompute = auto: %s (predicted peak %.1f GB of %.1f GB usable)", mode,
                     estimate.peak / 1e9, capacity / 1e9)
        data = cfg.model_dump()
        data["parallel"]["recompute"] = mode
        return validate_config(data)

    def _warn_repeated_data(self) -> None:
        """Repeating data beyond ~4 epochs is worth much less than fresh data (Muennighoff et al.
        2023, "Scaling Data-Constrained Language Models", section 5): say so before training."""
        samples = self.cfg.total_tokens // self.cfg.data.seq_len
        step = self.cfg.train.global_batch_tokens // self.cfg.data.seq_len
        for source in self.loader.sources:
            weight = self.cfg.data.weights[source.name]
            epochs = samples * weight / source.windows
            if step * weight > source.windows:  # (said even of a run too short for the epochs to add up)
                log.warning("source %r holds %d sequences of data.seq_len %d, fewer than its share of a step (%d), so "
                            "each step trains on some of them twice; add data, or lower train.global_batch_tokens",
                            source.name, source.windows, self.cfg.data.seq_len, math.ceil(step * weight))
            elif epochs > 4:
                log.warning("source %r would be repeated %.1f times over this run (more than 4 epochs, where repeated "
                            "tokens stop being nearly as useful as new ones); add data or lower its weight",
                            source.name, epochs)

    def _check_fits(self) -> None:
        """Refuse, in one sentence, a model whose float32 weights alone (every process builds the
        whole model before sharding it) exceed its device's memory: torch would fail deep in the
        allocator, or the machine swap for minutes first."""
        n = param_counts(self.cfg.model)["total"]
        if self.device.type == "cuda":
            what, total = torch.cuda.get_device_name(self.device), torch.cuda.mem_get_info(self.device)[1]
            needed = 4 * n
        else:
            try:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                return
            processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # (on one host, each builds it)
            what, needed = "this machine" + (f" ({processes} processes)" if processes > 1 else ""), 4 * n * processes
        if needed > total:
            raise ConfigError(f"the model's {n:,} parameters take {needed / 1e9:,.1f} GB in float32 to build, more than "
                              f"the {total / 1e9:,.1f} GB of {what}; choose a smaller model (model.dim, model.n_layers)")

    def _check_run_dir(self) -> None:
        check_run_dir(self.cfg)

    # -- state ------------------------------------------------------------------------------

    def state(self) -> dict:
        """Everything that determines the rest of the run: a resumed run continues bit for bit."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        # The loader's state travels as one JSON string: DCP matches nested keys one by one, so a
        # mixture with other source names would fail as a "missing key" instead of the loader's own
        # clear message about which data the checkpoint was trained on.
        return {"model": model_state, "optim": optim_state, "loader": json.dumps(self.loader.state_dict()),
                "rng": rng_state(self.device),
                "progress": {"step": self.step, "tokens": self.tokens, "loss_stats": self.loss_stats.cpu(),
                             "noise_stats": self.noise_stats.clone(), "loss_scale": self.loss_scale.cpu()},
                **({"ema": self.ema_state()} if self.cfg.train.ema_decay else {})}

    def load_state(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=STATE_OPTIONS)
        self.parallel.share_weights()
        self._set_hyperparameters()
        set_rng_state(state["rng"], self.device)
        self.step, self.tokens = int(state["progress"]["step"]), int(state["progress"]["tokens"])
        self._load_loader(json.loads(state["loader"]))
        self.loss_stats = state["progress"].get("loss_stats", torch.zeros(4)).to(self.device)
        self.noise_stats = state["progress"].get("noise_stats", noise.new_stats()).to(torch.float64)
        self.loss_scale = state["progress"].get("loss_scale", torch.tensor([LOSS_SCALE_START, 0.0])).to(self.device)
        if self.cfg.train.ema_decay:
            self._ema_from(state.get("ema", {}), loading=True)

    def optional(self) -> tuple[str, ...]:
        """What a checkpoint may lack (OPTIONAL), and the moving average of the weights: a run
        that turns train.ema_decay on resumes from checkpoints without one."""
        return OPTIONAL + tuple(f"ema.{name}" for name in (self.ema or {}))

    def ema_state(self) -> dict[str, torch.Tensor]:
        """The moving average of the weights (train.ema_decay), begun from the weights if it has
        not been yet."""
        if self.ema is None:
            self._ema_from({})
        return self.ema

    def _ema_from(self, loaded: dict[str, torch.Tensor], loading: bool = False) -> None:
        """The moving average as loaded (`loaded`, with what a checkpoint lacked left out), the
        rest begun from the weights."""
        self._reshard()  # (FSDP's state dict holds the sharded parameters, the optimizer's)
        weights = {name: value for name, value in get_model_state_dict(self.model, options=STATE_OPTIONS).items()
                   if value.is_floating_point()}
        missing = [name for name in weights if name not in loaded]
        if loading and missing:
            log.warning("the checkpoint holds no moving average of %d of the weight tensors (train.ema_decay was 0 when "
                        "it was saved): it begins from them now", len(missing))
        self.ema = {**loaded, **{name: weights[name].detach().clone() for name in missing}}
        with torch.no_grad():  # (a DTensor's local part taken with autograd on is a view it guards)
            def storage(name: str):  # (an empty shard is no one's storage)
                local = local_shard(weights[name])
                return (local.data_ptr(), local.shape) if local.numel() else name
            first: dict = {}  # storage -> the first name of it: a tied weight has one average
            for name in weights:
                first.setdefault(storage(name), name)
            unique = list(first.values())
            for name in weights:
                self.ema[name] = self.ema[first[storage(name)]]
            self.ema_pairs = ([local_shard(self.ema[name]) for name in unique],
                              [local_shard(weights[name]) for name in unique])

    @contextlib.contextmanager
    def ema_weights(self):
        """The moving average of the weights in their place while inside (the weights kept aside)."""
        averages, weights = self.ema_pairs
        self._reshard()  # (an FSDP module still gathered would compute with what it gathered before)
        with torch.no_grad():
            kept = [weight.clone() for weight in weights]
            torch._foreach_copy_(weights, averages)
        self.parallel.share_weights()
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                torch._foreach_copy_(weights, kept)
            self.parallel.share_weights()

    def _reshard(self) -> None:
        """Free FSDP's gathered parameters (pipeline stages keep them between forwards), so that
        the next forward gathers the shards as they are now."""
        for part in self.parallel.parts:  # (a pipeline's parts: the roots its holder, self.model, leaves out)
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _update_ema(self, skipped: torch.Tensor) -> None:
        """ema <- d ema + (1 - d) weights after the step, on each rank's shards; a skipped step
        (`skipped`, on the device) changes nothing."""
        self.ema_state()
        averages, weights = self.ema_pairs
        rate = (1 - self.cfg.train.ema_decay) * (~skipped).float()
        with torch.no_grad():
            torch._foreach_lerp_(averages, weights, [rate] * len(averages))

    def _load_loader(self, position: dict) -> None:
        """The loader at `position` in the data, the batch sizes (train.batch_ramp) following
        training's step: a rewound position (the data goes on past the skipped batches) or a state
        written before the loader counted steps holds another."""
        self.loader.load_state_dict({**position, "step": self.step})

    def _set_hyperparameters(self) -> None:
        """A loaded optimizer state brings the hyperparameters it was saved with: the config's
        instead (the learning rate is set each step)."""
        train = self.cfg.train
        set_hyperparameters(self.optimizer, weight_decay=train.weight_decay, betas=(train.beta1, train.beta2),
                            eps=train.eps, momentum=train.muon_momentum)

    def init_from_checkpoint(self) -> dict:
        """checkpoint.init_from names another run's checkpoint: its weights (and, with
        checkpoint.init_optimizer, its optimizer state) into this run's model, in this run's
        layout; this run's step, data order and random state stay at their start. Returns what
        the start record keeps of it."""
        return self.load_weights(self.init_from.path, self.cfg.checkpoint.init_optimizer)

    def load_weights(self, path: Path, take_optimizer: bool = False, ema: bool = False) -> dict:
        """The weights (and with `take_optimizer` the optimizer state; with `ema` the moving
        average of the weights instead, train.ema_decay's) of the checkpoint `path`, checked by
        init_source to fit, into this model in this layout; nothing else of the run changes.
        Returns what a start record keeps of it (the checkpoint, its step and tokens)."""
        section = "ema" if ema else "model"
        if take_optimizer:  # (building the optimizer's state initialises its moments: only then)
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
            state = {"model": model_state, "optim": optim_state}
        else:
            state = {section: get_model_state_dict(self.model, options=STATE_OPTIONS)}
        saved = checkpoint.saved_shapes(path)
        fresh = [name for name in state[section] if f"{section}.{name}" not in saved and starts_fresh(name)]
        for name in fresh:  # checked by init_source: only weights that start afresh may be missing
            del state[section][name]
        restored = {}  # the optimizer state of weights that start afresh: as initialised, not loaded
        if take_optimizer:
            lacking = [name for name in state["optim"] if f"optim.{name}" not in saved]  # (expert_bias: a buffer)
            restored = {key: state["optim"].pop(key) for key in lacking
                        if any(key.split(".", 1)[1].startswith(f"{name}.") for name in fresh)}
            # (Building the state took a step of nothing: the fresh weights' first update is their first.)
            restored = {key: value * 0 if key.endswith(".step") else value for key, value in restored.items()}
            lacking = [key for key in lacking if key not in restored]
            if lacking:
                raise ConfigError(f"checkpoint.init_from = {self.cfg.checkpoint.init_from!r} holds no optimizer state "
                                  f"{lacking[0]} (it was written by another optimizer or version); set "
                                  "checkpoint.init_optimizer = false to start the optimizer afresh")
        checkpoint.load(path, state)
        if take_optimizer:
            state["optim"].update(restored)
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=not fresh)
        if take_optimizer:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=options)
            self._set_hyperparameters()
        else:
            set_model_state_dict(self.model, state[section], options=options)
        self.parallel.share_weights()
        marker = checkpoint.marker(path)
        log.info("%s%s from %s (step %d of its run)", "the moving average of the weights" if ema else "weights",
                 " and optimizer state" if take_optimizer else "", path, marker["step"])
        return {"init_from": str(path), "init_step": marker["step"], "init_tokens": marker["tokens"],
                "init_optimizer": take_optimizer}

    def load_average(self, paths: list[Path], ema: bool = False) -> None:
        """The mean of the weights of the checkpoints `paths` (each loaded as load_weights loads
        it), in this layout: the sharded tensors add up where they lie. Averaging the checkpoints of
        a run's latest stretch often gives a better model than its last (latest weight averaging:
        Kaddour 2022; Sanyal et al. 2023), and averaging those of a constant learning rate foresees
        much of the annealed model (Li et al. 2025)."""
        total = None
        for path in paths:
            self.load_weights(path, ema=ema)
            state = get_model_state_dict(self.model, options=STATE_OPTIONS)
            if total is None:
                total = {name: value.detach().clone() for name, value in state.items()}
            else:
                for name, value in state.items():
                    if value.is_floating_point():
                        total[name] += value.detach()
                    else:  # (nothing of the model is, today: counters would keep the newest)
                        total[name] = value.detach().clone()
        for value in total.values():
            if value.is_floating_point():
                value /= len(paths)
        set_model_state_dict(self.model, total, options=STATE_OPTIONS)
        self.parallel.share_weights()

    def resume(self) -> int | None:
        choice = self.cfg.checkpoint.resume
        # Building the state initialises the optimizer's moments (a zero-lr step), so only build
        # it when there is a checkpoint to load into it: a fresh run starts with a clean optimizer.
        if choice == "never" or (choice == "auto" and not checkpoint.all_checkpoints(self.ckpt_root)):
            return None
        if choice == "auto" and not checkpoint.committed_checkpoints(self.ckpt_root):
            # Only saves that never finished (a run stopped while writing its first checkpoint):
            # there is no run to lose, so it starts again (and overwrites them as it saves).
            log.warning("no checkpoint in %s was ever committed (%s: saves that did not finish); starting from "
                        "step 0", self.ckpt_root, ", ".join(p.name for p in checkpoint.all_checkpoints(self.ckpt_root)))
            return None
        state = self.state()
        if choice == "auto":
            path = checkpoint.load_newest(self.ckpt_root, state, self.optional())
        else:
            path = Path(choice)
            if not path.is_dir():
                raise ConfigError(f"checkpoint.resume = {choice!r} is not a directory; give a checkpoint directory "
                                  "(…/checkpoints/step_NNNNNNN), 'auto' or 'never'")
            if not any((path / name).exists() for name in (".metadata", "COMMITTED")):
                hint = " (a run directory: its newest is resumed with 'auto')" if (path / "checkpoints").is_dir() else ""
                raise ConfigError(f"checkpoint.resume = {choice!r} is not a checkpoint directory{hint}; give one "
                                  "(…/checkpoints/step_NNNNNNN), 'auto' or 'never'")
            saved = path.parent.parent / "config.toml"  # (the run the checkpoint is of, where it lies in one)
            if path.parent.name == "checkpoints" and saved.is_file() and (fixed := _changes(saved, self.cfg)[1]):
                raise ConfigError(f"checkpoint.resume = {choice!r} is of another run ({fixed}); resume it with that "
                                  "run's settings, or start from its weights with checkpoint.init_from")
            checkpoint.load(path, state, self.optional())
            # A leftover of an interrupted save is no history (the next save of its step replaces it).
            newer = [p.name for p in checkpoint.complete_checkpoints(self.ckpt_root)
                     if checkpoint.step_of(p) > int(state["progress"]["step"])]
            if newer:
                raise ConfigError(f"checkpoint.resume = {choice!r} is older than checkpoints already in "
                                  f"{str(self.ckpt_root)!r} ({', '.join(newer)}); resuming would mix two histories — "
                                  "choose a new run.name")
        skip = checkpoint.rewound(path)
        if skip is not None:  # a divergence went back to this checkpoint: its batches since stay skipped
            state["loader"] = json.dumps(skip["loader"])
            log.info("%s was rewound to after the divergence at step %d: resuming past the %d steps of batches "
                     "skipped then", path, skip["diverged_at"], skip["skipped_steps"])
        self.load_state(state)
        counted = self.cfg.tokens_before(self.step)
        if counted != self.tokens:  # (its schedule, its end and its time left would count steps it did not train)
            raise ConfigError(f"{path} trained {self.tokens:,} tokens in its {self.step} steps, which this config's "
                              f"batch (train.global_batch_tokens, train.batch_ramp) counts as {counted:,}: resume with "
                              "the batch it trained with, or start a stage of another batch from it "
                              "(checkpoint.init_from)")
        if self.step > self.total_steps:
            raise ConfigError(f"{path} is at step {self.step}, past the run's {self.total_steps} steps "
                              f"(train.steps or train.tokens); raise them above {self.step} to go on, or give "
                              "a new run.name to start another run")
        log.info("resumed from %s at step %d", path, self.step)
        return self.step

    def rewind(self, diverged_at: int, spike: bool = False,
               through: int | None = None) -> tuple[Path, int, list[str]] | None:
        """After a divergence: back to the model, optimizer, RNG and step of the newest intact
        checkpoint from before it, with the data where it got to, so that the batches read since that checkpoint (those
        that led to the divergence) are skipped (Chowdhery et al. 2022, "PaLM", section 5.1, who
        restarted ~100 steps before a spike and skipped 200-500 batches). The data position is
        recorded beside the checkpoint, so that a run stopped or crashed before its next
        checkpoint resumes past those batches too. A NaN gradient's update was never applied, but
        the update that made a spike's loss was the step before's: for a `spike` the checkpoint
        must be older than that step. Newer checkpoints (which hold it) are discarded once the
        older one has loaded. The checkpoint is one the schedule saved, not a stop's, and with
        `through` the batches of the steps up to that one are skipped too (a look only a stop made
        found the divergence earlier than the schedule's would have): so that a stopped and resumed
        run rewinds as one that never stopped. Returns the
        checkpoint, the steps of batches skipped and the checkpoints discarded, or None when there
        is no checkpoint to go back to (nothing changed then). Every rank calls it (they diverge at
        the same step)."""
        good = diverged_at - 2 if spike else diverged_at - 1
        if not self._checkpoint_at_or_before(good):
            return None
        for index in range(self.step, through or self.step):
            for _ in range(self.micro_steps(index)):
                self.loader.next_batch()
        position = self.loader.state_dict()  # after the last batch handed out, not the read-ahead ones
        self.loader.close()
        self.loader = self._new_loader()
        state = self.state()
        path = checkpoint.load_newest(self.ckpt_root, state, self.optional(), at_most=good, scheduled_only=True)
        discarded = checkpoint.discard_after(self.ckpt_root, checkpoint.step_of(path))  # once it has loaded
        self.load_state(state)
        self._load_loader(position)
        self.first_bad = torch.tensor([-1.0, 0.0, 0.0], device=self.device)
        self.first_spike[0] = -1
        self._zero_grad()  # a step that raised before applying left its gradients
        before = json.loads(state["loader"])
        skipped = position["draws"] - before.get("draws", before["consumed"] // self.cfg.seqs_per_step)
        checkpoint.record_rewind(path, position, diverged_at, skipped)
        return path, skipped, discarded

    def _checkpoint_at_or_before(self, step: int, scheduled: bool = True) -> bool:
        """Whether an intact checkpoint of `step` or earlier exists (one the schedule saved, unless
        not `scheduled`: a stop's too), as every rank sees it (each calls this: the one being
        written is finished first)."""
        self.finish_saving(wait=True)
        if dist.is_initialized():
            dist.barrier()  # rank 0 has committed (and pruned) what it was saving: all ranks list alike
        return any(checkpoint.step_of(p) <= step and (checkpoint.is_scheduled(p) or not scheduled)
                   for p in checkpoint.complete_checkpoints(self.ckpt_root))

    def save(self, scheduled: bool = True) -> Path:
        """Checkpoint the current step; returns its path. With checkpoint.async_save the writing
        goes on in the background (see finish_saving); the previous one is finished first. Not
        `scheduled`: a stop's, between the run's checkpoint steps (checkpoint.save)."""
        if not self.cfg.checkpoint.async_save:
            return checkpoint.save(self.ckpt_root, self.step, self.tokens, self.state(), self.cfg.checkpoint.keep,
                                   self.cfg.checkpoint.keep_every, scheduled)
        self.finish_saving(wait=True)
        if dist.is_initialized() and self.checkpoint_group is None:
            self.checkpoint_group = dist.new_group(backend="gloo")  # see checkpoint.save_async
        if self.device.type == "cuda" and self.stager is None:
            self.stager = checkpoint.pinned_stager() or False
        self.pending = checkpoint.save_async(self.ckpt_root, self.step, self.tokens, self.state(),
                                             self.cfg.checkpoint.keep, self.checkpoint_group, self.stager or None,
                                             self.cfg.checkpoint.keep_every, scheduled)
        if self.pending.stager_refused:
            self.stager = False  # (closed; DCP's pageable copies from now on, not made again)
        return self.pending.path

    def finish_saving(self, wait: bool) -> None:
        """Commit a background checkpoint that has finished writing (or, with wait, once it has)."""
        if self.pending is not None and (wait or self.pending.done()):
            self.pending.wait()
            self.pending = None

    # -- steps ------------------------------------------------------------------------------

    def autocast(self, loss_parallel: bool = True):
        """The context of every forward (and, for the loss, backward): mixed precision where it
        applies, and (unless told otherwise) the vocabulary-sharded loss under tensor parallelism."""
        stack = contextlib.ExitStack()
        if self.dtype != torch.float32:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
        if loss_parallel and self.layout.tp > 1:
            stack.enter_context(vocabulary_split_loss())
        return stack

    def train_step(self, look: bool = True, estimate_noise: bool = True) -> tuple[float | None, float | None, float]:
        """One optimizer step over the global batch; returns (loss, grad norm, seconds waiting
        for data), the loss and norm only when `look` (None otherwise); a looked-at step updates
        the gradient noise scale's estimate unless told not to (`estimate_noise`).

        Reading a value on the host waits for the device to finish the step, and the device then
        idles while the host queues the next one; so a step is only looked at when asked (the
        loop asks at steps it logs, checkpoints or evaluates). A step whose gradient norm is not
        finite is still never applied: the fused AdamW skips it on the device (the found_inf its
        kernel takes from GradScaler), and the first such step is remembered on the device and
        raised as TrainingDiverged at the next look, before anything is saved. Under float16 it is
        an overflow: skipped too, the loss scale halved, and only a scale fallen below 1 is
        remembered so."""
        cfg = self.cfg.train
        if cfg.cuda_graphs and self.device.type == "cuda":
            # CUDA graphs (these modes' cudagraph trees): a new step begins, so the graphs may
            # reuse the memory of the last step's outputs, which nothing reads any more.
            torch.compiler.cudagraph_mark_step_begin()
        lr = run_lr(self.cfg, self.step)
        set_lr(self.optimizer, lr)
        self.model.train()
        micro_steps = self.micro_steps(self.step)
        if self.cfg.model.moe and micro_steps != self.balance_micro_steps:
            # The experts' balance enters the objective from inside the blocks (model/moe.py),
            # once a micro-batch: scaled like the loss, which the trainer divides by the
            # micro-batches and a pipeline schedule by scaling the gradients instead; and over
            # tp, whose ranks sum the gradients of their parts of the sequences.
            per_step = 1 if self.layout.pp > 1 else micro_steps
            set_balance_weight(self.model, self.cfg.model.moe_aux_loss / (per_step * self.layout.tp))
            self.balance_micro_steps = micro_steps
        if (self.parallel.schedule is not None and (self.cfg.model.moe or self.z_tally or self.mtp_tally)
                and micro_steps not in self.pipeline_primed):
            self._prime_pipeline(micro_steps)
        for tally in (self.z_tally, self.mtp_tally):
            if tally is not None:
                tally.reset()  # (after any priming of the pipeline: this step's micro-batches only)
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        batches = []
        first_sq = None  # the first micro-batch's squared gradient norm, for the noise scale
        for micro in range(micro_steps):
            t0 = time.perf_counter()
            batches.append(self._batch(*self.loader.next_batch(), depths=self.cfg.model.mtp_depth))
            data_wait += time.perf_counter() - t0
            if self.parallel.schedule is None:  # one micro-batch at a time: forward, backward
                inputs, targets, documents = batches.pop()
                with self.autocast():  # loss_parallel must cover the backward too
                    loss = self.model(inputs, targets, documents=documents) / micro_steps
                    (loss * self.loss_scale[0] if self.scaling else loss).backward()
                loss_sum += _local(loss.detach())
                if look and estimate_noise and micro == 0 and micro_steps > 1:  # (reduced over the data-parallel ranks already)
                    first_sq = self._written_out_squares([p for p in self.model.parameters() if p.grad is not None])
                    first_sq = first_sq[0] * micro_steps ** 2  # the loss was divided by micro_steps
                    if self.scaling:
                        first_sq = first_sq / self.loss_scale[0] ** 2
        after = self.loader.state_dict()  # the loader sized the step as training did (train.batch_ramp)
        if after["micro"] or after["step"] != self.step + 1:
            raise RuntimeError(f"the data loader's step {after['step']} (micro-batch {after['micro']}) is not "
                               f"training's step {self.step + 1} after its {micro_steps} micro-batches")
        if self.parallel.schedule is not None:  # the pipeline takes this rank's whole share, in micro-batches
            losses = self._pipeline(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*batches)),
                                    microbatches=micro_steps)
            self.parallel.sum_gradients()
            if self.parallel.last:
                loss_sum += torch.stack([_local(loss.detach()) for loss in losses]).mean()
        part_norms = self._norms_by_part(grads=True) if look and self.cfg.log.norms else None
        scale = self.loss_scale[0] if self.scaling else None
        if part_norms is not None and scale is not None:
            part_norms = {name: round(norm / scale.item(), 6) for name, norm in part_norms.items()}
        grad_norm = self._clip_gradients(cfg.clip if cfg.clip > 0 else math.inf, scale)
        # The norm is global (every rank holds the same), so every rank skips the same steps.
        bad = ~torch.isfinite(grad_norm)
        diverged = bad
        if self.scaling:  # an overflow halves the scale and skips the step; only a scale below 1 is divergence
            grown = torch.where(self.loss_scale[1] + 1 >= LOSS_SCALE_GROWTH_STEPS, 2.0, 1.0)
            self.loss_scale = torch.where(bad, torch.stack([self.loss_scale[0] / 2, torch.zeros_like(scale)]),
                                          torch.stack([self.loss_scale[0] * grown,
                                                       (self.loss_scale[1] + 1) * (grown == 1)]))
            diverged = bad & (self.loss_scale[0] < 1)
        # The loss over the global batch, reduced on the device every step (one scalar): what a
        # divergence or a spike is reported with, and what is logged.
        global_loss = self._mean_over_last_stage(loss_sum)
        values = torch.stack([torch.full_like(grad_norm, self.step + 1), global_loss.to(grad_norm.dtype), grad_norm])
        self.first_bad = torch.where(diverged & (self.first_bad[0] < 0), values.float(), self.first_bad)
        if cfg.spike_sigmas:
            self._judge_loss(global_loss)
        fused = self.optimizer.defaults.get("fused")
        if fused:
            self.optimizer.found_inf = bad.float()  # the kernel leaves parameters and state as they were
        else:  # no skip on the device: every step is looked at before it applies
            self._check(None)
        if fused or not (self.scaling and bool(bad)):  # (float16's overflow, without a fused kernel: skipped here)
            self.optimizer.step()
        self.parallel.share_weights()
        if cfg.ema_decay:
            self._update_ema(bad)
        max_load = (update_expert_bias(self.model, self.cfg.model, skip=bad)
                    if self.cfg.model.moe_bias_update else None)
        balance = balance_tally(self.model) if self.cfg.model.moe else None
        if self.held_bytes is None:  # after the first update every piece of state exists
            self.held_bytes = held_bytes(self.model, self.optimizer, self.ema, self.parallel.unstepped())
        self._zero_grad()
        step_tokens = self.cfg.step_batch_tokens(self.step)
        self.tokens += step_tokens
        self.step += 1
        self.lr = lr
        if not look:
            return None, None, data_wait
        self.noise = None
        if first_sq is not None:
            grad_sq, trace = noise.estimates(first_sq.item(), grad_norm.item() ** 2, step_tokens // micro_steps,
                                             step_tokens)
            self.noise_stats = noise.update(self.noise_stats, grad_sq, trace)
            scale = noise.noise_scale(self.noise_stats)
            self.noise = {"noise_grad_sq": grad_sq, "noise_trace": trace,
                          **({"noise_scale": round(scale, 1)} if scale is not None else {})}
        self.norms = None
        if part_norms is not None:  # (the weights' after the update)
            self.norms = {"grad_norm_by_part": part_norms, "weight_norm_by_part": self._norms_by_part(grads=False)}
        loss_value, norm_value = global_loss.item(), grad_norm.item()
        # (Under float16 a forward pass that overflowed leaves the loss and gradient non-finite:
        # an overflow, skipped and the scale halved, not a divergence.)
        self._check(None if self.scaling and not math.isfinite(norm_value) else loss_value)
        self.moe_balance = self._mean_balance(balance) if balance is not None else None  # (every rank: all-reduced)
        self.moe_max_load = max_load.max().item() if max_load is not None else None
        z_mean = self._tally_mean(self.z_tally)
        self.z_loss_value = None if z_mean is None else cfg.z_loss * z_mean
        self.mtp_loss_value = self._tally_mean(self.mtp_tally)
        return loss_value, norm_value, data_wait

    def _judge_loss(self, loss: torch.Tensor) -> None:
        """Fold the step's global loss into the running statistics of spike detection, and
        remember it (on the device) if it is the first spike since the last look."""
        mean, std = self.loss_stats[1], self.loss_stats[2].clamp_min(0).sqrt()
        self.loss_stats, spike = loss_spike(self.loss_stats, loss, self.cfg.train.spike_sigmas,
                                            self.cfg.train.spike_window)
        values = torch.stack([torch.full_like(loss, self.step + 1), loss, mean, std])
        self.first_spike = torch.where(spike & (self.first_spike[0] < 0), values, self.first_spike)

    def _check(self, loss: float | None) -> None:
        """Raise TrainingDiverged for the first step since the last look whose gradient norm was
        not finite (its update was skipped), or for a loss that is not; LossSpike for the first
        loss spike while rewinds are left (with none left, it is only reported)."""
        step, bad_loss, bad_norm = self.first_bad.tolist()
        if step >= 0 or (loss is not None and not math.isfinite(loss)):
            if step >= 0:
                what = f"step {int(step)}: loss is {bad_loss} and gradient norm {bad_norm}; the update was not applied"
            else:  # a loss that is not finite with a gradient that is (its update did apply, in memory only)
                step, what = self.step, f"step {self.step}: loss is {loss} with a finite gradient norm"
            self.finish_saving(wait=True)  # a save still being written holds a good state: name it
            raise TrainingDiverged(
                f"{what} and nothing was saved over the last good checkpoint{self._last_checkpoint_hint()}; lower "
                "train.lr, raise train.warmup_steps or set train.clip", int(step))
        step, spiked, mean, std = self.first_spike.tolist()
        if step < 0:
            return
        self.first_spike[0] = -1
        sigmas = (spiked - mean) / std if std > 0 else math.inf
        what = (f"step {int(step)}: loss {spiked:.4f} is {sigmas:.1f} standard deviations above its running mean "
                f"{mean:.4f} (standard deviation {std:.4f}), beyond train.spike_sigmas = {self.cfg.train.spike_sigmas:g}")
        # The update that made the loss was step - 1's: a checkpoint from before it is wanted.
        if self.rewinds_left and self._checkpoint_at_or_before(int(step) - 2):
            raise LossSpike(f"a loss spike at {what}", int(step))
        log.warning("a loss spike at %s; logged only (%s)", what, "no train.rewinds left" if not self.rewinds_left
                    else f"no checkpoint from before step {int(step) - 1} to go back to, but a stop's, which a "
                         "rewind does not take" if self._checkpoint_at_or_before(int(step) - 2, scheduled=False)
                    else f"no checkpoint from before step {int(step) - 1} to go back to")
        self.spikes.append({"step": int(step), "loss": spiked, "mean": mean, "std": std})

    def _batch(self, inputs: torch.Tensor, targets: torch.Tensor,
               depths: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A batch of whole sequences as this rank feeds it to the model: its part of each
        sequence under context parallelism, on the device; with the document ids of the whole
        sequences when attention stays within documents (else None); with `depths` (training's
        multi-token prediction), the targets of each depth beside the next tokens (shifted_targets)."""
        documents = None
        if self.eos_id is not None:
            documents = document_ids(inputs, self.eos_id)
            documents = (documents.pin_memory() if self.device.type == "cuda" else documents).to(
                self.device, non_blocking=True)  # (as inputs and targets below)
        if depths:  # (taken on whole sequences)
            targets = shifted_targets(targets, depths)
        if self.layout.cp > 1:
            inputs, targets = (shard_sequence(t, self.cp_rank, self.layout.cp) for t in (inputs, targets))
        if self.device.type == "cuda":
            # From page-locked memory the copy is queued behind the GPU's work and the host goes
            # on (from pageable memory it would wait for the copy to finish). The prefetcher
            # pins whole batches; context-parallel slices of them and multi-token prediction's
            # shifted targets are copies, pinned here.
            inputs, targets = (t if t.is_pinned() else t.pin_memory() for t in (inputs, targets))
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True), documents

    def _prime_pipeline(self, microbatches: int) -> None:
        """Run the pipeline schedule once on a made-up batch and drop what it left. Its first
        run infers what passes between the stages by a forward and a backward of a micro-batch
        (torch 2.13), which a mixture's blocks would count as a micro-batch of training: their
        expert loads (which move the biases) and balancing losses would then depend on where a
        run started, and a resumed run would differ from one that never stopped. The tallies of the
        z-loss and of multi-token prediction would likewise count that micro-batch (tensors the
        inference makes up)."""
        self.pipeline_primed.add(microbatches)
        # Varied tokens (a batch of one token would route every token to the same experts, and
        # under expert parallelism pile them on one rank), from a generator of its own: the
        # global random state stays as a run that never stopped has it.
        tokens = torch.randint(self.cfg.model.vocab, (microbatches * self.cfg.train.micro_batch, self.cfg.data.seq_len),
                               generator=torch.Generator().manual_seed(0))
        self._pipeline(*self._batch(tokens, tokens), microbatches=microbatches)
        self._zero_grad()
        forget_counts(self.model)

    def _pipeline(self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None,
                  microbatches: int) -> list[torch.Tensor]:
        """Train on this rank's share of the batch through the pipeline schedule: inputs enter
        at the first stage, targets at the last, which returns the loss of each micro-batch;
        document ids go to every stage (the schedule cuts keyword arguments into micro-batches too)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.parallel.first else ()
        kwargs = {"targets": targets, "target": targets, "losses": losses} if self.parallel.last else {}
        if documents is not None:
            kwargs["documents"] = documents
        with self.autocast():
            self.parallel.schedule_for(microbatches).step(*args, **kwargs)
        return losses

    def _norms_by_part(self, grads: bool) -> dict[str, float]:
        """The 2-norm of the gradients (or of the weights) of each part of the model (model_part),
        over every rank: pipeline stages add theirs over the pp ranks. Under muP, of the model
        with its multipliers written out (_written_out_squares)."""
        names = self.model_parts
        position = {name: i for i, name in enumerate(names)}
        named = [(name, p) for name, p in self.model.named_parameters()
                 if (p.grad is not None or not grads) and self.parallel.counts(p)]
        parts = [position[model_part(name)] for name, _ in named]
        squares = self._written_out_squares([p for _, p in named], parts, len(names), grads=grads)
        return {name: round(value, 6) for name, value in zip(names, squares.sqrt().tolist())}

    def _written_out_squares(self, params: list[torch.Tensor], parts: list[int] | None = None, count: int = 1,
                             grads: bool = True) -> torch.Tensor:
        """The squared 2-norms (count,) of the gradients (or with grads=False the weights) of
        `params` over every rank, param i in part parts[i] (see _squares; all in one by default),
        the second copy of anything held twice left out, summed over the pipeline stages. Under muP
        they are those of the model with its multipliers written out (optim.folded_multiplier): a
        weight holding a folded multiplier s counts s times its gradient, so that clipping and the
        logged norms are those of the parametrization whose factors carry over from the base width
        and depth, and 1 / s times itself, the weight that multiplier is applied to."""
        kept = [(p, part) for p, part in zip(params, parts or [0] * len(params), strict=True)
                if self.parallel.counts(p)]
        params, parts = [p for p, _ in kept], [part for _, part in kept]
        tensors = [p.grad for p in params] if grads else params
        each = [self.folded.get(id(p), 1.0) ** (1 if grads else -1) for p in params]
        multipliers = sorted(set(each)) or [1.0]
        if multipliers == [1.0]:
            squares = _squares(tensors, parts, count) if tensors else torch.zeros(count, device=self.device)
        else:  # (one part per (part, multiplier), weighted after the all-reduces)
            k = len(multipliers)
            index = [part * k + multipliers.index(s) for s, part in zip(each, parts)]
            key = tuple(multipliers)  # (made once: a host-to-device copy each step would wait)
            weights = self.folded_weights.get(key)
            if weights is None:
                weights = self.folded_weights[key] = torch.tensor(multipliers, device=self.device).square()
            squares = _squares(tensors, index, count * k).view(count, k) @ weights
        if self.layout.pp > 1:
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        return squares

    def _zero_grad(self) -> None:
        """Drop every gradient: the optimizer's parameters' and those no optimizer steps here."""
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.parallel.unstepped():
            param.grad = None

    def _clip_gradients(self, max_norm: float, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Clip the norm of the gradient of the whole model to max_norm; returns the norm before
        clipping (_written_out_squares: over every rank, and under muP with its multipliers
        written out, the same scaling of every gradient then being the same training). Sharded
        gradients (DTensors) give the global norm of their dimensions; pipeline stages add up their
        squares over the pp ranks. `scale`: float16's loss scale, which the gradients carry and
        lose here, in the same multiplication."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self._written_out_squares(params)[0].sqrt()
        if scale is not None:
            norm = norm / scale
        # Scaling by one number is the same on each shard as on the whole: scaling the local
        # shards skips DTensor's sharding propagation for a list of differently placed tensors,
        # which cost more than the rest of the step on a small tensor-parallel model.
        grads = [local_shard(p.grad) for p in params]
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grads_with_norm_
        torch._foreach_mul_(grads, factor if scale is None else factor / scale)
        return norm

    def _mean_balance(self, tally: tuple[torch.Tensor, int]) -> float | None:
        """The balancing loss per mixture block and micro-batch over every rank (pipeline stages
        hold different blocks, or none: each rank takes part): one all-reduce of (sum, count).
        None if no rank counted any."""
        total, count = tally
        both = torch.stack([total.to(self.device, torch.float32), torch.tensor(float(count), device=self.device)])
        if dist.is_initialized():
            dist.all_reduce(both)
        total, count = both.tolist()
        return total / count if count else None

    def _tally_mean(self, tally: Tally | None) -> float | None:
        """The mean of what `tally` summed over the step just taken, over the global batch (one
        all-reduce of a sum and a count): the z-loss's log²Z per token (tensor-parallel ranks
        count each token alike, earlier pipeline stages count none), multi-token prediction's
        loss per micro-batch. None without the tally, or with nothing counted."""
        if tally is None:
            return None
        zero = torch.zeros((), device=self.device)
        both = torch.stack([zero if tally.total is None else tally.total.float(),
                            zero if tally.count is None else tally.count.float()])
        if dist.is_initialized():
            dist.all_reduce(both)
        total, count = both.tolist()
        return total / count if count else None

    def _mean_over_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a per-rank scalar over the ranks that run the last pipeline stage (all
        ranks without pipelining): each saw an equal share of the batch or of its sequences.
        Reduced on the device, on every rank; nothing waits for it until it is read."""
        if not dist.is_initialized():
            return value
        total = value.detach().float().clone()
        dist.all_reduce(total)
        return total / (dist.get_world_size() // self.layout.pp)

    def _last_checkpoint_hint(self) -> str:
        done = checkpoint.complete_checkpoints(self.ckpt_root)
        return f" ({done[0]})" if done else " (there is none yet)"

    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], dict[str, float] | None]:
        """Mean loss per token over each source's fixed validation windows, and — where the
        tokenizer's pieces say their bytes (data/tokenizer.token_bytes) — bits per byte: the same windows' loss in bits over the bytes of
        text their tokens stand for (the ends of documents are predicted, and count, but hold no
        byte), which compares across tokenizers."""
        by_source, bits, _ = self._validation_losses(self.cfg.data.sources)
        return by_source, bits

    @torch.no_grad()
    def evaluate_heldout(self) -> tuple[dict[str, float], dict[str, float] | None]:
        """evaluate()'s losses (and bits per byte) of eval.data's held-out sets."""
        losses, bits, _ = self._validation_losses(self.cfg.eval.sources, count_tokens=False)
        return losses, bits

    def _validation_losses(self, sources: dict[str, Path], count_tokens: bool = True):
        self.model.eval()
        by_source, bits, measured = {}, {}, 0
        for name, path in sources.items():
            total, count, text_bytes = 0.0, 0, 0
            for inputs, targets in eval_batches(path, self.cfg.data.seq_len, self.cfg.eval.tokens,
                                                self.cfg.train.micro_batch, self.dp_rank, self.layout.dp):
                inputs, targets, documents = self._batch(inputs, targets)
                with self.autocast():
                    if self.parallel.forward is None:
                        loss = self.model(inputs, targets, documents=documents)
                    else:  # pipelined: the last stage has the logits, the others contribute nothing
                        logits = self.parallel.forward(inputs if self.parallel.first else None, documents)
                        loss = None if logits is None else cross_entropy(logits, targets)
                n = (targets != IGNORE).sum().item()
                if loss is not None and n:  # a batch of padding only has a loss of nan
                    total += _local(loss).item() * n
                    count += n
                    if self.token_bytes is not None:
                        text_bytes += self.token_bytes[targets[targets != IGNORE]].sum().item()
            total, count, text_bytes = _sum_over_ranks([total, count, text_bytes])
            measured += int(count) // self.layout.tp  # (the ranks of a tensor-parallel group count alike)
            by_source[name] = total / count
            bits[name] = total / math.log(2) / text_bytes if text_bytes else None
        self.model.train()
        if count_tokens:
            self.eval_tokens = measured  # (the tokens predicted over every source, for the eval record)
        return by_source, (bits if self.token_bytes is not None else None), measured

    @torch.no_grad()
    def task_scores(self, task: Task) -> np.ndarray:
        """Each row's summed log-probability of its choice (see train/tasks.py), on every rank.
        Rows are spread over the data-parallel ranks, micro-batches of them, as many on each, each
        micro-batch as long as its longest row (rounded up to a multiple of 64 and of what tensor
        and context parallelism split, at most data.seq_len); the log-probabilities come from the
        whole vocabulary at the choices' positions only (from tensor parallelism's split logits
        without gathering them: loss.target_log_probs), the ranks holding a part of a row
        (context parallelism) add theirs, and one all-reduce gives every rank all of them (the
        tensor-parallel and earlier pipeline ranks, which hold no other part, add nothing)."""
        rows, seq_len = self.cfg.train.micro_batch, self.cfg.data.seq_len
        count = len(task.inputs)
        mine = np.arange(self.dp_rank, count, self.layout.dp)
        scores = torch.zeros(count, dtype=torch.float64)
        adds = self.parallel.last and self.layout.coordinates(self.rank)["tp"] == 0
        unit = math.lcm(64, self.layout.tp, 2 * self.layout.cp)
        for start in range(0, -(-count // self.layout.dp), rows):
            chosen = mine[start:start + rows]
            longest = int(task.lengths[chosen].max()) if len(chosen) else 1
            # (Under context parallelism whole windows: its attention is built for data.seq_len's chunks.)
            length = seq_len if self.layout.cp > 1 else min(-(-longest // unit) * unit, seq_len)
            x = np.zeros((rows, length), dtype=np.int64)
            y = np.full((rows, length), IGNORE, dtype=np.int64)
            width = min(length, task.inputs.shape[1])  # (a task's rows are only as wide as its longest)
            x[:len(chosen), :width] = task.inputs[chosen, :width]
            y[:len(chosen), :width] = task.targets[chosen, :width]
            inputs, targets, documents = self._batch(torch.from_numpy(x), torch.from_numpy(y))
            with self.autocast(loss_parallel=False):
                if self.parallel.forward is None:
                    logits = self.model(inputs, documents=documents)
                else:
                    logits = self.parallel.forward(inputs if self.parallel.first else None, documents)
            if logits is None:
                continue
            picked = target_log_probs(logits, targets)  # (split logits: collectives of all the tensor-parallel ranks)
            if not adds:
                continue
            sums = torch.zeros(rows, dtype=torch.float64, device=picked.device)
            sums.index_add_(0, (targets != IGNORE).nonzero()[:, 0], picked.double())
            scores[torch.from_numpy(chosen)] += sums[:len(chosen)].cpu()
        if dist.is_initialized():
            scores = scores.to(self.device)
            dist.all_reduce(scores)
        return scores.cpu().numpy()

    def evaluate_tasks(self, beat: Callable[[], None] = lambda: None) -> dict[str, dict[str, float]]:
        """eval.tasks' metrics: task name -> accuracy, accuracy_norm, nll; `beat` after each task
        (the watchdog's: a long evaluation is not a hang)."""
        self.model.eval()
        results = {}
        for task in self.tasks:
            results[task.name] = task_metrics(task, self.task_scores(task))
            beat()
        self.model.train()
        return results

    def evaluation(self, beat: Callable[[], None] = lambda: None) -> dict:
        """What an eval record holds: the validation loss (of a mixture, each source's at its
        training weight) and each source's; the same in bits per byte (bits_per_byte,
        bits_per_byte_by_source) where the tokenizer's pieces say their bytes; with eval.tasks, each task's
        metrics by kind (task_accuracy, task_accuracy_norm, task_nll: task name -> value). `beat`
        after each part."""
        by_source, bits = self.evaluate()
        beat()
        heldout, heldout_bits = self.evaluate_heldout() if self.cfg.eval.data else ({}, None)
        beat()
        tasks = self.evaluate_tasks(beat=beat)
        weights = self.cfg.data.weights
        averaged = {}
        if self.ema is not None:  # train.ema_decay: the moving average's loss too
            with self.ema_weights():
                averaged, _ = self.evaluate()
            beat()
        return {"loss": sum(weights[name] * loss for name, loss in by_source.items()),
                "loss_by_source": by_source, "measured_tokens": self.eval_tokens,
                **({"ema_loss": sum(weights[name] * loss for name, loss in averaged.items())} if averaged else {}),
                **({"bits_per_byte": sum(weights[name] * value for name, value in bits.items()),
                    "bits_per_byte_by_source": bits} if bits and None not in bits.values() else {}),
                **({"heldout_loss": heldout} if heldout else {}),
                **({"heldout_bits_per_byte": heldout_bits} if heldout_bits and None not in heldout_bits.values()
                   else {}),
                **{f"task_{key}": {name: round(result[key], 6) for name, result in tasks.items()}
                   for key in ("accuracy", "accuracy_norm", "nll") if tasks}}

    def mfu(self, tokens_per_s: float, causal: bool = False) -> float | None:
        """Model FLOPs utilisation of the job's tokens/s against the peak of all its devices:
        attention counted over the whole score matrix (PaLM's and nanoGPT's convention), or
        with causal=True over the half a causal kernel computes."""
        if self.peak_flops is None:
            return None
        flops = tokens_per_s * (self.causal_flops_per_token if causal else self.flops_per_token)
        return flops / (self.peak_flops * self.layout.world_size)

    # -- the loop ---------------------------------------------------------------------------

    def _scheduled_look(self, step: int) -> bool:
        """Whether the loop looks at `step` (reads its loss and norm on the host) by its schedule:
        the last step, one it checkpoints, logs or evaluates at; a stop looks at its step besides."""
        cfg = self.cfg
        return step == self.total_steps or self._save_due(step) \
            or any(interval and step % interval == 0 for interval in (cfg.log.interval, cfg.eval.interval))

    def _next_scheduled_look(self, after: int) -> int:
        return next(k for k in range(after + 1, self.total_steps + 1) if self._scheduled_look(k))

    def _save_due(self, step: int) -> bool:
        """Whether a checkpoint is due after step `step` (the end's aside): at a multiple of
        checkpoint.interval, or with "auto" at the step chosen (_auto_interval) and at every multiple
        of keep_every."""
        interval, keep_every = self.cfg.checkpoint.interval, self.cfg.checkpoint.keep_every
        if interval != "auto":
            return bool(interval) and step % interval == 0
        return step == self.next_save or bool(keep_every) and step % keep_every == 0

    def _auto_interval(self, blocking_s: float, step_s: float) -> dict:
        """checkpoint.interval = "auto": the steps to the next checkpoint, Daly's interval (about
        sqrt(2 x blocking x MTBF); plan/cost.py) — never below the save's own blocking — in whole
        steps by the planner's rule (the fewer or the more, whichever the rest of the run expects
        to take less wall-clock with, at the planner's restart time; the background write, which
        is not measured here, left out of that expectation), from the largest
        blocking and step time over the ranks (so that every rank chooses the same step); what the
        checkpoint record keeps of it."""
        measured = torch.tensor([blocking_s, step_s], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        blocking_s, step_s = measured.tolist()
        rate = self.cfg.checkpoint.failures_per_device_hour
        mtbf_s = 3600 / (rate * self.layout.world_size) if rate else None
        seconds = max(checkpoint_interval(blocking_s, mtbf_s), blocking_s) if mtbf_s else 3600.0
        step_s = max(step_s, 1e-9)
        left_s = (self.total_steps - self.step) * step_s
        steps = whole_steps(seconds, step_s, lambda k: expected_wall_s(
            left_s, k * step_s, blocking_s, blocking_s, mtbf_s or math.inf, Reliability().restart_s),
            shortest=max(1, math.ceil(blocking_s / step_s)))
        self.next_save = self.step + steps
        return {"interval_steps": steps, "measured_blocking_s": blocking_s, "measured_step_s": step_s,
                "mtbf_s": mtbf_s}

    def _setup_s(self) -> float:
        """Seconds from the process's start to its first step: building and laying out the
        model, loading a checkpoint, opening the data."""
        return round(time.time() - self.launched, 3)

    def _losses_reached(self) -> tuple[float | None, float | None]:
        """The run's last recorded train and validation losses (of an invocation that logged none)."""
        return tuple(next((r["loss"] for r in reversed(read_metrics(self.run_dir, kind))), None)
                     for kind in ("train", "eval"))

    def fit(self, stop_at_step: int | None = None, deadline: float | None = None) -> TrainResult:
        """Train (or resume) to the run's end, or through `stop_at_step`, or — once time.time()
        reaches `deadline` (train --time-limit) — through the step under way, then save and stop."""
        # One run trains in a directory at a time: a second (launched twice, a job requeued while
        # the first still runs) would resume from the first's checkpoints and both write them.
        # The directory is held before the checkpoint is chosen (a run that waited for it resumes
        # what the other saved meanwhile), or, where there is none yet, once it is made.
        held = [self._hold_run_dir(wait=True)] if any_rank(self.run_dir.is_dir()) else []
        try:
            return self._fit(stop_at_step, held, deadline)
        finally:
            if held and self.pending is not None:  # (an error's way out: its background write ends first)
                self.pending.settle()
            checkpoint.release_run_dir(held[0] if held else None)

    def _hold_run_dir(self, wait: bool):
        """The run directory's lock (rank 0's; None on the others), or ConfigError on every rank
        where another run holds it. With `wait`, under a scheduler or a restart it waits a while:
        the process of a node it replaces may not have ended yet (a shared filesystem's lock
        outlives a lost node by its lease)."""
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        scheduled = restarted or any(key in os.environ for key in ("SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST"))
        lock, held = (checkpoint.hold_run_dir(self.run_dir, RUN_DIR_WAIT_S if wait and scheduled else 0.0)
                      if self.is_main else (None, None))
        try:
            refused = any_rank(held is not None)
        except BaseException:
            checkpoint.release_run_dir(lock)
            raise
        if refused:
            self.loader.close()
            error = ConfigError(held or "the run directory is in use by another run (rank 0's error says which); "
                                "wait for it to end, or choose another run.name")
            if wait and scheduled:  # (not lasting: torchrun, or the scheduler, may start it again to wait again)
                raise error from TimeoutError(f"waited {RUN_DIR_WAIT_S:.0f} s for the run directory")
            raise error
        return lock

    def _fit(self, stop_at_step: int | None, held: list, deadline: float | None = None) -> TrainResult:
        """fit's work, the run directory held where it exists (`held`: its lock, once taken)."""
        resumed_from = self.resume()  # (a resume refused leaves no run directory behind)
        if stop_at_step is not None and resumed_from is not None and stop_at_step <= resumed_from < self.total_steps:
            self.loader.close()
            raise ConfigError(f"--stop-at-step {stop_at_step} is not after step {resumed_from}, where the run resumes: "
                              "it would train nothing; give a later step, or none to train to the end")
        if resumed_from is not None and resumed_from == self.total_steps:
            # Finished before: nothing to train, so nothing recorded either (a resume and an end in
            # metrics.jsonl would be counted as a restart by the run's report, minutes of it).
            self.loader.close()
            return TrainResult(self.run_dir, self.step, self.total_steps, self.tokens, *self._losses_reached(), None,
                               resumed_from)
        # (not found at the first save, after the steps before it; every rank looks, and all stop
        # together: one node's read-only mount would otherwise leave the others waiting in a step)
        problem = checkpoint.unwritable(self.ckpt_root)
        if any_rank(problem is not None):
            self.loader.close()
            raise checkpoint.CheckpointError(problem or "another process of this run cannot write its checkpoints (its "
                                             "own error says why); make the checkpoint directory writable on every node")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not held:  # (a new run: another that began beside it is refused at once)
            held.append(self._hold_run_dir(wait=False))
        checkpoint.sign_run_dir(held[0])
        return self._train(resumed_from, stop_at_step, deadline)

    def _train(self, resumed_from: int | None, stop_at_step: int | None, deadline: float | None = None) -> TrainResult:
        """fit's training, the run directory held."""
        cfg = self.cfg
        params = param_counts(cfg.model)
        ramp = "".join(f"{batch:,} tokens until {until:,}, then " for batch, until in cfg.train.batch_ramp)
        log.info("%s: %s parameters (%s non-embedding), %.3g FLOPs per token; %d steps of %s%s tokens on %s (%s)",
                 self.run_dir, f"{params['total']:,}", f"{params['non_embedding']:,}", self.flops_per_token,
                 self.total_steps, ramp, f"{cfg.train.global_batch_tokens:,}", self.device,
                 str(self.dtype).removeprefix("torch."))
        if self.is_main:  # one writer of the run directory's files
            (self.run_dir / "config.toml").write_text(cfg.to_toml())
            tokenizer = next(iter(cfg.data.sources.values())) / "tokenizer.json"
            if tokenizer.is_file() and not (self.run_dir / "tokenizer.json").is_file():
                shutil.copyfile(tokenizer, self.run_dir / "tokenizer.json")
            elif not tokenizer.is_file():
                log.warning("%s has no tokenizer.json: the run trains on its tokens, but cannot be exported, "
                            "sampled from or scored in bits per byte without it (copy it into the run directory)",
                            tokenizer.parent)
        sinks = []
        if self.is_main and cfg.log.wandb_project:  # first: the one that can fail to start
            sinks.append(WandbSink(self.run_dir, cfg.log.wandb_project, cfg.run.name, cfg.model_dump()))
        if self.is_main and cfg.log.tensorboard:
            sinks.append(TensorBoardSink(self.run_dir / "tensorboard", resumed_from))
        metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.is_main, sinks=sinks)
        profiler = StepProfiler(cfg.log.profile_steps, self.run_dir / "profile", self.rank, self.device.type == "cuda")
        heartbeat = Heartbeat(self.run_dir, enabled=self.is_main)
        if resumed_from is not None:
            beat = Heartbeat.read(self.run_dir)  # (the interrupted invocation's last step)
            metrics.write("resume", self.step, self.tokens, setup_s=self._setup_s(),
                          **({"last_alive": beat["time"]} if beat else {}))
        else:
            source = {}
            if self.init_from and self.init_from.kind == "checkpoint":
                source = self.init_from_checkpoint()
            elif self.init_from:
                source = {"init_from": str(self.init_from.path)}
            # bos_id: the token the data's documents begin with (null: none), which samples and the
            # export begin texts with too, wherever the data has gone since.
            bos = read_index(next(iter(cfg.data.sources.values()))).get("bos_id")
            metrics.write("start", 0, 0, total_steps=self.total_steps, flops_per_token=self.flops_per_token,
                          device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                          setup_s=self._setup_s(), bos_id=bos, **source)
            if cfg.train.ema_decay:
                self._ema_from({})  # from the run's first weights (init_from's, if it has them)
        train_loss = val_loss = None
        accounted = False
        window_tokens, window_steps, window_time, window_wait = 0, 0, 0.0, 0.0
        # Seconds of steps since the last train or checkpoint record, which the next one carries
        # (step_s): every step's time is in the record of a step at or after it, none past a checkpoint.
        unrecorded = 0.0
        run_tokens, run_time = 0, 0.0
        since_save_time, since_save_steps = 0.0, 0  # the steps since the last checkpoint (checkpoint.interval = auto)
        if cfg.checkpoint.interval == "auto":  # the first save measures what the interval is chosen from
            self.next_save = self.step + max(1, min(AUTO_FIRST_SAVE, self.total_steps // 10))
        last_speed = None
        plan_checked = False  # (log.plan: once an invocation, from PLAN_CHECK_STEP on)
        plan_tokens, plan_time = 0, 0.0  # its steps of the global batch after the first: the speed it checks
        stopped_by, saved = None, None  # the signal that ends the run early; the last checkpoint
        # A gloo group of its own for the stop vote (resilience.py), as for background saves.
        signals = StopSignals(dist.new_group(backend="gloo") if dist.is_initialized() else None)
        signals.install()
        # Every rank records its own hang (with its rank): a hung rank's exit may end rank 0 first.
        watchdog = Watchdog(cfg.train.hang_timeout_s, on_hang=lambda quiet: metrics.write_from_any_rank(
            "hang", self.step, self.tokens, seconds=round(quiet, 1), rank=self.rank),
            progress=lambda: checkpoint.bytes_on_disk(self.ckpt_root))
        finished = False
        # The tokens to this invocation's end, and (tokens, time, batch) after its first step, which
        # pays one-off costs, the first since a rewind, or the first of a larger batch (a batch
        # ramp's smaller steps cost more time per token): the time left said with each logged step
        # is at the pace of the tokens since then, evaluations and checkpoints included.
        end_tokens = cfg.tokens_before(self.total_steps if stop_at_step is None
                                       else min(stop_at_step, self.total_steps))
        steady: tuple[int, float, int] | None = None
        try:
            while (self.step < self.total_steps and (stop_at_step is None or self.step < stop_at_step)
                   and stopped_by is None):
                t0 = time.perf_counter()
                stopped_by = signals.stop_before_next_step(deadline)  # then this step is the last
                # Loss and norm reach the host only at the steps that use them (train_step).
                coming = self.step + 1
                scheduled = self._scheduled_look(coming)
                # A stop looks at its step too (nothing unchecked is saved); the noise scale takes in
                # the scheduled looks only, which a resumed run shares with one that never stopped.
                look = scheduled or stopped_by is not None or coming == stop_at_step
                try:
                    with profiler.step(coming):
                        train_loss, grad_norm, wait = self.train_step(look=look, estimate_noise=scheduled)
                except TrainingDiverged as e:
                    t_rewind = time.perf_counter()
                    try:
                        # Found at a look only a stop made: the batches of the steps up to the next look
                        # the schedule makes, where a run that never stopped finds it, are skipped too.
                        through = (self._next_scheduled_look(coming)
                                   if not scheduled and self.optimizer.defaults.get("fused") else None)
                        rewound = (self.rewind(e.step, spike=isinstance(e, LossSpike), through=through)
                                   if self.rewinds_left else None)
                    except checkpoint.CheckpointError as failed:  # no checkpoint could be loaded
                        raise e from failed
                    if rewound is None:
                        raise
                    saved, skipped, discarded = rewound
                    self.rewinds_left -= 1
                    steady = None  # (the steps trained again would slow the pace said)
                    # The steps trained since the last train or checkpoint record (the diverged one's
                    # included) are trained again (lost_s); going back took seconds.
                    metrics.write("rewind", self.step, self.tokens, diverged_at=e.step, checkpoint=str(saved),
                                  skipped_steps=skipped, cause=e.cause, discarded=discarded, message=str(e),
                                  lost_s=round(unrecorded + t_rewind - t0, 4),
                                  seconds=round(time.perf_counter() - t_rewind, 4))
                    window_tokens, window_steps, window_time, window_wait = 0, 0, 0.0, 0.0
                    unrecorded = 0.0
                    log.warning("%s; rewound to %s, skipping the %d steps' batches read since%s (%d rewinds left)",
                                str(e).split(" and nothing was saved")[0], saved, skipped,
                                f" and discarding {', '.join(discarded)}" if discarded else "", self.rewinds_left)
                    watchdog.beat()
                    continue
                watchdog.beat()  # the first beat arms it
                heartbeat.beat(self.step)
                batch_now = cfg.step_batch_tokens(self.step - 1)
                if steady is None or batch_now != steady[2]:
                    steady = (self.tokens, time.perf_counter(), batch_now)
                for spike in self.spikes:  # (those with no rewind left: the run went on)
                    metrics.write("spike", spike["step"], self.cfg.tokens_before(spike["step"]),
                                  **{k: round(v, 6) for k, v in spike.items() if k != "step"})
                self.spikes.clear()
                if not accounted:
                    by_rank = _gather_over_ranks(self.held_bytes)
                    metrics.write("memory", self.step, self.tokens, bytes_by_rank=by_rank)
                    log.info("bytes held by rank 0: %s", ", ".join(f"{k} {v:,}" for k, v in by_rank[0].items()))
                    accounted = True
                elapsed = time.perf_counter() - t0
                if self.step > (resumed_from or 0) + 1:  # (as run_time: the first step pays one-off costs)
                    since_save_time += elapsed
                    since_save_steps += 1
                step_tokens = self.cfg.step_batch_tokens(self.step - 1)
                window_tokens += step_tokens
                window_steps += 1
                window_time += elapsed
                unrecorded += elapsed
                window_wait += wait
                if self.step > (resumed_from or 0) + 1:  # this process's first step pays one-off costs
                    run_tokens += step_tokens
                    run_time += elapsed
                    if step_tokens == cfg.train.global_batch_tokens:  # (not a batch ramp's smaller steps)
                        plan_tokens += step_tokens
                        plan_time += elapsed
                last = self.step == self.total_steps or self.step == stop_at_step or stopped_by is not None
                profiler.after(self.step, last)
                if self.step % cfg.log.interval == 0 or last:
                    last_speed = window_tokens / window_time
                    record = metrics.write(
                        "train", self.step, self.tokens, loss=train_loss, lr=self.lr, grad_norm=grad_norm,
                        step_s=round(unrecorded, 4), tokens_per_s=round(last_speed, 1), mfu=self.mfu(last_speed),
                        mfu_causal=self.mfu(last_speed, causal=True),
                        mem_gb=round(peak_memory_gb(self.device), 3),
                        data_wait_ms=round(1000 * window_wait / window_steps, 3),
                        tokens_by_source=self.loader.tokens_by_source(),
                        epochs_by_source={k: round(v, 6) for k, v in self.loader.epochs_by_source().items()},
                        **({"z_loss": self.z_loss_value} if self.z_tally is not None else {}),
                        **({"loss_scale": self.loss_scale[0].item()} if self.scaling else {}),
                        **({"mtp_loss": self.mtp_loss_value} if self.mtp_tally is not None else {}),
                        **(self.noise or {}), **(self.norms or {}),
                        **({"moe_balance": round(self.moe_balance, 5)} if self.moe_balance is not None else {}),
                        **({"moe_max_load": round(self.moe_max_load, 4)} if self.moe_max_load is not None else {}))
                    left = ""
                    if self.tokens > steady[0] and self.tokens < end_tokens and stopped_by is None:
                        per_token = (time.perf_counter() - steady[1]) / (self.tokens - steady[0])
                        left = f"  {duration(per_token * (end_tokens - self.tokens))} left"
                    log.info("step %d/%d  loss %.4f  lr %.2e  grad %.3f  %.0f tok/s%s%s", self.step, self.total_steps,
                             train_loss, self.lr, grad_norm, last_speed,
                             f"  mfu {record['mfu']:.1%}" if record["mfu"] is not None else "", left)
                    window_tokens, window_steps, window_time, window_wait = 0, 0, 0.0, 0.0
                    unrecorded = 0.0
                    if (self.plan is not None and not plan_checked and self.step >= PLAN_CHECK_STEP
                            and cfg.step_batch_tokens(self.step - 1) == cfg.train.global_batch_tokens and plan_time):
                        plan_checked = True
                        speed = plan_tokens / plan_time  # (a CPU's peak is its resident memory: not the plan's tensors)
                        metrics.write("plan_check", self.step, self.tokens, **self.check_against_plan(
                            speed, self.mfu(speed), record["mem_gb"] if self.device.type == "cuda" else None))
                self.finish_saving(wait=False)
                due = self._save_due(self.step) or self.step == self.total_steps
                if due or last:
                    t_save = time.perf_counter()
                    path = saved = self.save(scheduled=due)
                    # What training waited for: the whole save, or its copy to host memory.
                    blocking = time.perf_counter() - t_save
                    auto = (self._auto_interval(blocking, since_save_time / since_save_steps if since_save_steps
                                                else elapsed) if self.next_save is not None and not last else {})
                    since_save_time, since_save_steps = 0.0, 0
                    metrics.write("checkpoint", self.step, self.tokens, path=str(path), blocking_s=round(blocking, 4),
                                  background=cfg.checkpoint.async_save, step_s=round(unrecorded, 4), **auto)
                    unrecorded = 0.0
                    watchdog.beat()
                if (cfg.eval.interval and self.step % cfg.eval.interval == 0) or self.step == self.total_steps:
                    t_eval = time.perf_counter()
                    record = self.evaluation(beat=watchdog.beat)
                    val_loss = record["loss"]
                    metrics.write("eval", self.step, self.tokens, **record,
                                  seconds=round(time.perf_counter() - t_eval, 4))
                    log.info("step %d/%d  validation loss %.4f%s%s%s", self.step, self.total_steps, val_loss,
                             f" ({record['bits_per_byte']:.4f} bits/byte)" if "bits_per_byte" in record else "",
                             f"  moving average {record['ema_loss']:.4f}" if "ema_loss" in record else "",
                             "".join(f"  {name} {accuracy:.1%}"
                                     for name, accuracy in record.get("task_accuracy", {}).items()))
            self.finish_saving(wait=True)  # the run's last checkpoint is complete before it returns
            if self.stager:
                self.stager.close()
                self.stager = None
            consumption = {"tokens_by_source": self.loader.tokens_by_source(),
                           "epochs_by_source": self.loader.epochs_by_source()}
            heartbeat.beat(self.step, force=True)
            metrics.write("end", self.step, self.tokens, train_loss=train_loss, val_loss=val_loss,
                          complete=self.step == self.total_steps,
                          stopped_by=stop_name(stopped_by), **consumption)
            # What the run consumed of each source, for people and tools (also in the end record).
            if self.is_main:
                (self.run_dir / "stats.json").write_text(json.dumps(
                    {"step": self.step, "tokens": self.tokens, **consumption}, indent=1) + "\n")
            finished = True
        except TrainingDiverged as e:
            self.finish_saving(wait=True)  # it holds the last good state
            metrics.write("diverged", self.step, self.tokens, message=str(e))
            raise
        finally:
            signals.uninstall(finished)
            watchdog.close()
            profiler.close()
            metrics.close()
            self.loader.close()
        if stopped_by == TIME_LIMIT and self.step < self.total_steps:
            raise StoppedAtTimeLimit(deadline, self.step, str(saved))
        if stopped_by is not None and self.step < self.total_steps:
            raise StoppedBySignal(stopped_by, self.step, str(saved))
        if train_loss is None:  # no step logged by this invocation: what the run reached
            train_loss, val_loss = self._losses_reached()
        speed = run_tokens / run_time if run_time else last_speed
        uniform = math.log(self.cfg.model.vocab_size)  # the loss of predicting every token alike
        if self.step == self.total_steps and train_loss is not None and train_loss > uniform + 0.5 and self.is_main:
            log.warning("the run ended at a train loss of %.4g, above %.4g = ln(vocabulary), the loss of predicting "
                        "every token alike: it diverged or learned nothing (lower train.lr, set train.clip, or turn "
                        "on train.spike_sigmas to rewind a spike)", train_loss, uniform)
        return TrainResult(self.run_dir, self.step, self.total_steps, self.tokens, train_loss, val_loss, speed,
                           resumed_from)


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               ema: dict[str, torch.Tensor] | None = None, unstepped: list[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (its shards only,
    under FSDP), and in the moving average of the weights (train.ema_decay): what
    plan/memory.py's model of per-device memory must predict exactly. unstepped: parameters
    held beside the model's (a pipeline's copy of the embedding, ParallelModel.unstepped)."""
    params = [*model.parameters(), *unstepped]
    unique = {id(p): p for p in params}.values()  # tied weights count once
    return {
        **({"ema": sum(_bytes(value) for value in {id(v): v for v in ema.values()}.values())} if ema is not None else {}),
        "parameters": sum(_bytes(p) for p in unique),
        "gradients": sum(_bytes(p.grad) for p in unique if p.grad is not None),
        "optimizer": sum(_bytes(v) for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor)),
    }


def _bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of `t`."""
    shard = local_shard(t)
    return shard.numel() * shard.element_size()


def _gather_over_ranks(value: dict) -> list[dict]:
    if not dist.is_initialized():
        return [value]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _local(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism) as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _sum_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return values
    # On the device NCCL runs on (it has no CPU tensors); gloo takes CPU tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)  # gloo has no AVG: sum, then divide where a mean is wanted
    return tensor.tolist()


def _flatten(config: dict) -> dict:
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def _changes(saved: Path | RunConfig, cfg: RunConfig) -> tuple[dict, str]:
    """What `cfg` changes of the config a run saved (its file, or that loaded) ({key: (then,
    now)}), and of that, what a resume cannot take (the model, data.seq_len, the data order's seed,
    train.optimizer: its checkpoints' shapes and data order), said as "key A then, B now, ..."
    ("" for nothing)."""
    then = saved if isinstance(saved, RunConfig) else load_config(saved)
    before, now = _flatten(then.model_dump()), _flatten(cfg.model_dump())
    changed = {key: (before.get(key), now.get(key)) for key in sorted(set(before) | set(now))
               if before.get(key) != now.get(key)}
    fixed = [key for key in changed
             if key.startswith("model.") or key in ("data.seq_len", "train.optimizer", "train.embedding_decay")
             or (key in ("run.seed", "data.seed") and then.data_seed != cfg.data_seed)]
    return changed, ", ".join(f"{key} {changed[key][0]} then, {changed[key][1]} now" for key in fixed)


def check_run_dir(cfg: RunConfig, warn: bool = True) -> None:
    """A run directory holds one run: refuse another command's output (data, a sweep: training
    would write into it), and to continue a run with another model, data or seed (`cfg`
    resolved; `warn`: log the settings a resume changes). ConfigError in one sentence; train
    --nproc asks before it starts any process."""
    run_dir = cfg.run_dir
    ckpt_root = run_dir / "checkpoints"
    found = kind_of(run_dir)
    if found not in (None, "run directory"):
        raise ConfigError(f"run directory {str(run_dir)!r} (run.dir/run.name) is a {found}, which training "
                          "would write into; choose another run.name or run.dir")
    if not checkpoint.committed_checkpoints(ckpt_root):
        return
    if cfg.checkpoint.resume == "never":
        raise ConfigError(f"run directory {str(run_dir)!r} already holds checkpoints and checkpoint.resume "
                          "= 'never'; choose a new run.name, delete them, or resume with checkpoint.resume = 'auto'")
    saved_tokenizer = run_dir / "tokenizer.json"
    data_tokenizer = next(iter(cfg.data.sources.values())) / "tokenizer.json"
    if (saved_tokenizer.is_file() and data_tokenizer.is_file()
            and saved_tokenizer.read_bytes() != data_tokenizer.read_bytes()):
        raise ConfigError(f"data.path = {cfg.data.path!r} has another tokenizer than the run in "
                          f"{str(run_dir)!r} was trained with; resume on the run's own data, "
                          "or choose a new run.name")
    saved = run_dir / "config.toml"
    if not saved.is_file():
        return
    before = load_config(saved)
    changed, fixed = _changes(before, cfg)
    if fixed:
        raise ConfigError(f"run directory {str(run_dir)!r} holds checkpoints of a different run ({fixed}); "
                          "choose a new run.name to start a new run")
    others = [key for key in changed if not key.startswith(("run.", "checkpoint.resume"))]
    if others and warn:
        log.warning("resuming %s with changed settings: %s", run_dir,
                    ", ".join(f"{key} {changed[key][0]} -> {changed[key][1]}" for key in others))
    schedule = [key for key in others if key.startswith("train.") and key.split(".")[1] in (*SCHEDULE_KEYS, *STEP_KEYS)]
    if schedule and warn:  # (the newest checkpoint: where a resume goes on, unless it is damaged)
        _warn_rescheduled(before, cfg, checkpoint.step_of(checkpoint.committed_checkpoints(ckpt_root)[0]),
                          schedule)


# How long a run started by a scheduler or a restart waits for its directory's previous holder
# (below the least collective timeout, which the other ranks wait in meanwhile: parallel/mesh.py).
RUN_DIR_WAIT_S = 120.0

# What else the learning rate of a step depends on (train.*, beside schedule.SCHEDULE_KEYS): the number of steps.
STEP_KEYS = ("tokens", "global_batch_tokens", "batch_ramp")


def _warn_rescheduled(before: RunConfig, now: RunConfig, step: int, keys: list[str]) -> None:
    """Say when a resume's changed schedule moves the learning rate where training goes on: a
    run extended past its decay (more train.steps under cosine or WSD) warms up again."""
    was, will = run_lr(before, step), run_lr(now, step)
    if abs(will - was) > 0.1 * was:
        log.warning("with %s changed, the learning rate after step %d is %.3g, where the schedule it trained with "
                    "gave %.3g%s", ", ".join(keys), step, will, was,
                    ": a run past its decay that trains on warms up again; to go on at a low rate, train a new stage "
                    "from it with its own schedule (checkpoint.init_from)" if will > was else "")


def train(cfg: RunConfig, stop_at_step: int | None = None, launched: float | None = None,
          deadline: float | None = None) -> TrainResult:
    """Train (or resume) the run `cfg` describes; stop cleanly after `stop_at_step` if given, or
    at `deadline` (see Trainer.fit). Under torchrun every process calls this; the layout comes
    from cfg.parallel. launched: when the process started (see Trainer)."""
    try:
        result = Trainer(cfg, launched=launched).fit(stop_at_step=stop_at_step, deadline=deadline)
    except (StoppedBySignal, StoppedAtTimeLimit):  # every rank stopped after the same step, its checkpoint complete
        shutdown()
        raise
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown()
    return result
