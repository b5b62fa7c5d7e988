"""The plan of a run, before it starts: which model and how many tokens (from a scaling law and a
compute budget, or as given), which layout on which hardware, and what it will take — memory per
device, step time, MFU, wall-clock with failures, device-hours, energy, cost — written as a
config that `scaletrain train` runs. Arithmetic, no torch. The layout is the search's best
(plan/search.py) or a config's own (`keep_layout`), with the search's best beside it.

Model shapes for a parameter count come from one family: widths multiples of 128 below 2048
with heads of 64, multiples of 1024 from 2048 with heads of 128; eight key/value heads
(grouped-query attention, as Llama 3), or as many as divide the heads (at least two), the default SwiGLU width, untied
embeddings (so that any pipeline split is open), and a depth near width / 128 — the aspect
ratio of Llama 3 8B (4096 / 32) and 405B (16384 / 126) and of GPT-3 175B (12288 / 96); the loss
depends little on it over a wide range (Kaplan et al. 2020, figure 5). Of the widths (multiples
of 128) and depths within a factor 1.5 of that ratio, the one with N closest to the target wins,
from 5B parameters (PIPELINED_SIZE: where pipelines begin to pay) a depth that does not halve
four times (into 2 to 16 pipeline stages) counted 2% further for each halving it lacks: such a
depth splits evenly over a power-of-two count of devices, where another needs stages of unequal
blocks (parallel.pp_stage_blocks), written into the config by the planner but not what a person
would guess, and with a slowest stage of a block more (what a miss of a few % in N costs in loss at a fixed budget is far below the law's
own interval: the IsoFLOP minimum is flat). From 13B to 405B every depth then splits into at
least 4 stages, within 5% of the N asked for.

Learning rate and batch follow the sweeps' rule (scaling/grid.py: DeepSeek LLM's η_opt(C) and
B_opt(C)) at the run's compute, the warmup as many tokens as parameters, the schedule
warmup-stable-decay (so that the run can be extended from any stable-phase checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.config import (ConfigError, ModelConfig, RunConfig, check_float16, float8_problem, float16_problems,
                               validate_config)
from scaletrain.model.flops import param_counts, train_flops_per_token
from scaletrain.parallel.layout import check_layout, resolve_layout
from scaletrain.plan.cost import Prices, Reliability, run_cost
from scaletrain.plan.hardware import Device
from scaletrain.plan.memory import choose_recompute, fsdp_dtype
from scaletrain.plan.search import USABLE_MEMORY, Candidate, PlanError, describe, layout_dtype, search
from scaletrain.plan.timing import Efficiency, PlanLayout, step_time
from scaletrain.scaling.grid import warmup_steps
from scaletrain.scaling.hparams import DEEPSEEK, HyperparameterLaw
from scaletrain.scaling.laws import ChinchillaLaw

ASPECT = 128  # width / depth
PIPELINED_SIZE = 5e9  # parameters from which the family prefers depths that pipelines split
MAX_LOST_TO_FAILURES = 0.9  # a plan that would lose more of its wall-clock to failures is refused


def model_for(n: float, vocab: int, seq_len: int) -> ModelConfig:
    """The family's shape whose parameter count (all of them) is nearest n (see the module's
    docstring)."""
    return nearest_shapes([n], vocab, seq_len)[0]


def nearest_shapes(ns: list[float], vocab: int, seq_len: int) -> list[ModelConfig]:
    """model_for of each of ns, the family walked once."""
    best: list[tuple[float, ModelConfig] | None] = [None] * len(ns)
    for dim in _widths():
        aim = dim / ASPECT
        for layers in range(max(1, math.floor(aim / 1.5)), math.ceil(aim * 1.5) + 1):
            cfg = _shape(dim, layers, vocab, seq_len)
            total = param_counts(cfg)["total"]
            for i, n in enumerate(ns):
                # (a depth that halves four times splits evenly over 2 to 16 pipeline ranks: another
                # only into stages of unequal blocks)
                splits = min(4, (layers & -layers).bit_length() - 1)
                miss = (abs(math.log(total / n)) + 0.01 * abs(math.log(layers / aim))
                        + (0.02 * (4 - splits) if n >= PIPELINED_SIZE else 0.0))
                if best[i] is None or miss < best[i][0]:
                    best[i] = (miss, cfg)
        if vocab * dim > 2 * max(ns):  # wider still only grows the embedding
            break
    return [cfg for _, cfg in best]


def _shape(dim: int, layers: int, vocab: int, seq_len: int) -> ModelConfig:
    head = 128 if dim >= 2048 else 64
    heads = dim // head
    return ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=math.gcd(heads, 8),
                       max_seq_len=seq_len, rope_theta=500000.0 if seq_len >= 4096 else 10000.0)


def _widths():
    """Multiples of 128 up to 2048, then of 1024 (whole groups of eight 128-wide heads)."""
    yield from range(128, 2048, 128)
    yield from range(2048, 65536 + 1, 1024)


@dataclass
class Hardware:
    device: Device
    count: int
    gpus_per_node: int
    efficiency: Efficiency = Efficiency()
    reliability: Reliability = Reliability()
    prices: Prices = Prices()

    @property
    def nodes(self) -> int:
        return max(1, self.count // self.gpus_per_node)

    def check(self) -> None:
        if self.count < 1:
            raise PlanError(f"--gpus {self.count}: plan for at least one device")
        if self.count > self.gpus_per_node and self.count % self.gpus_per_node:
            raise PlanError(f"{self.count} devices are not whole nodes of {self.gpus_per_node}; use a multiple of "
                            f"{self.gpus_per_node} (or set --gpus-per-node)")


@dataclass
class Sizing:
    """Why this model and these tokens: a law's choice for a budget, or as given."""

    kind: str  # "compute-optimal", "inference-aware", "data-constrained", "given"
    compute: float | None = None
    law: ChinchillaLaw | None = None
    bootstrap: list[ChinchillaLaw] = field(default_factory=list)
    inference_tokens: float = 0.0
    unique_tokens: float | None = None
    notes: dict = field(default_factory=dict)


def size(law: ChinchillaLaw, compute: float, vocab: int, seq_len: int, inference_tokens: float = 0.0,
         unique_tokens: float | None = None, bootstrap: list[ChinchillaLaw] = ()) -> tuple[ModelConfig, int, Sizing]:
    """The model and tokens a law chooses for `compute` FLOPs: compute-optimal; or, with
    inference tokens, Sardana et al.'s smaller model reaching the same loss; or, with a limit on
    unique tokens, Muennighoff et al.'s data-constrained optimum.

    The law's optimum assumes C = 6ND; the run spends its budget at the exact FLOPs per token
    (attention's 12·L·d·T included), which buy fewer tokens, the more so for small models on long
    sequences. So the shape trained is the family's of least predicted loss at the tokens it
    buys (L(N, C / F(N)); data-constrained, with repeats), among the shapes nearest the law's N
    times 4^(-1..1): at 1e20 FLOPs and sequences of 4,096, Epoch's law wants 0.84B parameters
    by 6ND, and the family's 0.60B is predicted 0.01 lower once attention is counted."""
    from scaletrain.scaling.optimal import Choice, compute_optimal, data_constrained_optimal, expected_loss, \
        inference_optimal, tokens_for_loss

    if inference_tokens and unique_tokens:
        raise PlanError("give inference tokens or unique tokens, not both: the planner sizes for one constraint")
    sizing = Sizing("compute-optimal", compute, law, list(bootstrap), inference_tokens, unique_tokens)
    if inference_tokens:
        choice, reference = inference_optimal(law, compute, inference_tokens)
        sizing.kind = "inference-aware"
        sizing.notes = {"compute_optimal_n": reference.n, "target_loss": reference.loss}
    elif unique_tokens:
        try:
            choice = data_constrained_optimal(law, compute, unique_tokens)
        except ValueError as e:
            raise PlanError(f"--unique-tokens: {e}") from None
        sizing.kind = "data-constrained"
    else:
        choice = compute_optimal(law, compute)
    if sizing.kind == "inference-aware":
        model = model_for(choice.n, vocab, seq_len)
    else:
        def loss(shape: ModelConfig) -> float:
            n, tokens = param_counts(shape)["total"], compute / train_flops_per_token(shape, seq_len)
            return expected_loss(law, n, tokens, unique_tokens)

        model = min(nearest_shapes([choice.n * 2 ** (k / 4) for k in range(-8, 9)], vocab, seq_len), key=loss)
    n = param_counts(model)["total"]
    if sizing.kind == "inference-aware":  # the tokens that bring this shape to the target loss
        tokens = tokens_for_loss(law, n, sizing.notes["target_loss"])
        if not math.isfinite(tokens):
            raise PlanError(f"the nearest shape ({n:,} parameters) cannot reach the target loss; plan more compute")
        # (what the shape planned saves, not the law's continuous optimum)
        planned = Choice.at(law, n, tokens, inference_tokens)
        sizing.notes["lifetime_flops_saved"] = reference.lifetime_flops - planned.lifetime_flops
    else:  # spend the budget: D = C / (exact FLOPs per token)
        tokens = compute / train_flops_per_token(model, seq_len)
    sizing.notes.update({"law_n": choice.n, "law_d": choice.d})
    return model, int(tokens), sizing


def predicted_loss(sizing: Sizing, n: int, tokens: int) -> dict | None:
    if sizing.law is None:
        return None
    from scaletrain.scaling.fit import interval
    from scaletrain.scaling.optimal import expected_loss

    out = {"value": expected_loss(sizing.law, n, tokens, sizing.unique_tokens), "source": sizing.law.source}
    if sizing.bootstrap:
        out["interval"] = list(interval([expected_loss(law, n, tokens, sizing.unique_tokens)
                                         for law in sizing.bootstrap]))
    return out


def make_plan(model: ModelConfig, tokens: int, seq_len: int, hardware: Hardware, *, batch_tokens: int | None = None,
              base: RunConfig | None = None, sizing: Sizing | None = None, data_path: str = "data/corpus",
              name: str | None = None, top: int = 5, hyperparameters: HyperparameterLaw = DEEPSEEK,
              keep_layout: bool = False, context_parallel: bool | None = None) -> dict:
    """The whole plan as a JSON-able dict (the keys of DESIGN.md's plan contract), with the config
    to train it under "config" (TOML). `batch_tokens` fixes the global batch; otherwise the
    rule's batch for the run's compute is the target each layout rounds to its data-parallel
    ranks. `base` is a config whose other settings the written config keeps. `hyperparameters`:
    the rule of the learning rate and batch (DeepSeek LLM's, or one `scaletrain hparams`
    measured), unless `base` sets them. `keep_layout`: plan `base`'s own layout (its parallel
    sizes over the devices, schedule, micro-batch, recomputation and loss chunks) rather than
    the search's best, which then come after it as the alternatives. `context_parallel`: search
    layouts that split sequences too (True), never (False), or only when nothing fits without
    them (None: plan/search.py's docstring says why)."""
    hardware.check()
    sizing = sizing or Sizing("given")
    per_token = train_flops_per_token(model, seq_len)
    compute = tokens * per_token
    lr, rule_batch = hyperparameters(compute, model.dim)
    dtype = {"float32": "fp32", "float16": "fp16"}.get(base.train.dtype, "bf16") if base is not None else "bf16"
    if base is not None and base.train.dtype == "bfloat16" and not hardware.device.bf16:
        raise PlanError(f"train.dtype = bfloat16, but {hardware.device.name} has no bfloat16; use auto (float16 with a "
                        "loss scale where it reaches, float32 elsewhere), float16 or float32")
    if base is not None and base.train.float8 and not hardware.device.float8:
        raise PlanError(float8_problem(False, hardware.device.name))
    fixed = batch_tokens is not None
    if fixed and batch_tokens % seq_len:
        raise PlanError(f"a global batch of {batch_tokens} tokens is not whole sequences of {seq_len}; use a multiple "
                        f"of {seq_len}")
    target = batch_tokens // seq_len if fixed else max(1, round(rule_batch / seq_len))
    if top < 1:
        raise PlanError(f"top = {top}: show at least the one best layout")
    # train.batch_ramp's steps of smaller batches (the layout must split them too), then the global batch.
    ramp = [(count, batch) for count, batch in base.batch_schedule() if batch != base.train.global_batch_tokens] \
        if base is not None else []
    searching = dict(gpus_per_node=hardware.gpus_per_node, efficiency=hardware.efficiency, dtype=dtype, top=top,
                     optimizer=base.train.optimizer if base is not None else "adamw",
                     ema=base is not None and base.train.ema_decay > 0, allow_cp=context_parallel,
                     float8=base is not None and base.train.float8,
                     ramp=tuple(batch // seq_len for _, batch in ramp))
    if keep_layout:
        if base is None:
            raise PlanError("keeping a config's layout needs the config")
        best = configured_layout(base, hardware, dtype)
        try:  # (at the config's batch, which the kept layout trains)
            others = search(model, seq_len, best.global_batch, hardware.count, hardware.device, fixed_batch=True,
                            **searching)
        except PlanError:  # (the config's fits where no layout the search builds does: none to compare)
            others = []
        ranked = [best, *[c for c in others if c.layout != best.layout]][:top]
    else:
        ranked = search(model, seq_len, target, hardware.count, hardware.device, fixed_batch=fixed, **searching)
        best = ranked[0]
    batch_tokens = best.global_batch * seq_len
    ramp_tokens = sum(steps * batch for steps, batch in ramp)
    steps = max(0 if ramp else 1, -(-(tokens - ramp_tokens) // batch_tokens))
    phases = []
    for count, batch in ramp:  # fewer micro-batches a step: the step's fixed costs weigh more
        time = step_time(model, seq_len, batch // seq_len, best.layout, hardware.device, hardware.efficiency,
                         hardware.gpus_per_node, best.dtype)
        phases.append({"batch_tokens": batch, "steps": count, "step_s": time.total,
                       "tokens_per_s": time.tokens_per_s, "mfu": time.mfu})
    train_s = steps * best.time.total + sum(phase["steps"] * phase["step_s"] for phase in phases)
    tokens = ramp_tokens + steps * batch_tokens
    steps += sum(phase["steps"] for phase in phases)
    state = best.memory.parameters + best.memory.optimizer + best.memory.ema  # what a checkpoint saves of each device
    # (With a ramp, its steps' mean time: the run's seconds are what the checkpoint and failure arithmetic needs.)
    cost = run_cost(steps, train_s / steps, hardware.count, hardware.nodes, state,
                    state * hardware.count / best.layout.dp_replicate, hardware.device.watts, hardware.reliability,
                    hardware.prices)
    if cost.lost_to_failures > MAX_LOST_TO_FAILURES:
        raise PlanError(f"{hardware.count} devices fail every {cost.mtbf_hours * 60:.0f} minutes at the assumed rate, "
                        f"too often for restarts of {hardware.reliability.restart_s:.0f} s: the run would spend "
                        f"{cost.lost_to_failures:.0%} of its wall-clock restarting and redoing steps; plan fewer devices, "
                        "a lower failure rate or quicker restarts")
    counts = param_counts(model)
    plan = {
        "model": {"dim": model.dim, "n_layers": model.n_layers, "n_heads": model.n_heads, "n_kv_heads": model.kv_heads,
                  "ffn_dim": model.hidden_dim, "vocab_size": model.vocab, "seq_len": seq_len,
                  "tie_embeddings": model.tie_embeddings, "qk_norm": model.qk_norm,
                  "n": counts["total"], "n_non_embedding": counts["non_embedding"], "n_active": counts["active"],
                  **({"moe_experts": model.moe_experts, "moe_top_k": model.moe_top_k, "moe_ffn_dim": model.expert_dim,
                      "moe_shared_experts": model.moe_shared_experts, "moe_dense_layers": model.moe_dense_layers}
                     if model.moe else {})},
        "tokens": tokens,
        "tokens_per_parameter": tokens / counts["total"],
        "compute": tokens * per_token,
        "compute_6nd": 6.0 * counts["active"] * tokens,  # N active: all of a dense model
        "flops_per_token": per_token,
        "sizing": {"kind": sizing.kind, "budget": sizing.compute, "law": sizing.law.to_dict() if sizing.law else None,
                   "inference_tokens": sizing.inference_tokens, "unique_tokens": sizing.unique_tokens,
                   **sizing.notes},
        # (N as the law counts it, the sweep's: the model without multi-token prediction's modules,
        # which training runs and the model leaves behind; report/run.py counts the same)
        "predicted_loss": predicted_loss(sizing, counts["total"] - counts["mtp"], tokens),
        "hardware": {"device": hardware.device.to_dict(), "devices": hardware.count,
                     "nodes": hardware.nodes, "gpus_per_node": hardware.gpus_per_node,
                     "efficiency": vars(hardware.efficiency), "reliability": vars(hardware.reliability),
                     "prices": vars(hardware.prices)},
        "layout": {**best.to_dict(), "text": describe(best.layout), "kept": keep_layout},
        "memory": {**best.memory.as_dict(), "usable": USABLE_MEMORY * hardware.device.memory,
                   "capacity": hardware.device.memory},
        "step": best.time.to_dict(),  # of the global batch
        "batch_ramp": phases,  # train.batch_ramp's stretches: batch_tokens, steps, step_s, tokens_per_s, mfu
        "run": cost.to_dict(),
        "hyperparameters": {"lr": lr, "rule_batch_tokens": rule_batch, "global_batch_tokens": batch_tokens,
                            "warmup_steps": warmup_steps(counts["total"], batch_tokens, max(1, steps // 10)),
                            "schedule": "wsd", "source": f"the rule of {hyperparameters.source} at the run's compute",
                            "extrapolation": hyperparameters.extrapolation(compute)}
        if base is None else {"lr": base.train.lr, "global_batch_tokens": batch_tokens,
                              "warmup_steps": base.train.warmup_steps, "schedule": base.train.schedule,
                              "source": "the config"},
        # What the layout computes in, and whether float32 is train.dtype = auto's fallback where
        # float16 (a device without bfloat16) does not reach.
        "dtype": best.dtype,
        "dtype_fallback": best.dtype == "fp32" and dtype != "fp32",
        "inference": {"tokens": sizing.inference_tokens, "flops": 2.0 * counts["total"] * sizing.inference_tokens,
                      "lifetime_flops": tokens * per_token
                      + 2.0 * counts["total"] * sizing.inference_tokens},
        "alternatives": [{**c.to_dict(), "text": describe(c.layout)} for c in ranked[1:]],
    }
    config = planned_config(plan, hardware, base=base, data_path=data_path, name=name)
    plan["config"] = config.to_toml()
    return plan


def configured_layout(cfg: RunConfig, hardware: Hardware, dtype: str = "bf16") -> Candidate:
    """The layout `cfg` trains with on `hardware` (parallel.recompute = auto resolved as train
    resolves it on a GPU), with its predicted memory and step time; ConfigError when train would
    refuse it, PlanError when it does not fit in the usable memory."""
    resolved = resolve_layout(cfg.parallel, hardware.count)
    check_layout(resolved, cfg)
    layout = PlanLayout.of(cfg, resolved)
    seq_len, batch = cfg.data.seq_len, cfg.seqs_per_step
    usable = USABLE_MEMORY * hardware.device.memory
    if cfg.train.float8 and (problem := float8_problem(True, hardware.device.name, layout.tp)) is not None:
        raise ConfigError(problem)
    if (dtype := layout_dtype(cfg.model, layout, hardware.device, dtype, cfg.train.float8)) is None:  # (float16)
        check_float16(float16_problems(tp=layout.tp, cp=layout.cp, pp=layout.pp, moe=cfg.model.moe,
                                       float8=cfg.train.float8, loss_chunk_tokens=layout.loss_chunk_tokens))
    if layout.recompute == "auto":
        mode, _ = choose_recompute(cfg.model, seq_len, layout.micro_batch, usable, bf16=dtype != "fp32",
                                   gather_dtype=fsdp_dtype(dtype, cfg.parallel.fsdp_param_dtype, layout.world_size),
                                   **layout.memory_layout(batch))
        layout = dataclasses.replace(layout, recompute=mode)
    memory = layout.memory(cfg.model, seq_len, batch, dtype, cfg.parallel.fsdp_param_dtype)
    if memory.peak > usable:
        raise PlanError(f"the config's layout ({describe(layout)}) needs {memory.peak / 1e9:.1f} GB per device, "
                        f"against {usable / 1e9:.1f} GB usable on {hardware.device.name}; let the planner search "
                        "(without --keep-layout), or recompute more, lower train.micro_batch or use more devices")
    time = step_time(cfg.model, seq_len, batch, layout, hardware.device, hardware.efficiency, hardware.gpus_per_node,
                     dtype)
    return Candidate(layout, batch, memory, time, dtype)


def plan_for_time(law: ChinchillaLaw, hours: float, hardware: Hardware, vocab: int, seq_len: int, *,
                  inference_tokens: float = 0.0, unique_tokens: float | None = None,
                  bootstrap: list[ChinchillaLaw] = (), batch_tokens: int | None = None, **plan_args: Any) -> dict:
    """The plan of the largest budget whose law-sized model finishes within `hours` of
    wall-clock on `hardware`, failures included. The wall-clock grows almost in proportion to
    the budget but jumps where the chosen shape or layout changes, so the budget is bracketed
    (from a first guess at 40% MFU, scaled by hours / wall-clock) and then bisected in log C, to
    within 1% below `hours` or 0.1% in C."""
    hardware.check()

    def plan_at(compute: float) -> dict:
        model, tokens, sizing = size(law, compute, vocab, seq_len, inference_tokens, unique_tokens, bootstrap)
        if tokens < seq_len:  # (too little compute to train on: the search went below any model)
            raise PlanError(f"{compute:.3g} FLOPs train the law's model on {tokens} tokens, less than a sequence")
        return make_plan(model, tokens, seq_len, hardware, batch_tokens=batch_tokens, sizing=sizing, **plan_args)

    compute = 0.4 * hardware.device.peak["bf16"] * hardware.count * hours * 3600
    below: tuple[float, dict] | None = None  # the largest budget known to fit, and its plan
    above: float | None = None  # the smallest known not to
    for _ in range(60):
        try:
            plan = plan_at(compute)
        except PlanError:
            if below is not None:
                raise
            tried = (f"the smallest budget tried that trains at all, {above:.3g} FLOPs, takes {above_wall:.3g} hours"
                     if above is not None else f"{compute:.3g} FLOPs, what they hold, train no model")
            raise PlanError(f"no model the law sizes finishes in {hours:g} hours on these devices ({tried}); allow "
                            "more hours") from None
        wall = plan["run"]["wall_hours"]
        if wall <= hours:
            if below is None or compute > below[0]:
                below = (compute, plan)
            if wall >= 0.99 * hours:
                break
        else:
            above = compute if above is None else min(above, compute)
            above_wall = wall
        if below is not None and above is not None:
            if above / below[0] < 1.001:
                break
            compute = (above * below[0]) ** 0.5
        else:  # not bracketed yet: step by the ratio, at least 5% and at most 10x
            ratio = hours / wall
            compute *= min(10.0, max(1.05, ratio)) if ratio > 1 else max(0.1, min(0.95, ratio))
    if below is None:
        raise PlanError(f"no model the law sizes finishes in {hours:g} hours on these devices (the smallest tried "
                        f"took {plan['run']['wall_hours']:.3g}); allow more hours or use --compute")
    plan = below[1]
    plan["sizing"]["hours"] = hours
    return plan


def planned_config(plan: dict, hardware: Hardware, base: RunConfig | None = None, data_path: str = "data/corpus",
                   name: str | None = None) -> RunConfig:
    """The RunConfig that trains the plan, checked as train checks it before starting; its
    run.name is `name` if given, else the base config's (or "planned")."""
    data = base.model_dump(exclude_none=True) if base is not None else {
        "run": {"name": "planned"},
        "model": {key: plan["model"][key] for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                      "vocab_size")}
        | {"max_seq_len": plan["model"]["seq_len"], "rope_theta": 500000.0 if plan["model"]["seq_len"] >= 4096
           else 10000.0},
        "data": {"path": data_path, "seq_len": plan["model"]["seq_len"]},
        "train": {"lr": plan["hyperparameters"]["lr"], "warmup_steps": plan["hyperparameters"]["warmup_steps"],
                  "schedule": "wsd", "decay_fraction": 0.2, "compile": True, "rewinds": 3},
    }
    if name is not None:
        data.setdefault("run", {})["name"] = name
    lay, run = plan["layout"]["layout"], plan["run"]
    train = data.setdefault("train", {})
    train.pop("steps", None)
    needed = max(900.0, 10 * run["step_s"], 3 * run["checkpoint_write_s"])  # above a step, a save, an eval
    hang = train.get("hang_timeout_s", needed)
    train.update(tokens=plan["tokens"], global_batch_tokens=plan["hyperparameters"]["global_batch_tokens"],
                 micro_batch=lay["micro_batch"], loss_chunk_tokens=lay["loss_chunk_tokens"],
                 hang_timeout_s=hang if hang == 0 else max(hang, needed))  # 0: the config turned the watchdog off
    parallel = {"dp_replicate": lay["dp_replicate"], "dp_shard": lay["dp_shard"], "tp": lay["tp"], "cp": lay["cp"],
                "pp": lay["pp"], "ep": lay["ep"], "recompute": lay["recompute"]}
    if lay["pp"] > 1:
        parallel.update(pp_schedule=lay["pp_schedule"], pp_stages_per_rank=lay["pp_stages_per_rank"])
        if lay["pp_stage_blocks"]:
            parallel["pp_stage_blocks"] = list(lay["pp_stage_blocks"])
    data["parallel"] = {**data.get("parallel", {}), **parallel}
    if lay["pp"] == 1 or not lay["pp_stage_blocks"]:  # (a base config's own split is not this layout's)
        data["parallel"].pop("pp_stage_blocks", None)
    if lay["pp"] == 1:
        data["parallel"].pop("pp_stages_per_rank", None)
        data["parallel"]["pp_schedule"] = "1f1b"
    # The interval the plan predicts is Daly's from its predicted save and step; the run takes it
    # from what it measures instead, at the plan's failure rate.
    data["checkpoint"] = {**data.get("checkpoint", {}), "interval": "auto",
                          "failures_per_device_hour": hardware.reliability.failures_per_device_hour,
                          "async_save": hardware.reliability.async_save}
    cfg = validate_config(data, source="the planned config")
    check_layout(resolve_layout(cfg.parallel, hardware.count), cfg)
    return cfg


def vocab_of(data_path: str | Path) -> int | None:
    """The vocabulary a run on this data directory gets (the tokenizer's, rounded up to 64, as
    train fills it in), or None when there is no prepared directory there."""
    from scaletrain.data.shards import read_index

    try:
        index = read_index(Path(data_path))
    except Exception:  # not prepared (yet): the caller asks for --vocab
        return None
    return -(-index["vocab_size"] // 64) * 64


# What the plan predicted that the run measures: (key, label, format).
PLANNED = (("tokens_per_s", "tokens/s", ",.0f"), ("mfu", "MFU", ".1%"), ("peak_memory_gb", "peak memory (GB)", ".2f"),
           ("checkpoint_blocking_s", "checkpoint blocking (s)", ".3g"), ("goodput", "goodput", ".1%"))


def against_plan(plan: dict, n: int, summary: dict) -> dict:
    """The plan's predictions of speed, memory, checkpoint blocking and goodput beside what the
    run measured (ratios measured over planned); ConfigError when the plan is for another model."""
    try:
        planned_n, device = plan["model"]["n"], plan["hardware"]["device"]["name"]
        step, memory = plan["step"], plan["memory"]
    except (KeyError, TypeError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else "is not a plan (a JSON object of model, hardware, step, ...)"
        raise ConfigError(f"the plan {what}; give the JSON `scaletrain plan --json` prints (or the .plan.json "
                          "that --write-config writes beside the config)") from None
    if planned_n != n:
        raise ConfigError(f"the plan is for a model of {planned_n:,} parameters, this run's has {n:,}; give the "
                          "plan this run's config was written from")

    def pair(planned: float | None, measured: float | None) -> dict:
        ratio = measured / planned if planned and measured is not None else None
        return {"planned": planned, "measured": measured, "ratio": ratio}

    run = plan.get("run") or {}
    return {"device": device, "devices": plan["hardware"]["devices"], "layout": plan["layout"]["text"],
            "tokens_per_s": pair(step["tokens_per_s"], summary["tokens_per_s"]),
            "mfu": pair(step["mfu"], summary["mfu"]),
            "peak_memory_gb": pair(memory["peak"] / 1e9, summary["peak_memory_gb"]),
            # (What the report measures over the whole run; the check during training has not.)
            "checkpoint_blocking_s": pair(run.get("checkpoint_block_s"), summary.get("checkpoint_blocking_s")),
            "goodput": pair(run.get("goodput"), (summary.get("time") or {}).get("goodput"))}
