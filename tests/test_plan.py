"""The planner: step-time arithmetic against hand-worked cases and its calibration points, the
layout search against train's own checks, failures and goodput against their formulas, sizing
against the laws, and a planned config that trains and is reported against its plan."""

from __future__ import annotations

import json
import math
import time
import tomllib

import numpy as np
import pytest

from conftest import ROOT
from scaletrain.cli import main
from scaletrain.config import ConfigError, ModelConfig, load_config
from scaletrain.model.flops import param_counts, train_flops_per_token
from scaletrain.parallel.layout import V_SHAPED, check_layout, ends_light_blocks, resolve_layout
from scaletrain.plan.cost import Reliability, checkpoint_interval, expected_wall_s, run_cost
from scaletrain.plan.hardware import DEVICES, device, device_from_dict
from scaletrain.plan.planner import Hardware, make_plan, model_for, plan_for_time, planned_config, size
from scaletrain.plan.memory import (in_flight_microbatches, last_rank_microbatches, rank_memory, rank_microbatches,
                                    training_memory)
from scaletrain.plan.search import (PlanError, _head_blocks, candidates, describe, head_balanced_blocks, layout_dtype,
                                    search)
from scaletrain.plan.timing import (Efficiency, PlanLayout, bubble_microbatches, collective, group_bandwidth,
                                    scores_computed, step_time)
from scaletrain.scaling.laws import preset
from scaletrain.train.trainer import Trainer, train

H100, H200 = device("H100 SXM"), device("H200")
ONE_B = ModelConfig(vocab_size=32768, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=4096)
EIGHT_B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=8192)


def test_the_calibration_reproduces_its_two_reference_measurements():
    """Issue 6's plain compiled Llama on one H200: 126M at 501k tokens/s, 1.1B at 72.5k."""
    small = ModelConfig(vocab_size=32768, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, max_seq_len=2048)
    for cfg, batch, measured in ((small, 16, 501e3), (ONE_B, 8, 72.5e3)):
        predicted = step_time(cfg, 2048, batch, PlanLayout(micro_batch=batch), H200).tokens_per_s
        assert predicted == pytest.approx(measured, rel=0.01)


def test_collectives_follow_the_ring_algorithm():
    eff = Efficiency(latency=0.0)
    assert collective("all_gather", 8e9, 8, 100e9, eff) == pytest.approx(7 / 8 * 8e9 / 100e9)
    assert collective("all_reduce", 8e9, 8, 100e9, eff) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9)
    assert collective("reduce_scatter", 8e9, 1, 100e9, eff) == 0.0
    # tp innermost: tp 8 lies within a node of 8; an FSDP group of 4 x tp 4 does not.
    assert group_bandwidth(PlanLayout(tp=8, dp_shard=2), "tp", H100, 8) == pytest.approx(450e9 * 0.82)
    assert group_bandwidth(PlanLayout(tp=4, dp_shard=4), "fsdp", H100, 8) == pytest.approx(50e9 * 0.92)
    assert group_bandwidth(PlanLayout(tp=4, dp_shard=2), "fsdp", H100, 8) == pytest.approx(450e9 * 0.82)


def test_pipeline_bubble_is_pp_minus_one_microbatches_and_interleaving_divides_it():
    def per_microbatch(t):
        return (t.compute + t.tensor_parallel + t.context_parallel + t.pipeline_sends) / 32

    one = step_time(EIGHT_B, 4096, 64, PlanLayout(dp_shard=2, pp=4, micro_batch=1), H100)
    assert one.pipeline_bubble == pytest.approx(3 * per_microbatch(one))
    two = step_time(EIGHT_B, 4096, 64, PlanLayout(dp_shard=2, pp=4, micro_batch=1, pp_schedule="interleaved_1f1b",
                                                  pp_stages_per_rank=2), H100)
    assert two.pipeline_bubble == pytest.approx(3 / 2 * per_microbatch(two))
    assert two.pipeline_sends == pytest.approx(2 * one.pipeline_sends)  # each rank's two stages send
    v = step_time(EIGHT_B, 4096, 64, PlanLayout(dp_shard=2, pp=4, micro_batch=1, pp_schedule="dualpipev",
                                                pp_stages_per_rank=2), H100)
    assert v.pipeline_bubble == pytest.approx(1 * per_microbatch(v))


def _run_schedule(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[float, list[float]]:
    """torch's action lists for `schedule` (each rank's forwards F, inputs' gradients I, weights'
    gradients W, whole backwards B = I + W and DualPipeV's pairs of a forward and a backward, in
    the order the rank runs them), run as soon as each rank and what it waits on allow, F, I and
    W taking a unit of time each. As torch's runtime sends them, an action's outputs reach
    another rank when the whole action ends (a pair's after both). Returns the idle time of the
    step in micro-batches of a rank (all its stages' F + I + W), and each rank's peak of
    activations held, from a stage's F to its W (or B), in micro-batches of a rank's blocks."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    from scaletrain.parallel.pipeline import SCHEDULES

    v, stages = stages_per_rank, pp * stages_per_rank
    lasting = {Kind.FORWARD: 1, Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1, Kind.FULL_BACKWARD: 2}
    owner, seen, ranks = {}, {}, []
    for rank, actions in enumerate(get_schedule_ops(SCHEDULES[schedule], pp, microbatches, v)):
        ranks.append([])
        for action in actions:
            if action is None or action.computation_type not in (*lasting, Kind.OVERLAP_F_B):
                continue
            ops = []
            for op in action.sub_actions if action.computation_type == Kind.OVERLAP_F_B else [action]:
                # Each stage takes its micro-batches in order: count them (torch's listing of a
                # single-stage schedule numbers a rank's micro-batches from its rank).
                kind = "I" if op.computation_type == Kind.FULL_BACKWARD else op.computation_type.value
                index = seen[op.stage_index, kind] = seen.get((op.stage_index, kind), -1) + 1
                ops.append((op.stage_index, op.computation_type, index))
                owner[op.stage_index] = rank
            ranks[-1].append(ops)

    def waits_on(stage: int, kind, index: int) -> list[tuple]:
        if kind == Kind.FORWARD:
            return [(stage - 1, "F", index)] if stage else []
        if kind == Kind.BACKWARD_WEIGHT:
            return [(stage, "I", index)]
        return [(stage, "F", index)] + ([(stage + 1, "I", index)] if stage < stages - 1 else [])

    ended: dict[tuple, float] = {}  # on the rank that ran it
    sent: dict[tuple, float] = {}  # to the others
    clock, next_action = [0.0] * pp, [0] * pp
    while any(next_action[r] < len(ranks[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while next_action[r] < len(ranks[r]):
                ops, start, names = ranks[r][next_action[r]], clock[r], []
                for stage, kind, index in ops:
                    needs = [(need, ended if owner[need[0]] == r else sent) for need in waits_on(stage, kind, index)]
                    if not all(need in times for need, times in needs):
                        break
                    start = max([start] + [times[need] for need, times in needs]) + lasting[kind]
                    for name in ("I", "W") if kind == Kind.FULL_BACKWARD else (kind.value,):
                        ended[stage, name, index] = start
                        names.append((stage, name, index))
                else:
                    sent.update((name, start) for name in names)
                    clock[r], next_action[r], moved = start, next_action[r] + 1, True
                    continue
                for name in names:  # (a pair whose second half waits on what has not run yet: again later)
                    del ended[name]
                break
        assert moved, f"{schedule}: the action lists wait on each other"
    held = []
    for actions in ranks:
        count = peak = 0
        for _, kind, _ in (op for ops in actions for op in ops):
            count += 1 if kind == Kind.FORWARD else -1 if kind in (Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD) else 0
            peak = max(peak, count)
        held.append(peak / v)
    return max(clock) / (3 * v) - microbatches, held


@pytest.mark.parametrize("schedule, stages_per_rank", [
    ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2), ("interleaved_zero_bubble", 4), ("zbv_zero_bubble", 2), ("dualpipev", 2)])
def test_the_pipeline_bubble_and_activations_are_those_of_the_schedules_torch_runs(schedule, stages_per_rank):
    """plan/timing.py's bubble and plan/memory.py's micro-batches in flight (on the first rank,
    which holds the most, and on the last) equal what torch's own action lists for each schedule
    give, for the micro-batch counts train accepts."""
    for pp in (2, 3, 4):
        least = pp * stages_per_rank if schedule in ("1f1b", "zbv_zero_bubble", "dualpipev") else pp
        for microbatches in (least, 2 * least, 4 * pp * stages_per_rank):
            bubble, held = _run_schedule(schedule, pp, microbatches, stages_per_rank)
            case = f"{schedule} over {pp} ranks, {microbatches} micro-batches"
            assert bubble == pytest.approx(bubble_microbatches(schedule, pp, stages_per_rank)), case
            assert held[0] == max(held) == pytest.approx(
                in_flight_microbatches(pp, microbatches, schedule, stages_per_rank)), case
            if schedule not in V_SHAPED:  # (a V's first rank runs the last stage too)
                last = last_rank_microbatches(pp, microbatches, schedule, stages_per_rank)
                assert held[-1] == pytest.approx(last), case
            # Each rank's (stages of unequal blocks weigh them apart): exact but under zero bubble, a bound.
            counts = [rank_microbatches(pp, microbatches, schedule, stages_per_rank, r) for r in range(pp)]
            if "zero_bubble" in schedule:
                assert all(count >= h - 1e-9 for count, h in zip(counts, held)), case
            else:
                assert counts == pytest.approx(held), case


def test_step_time_moves_the_way_its_inputs_say():
    base = PlanLayout(dp_shard=8, micro_batch=2)
    t = step_time(EIGHT_B, 4096, 64, base, H100)
    assert t.total == pytest.approx(t.compute + t.data_parallel + t.optimizer)
    # Full recomputation adds a third of the blocks' work; selective less; both use less memory.
    times = [step_time(EIGHT_B, 4096, 64, PlanLayout(dp_shard=8, micro_batch=2, recompute=r), H100).total
             for r in ("none", "selective", "full")]
    assert times[0] < times[1] < times[2] < times[0] * 4 / 3 * 1.01
    # A faster network never slows a step that crosses nodes; a faster device speeds it.
    wide = PlanLayout(dp_shard=64, micro_batch=1)
    slow = step_time(EIGHT_B, 4096, 64, wide, device_from_dict({"inter_node_gbs": 12.5}, H100))
    fast = step_time(EIGHT_B, 4096, 64, wide, H100)
    assert slow.data_parallel > fast.data_parallel and slow.total > fast.total
    assert step_time(EIGHT_B, 4096, 64, base, device("B200")).total < t.total
    # MFU is model FLOPs over time x peak x devices.
    assert t.mfu == pytest.approx(64 * 4096 * train_flops_per_token(EIGHT_B, 4096) / (t.total * H100.peak["bf16"] * 8))


def test_every_layout_the_search_returns_is_one_train_accepts_and_fits():
    for cfg, seq, batch, world in ((EIGHT_B, 8192, 256, 64), (ONE_B, 2048, 64, 16)):
        fits, _ = candidates(cfg, seq, batch, world, H100)
        assert len(fits) > 20
        best = search(cfg, seq, batch, world, H100)
        assert best[0].seconds_per_token <= 1.01 * min(c.seconds_per_token for c in fits)
        for c in fits[::7]:
            assert c.memory.peak <= 0.9 * H100.memory
            plan = {"model": {"seq_len": seq}, "layout": {"layout": c.layout.to_dict()},
                    "hyperparameters": {"global_batch_tokens": c.global_batch * seq, "lr": 3e-4, "warmup_steps": 10},
                    "tokens": 10 * c.global_batch * seq,
                    "run": {"step_s": 1.0, "checkpoint_write_s": 0.1, "checkpoint_interval_steps": 100}}
            plan["model"].update(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads,
                                 ffn_dim=cfg.hidden_dim, vocab_size=cfg.vocab)
            config = planned_config(plan, Hardware(H100, world, 8))  # raises what train would
            assert resolve_layout(config.parallel, world).world_size == world


def test_a_config_with_multi_token_prediction_is_planned_in_every_kind_of_layout():
    """Training takes model.mtp_depth under tensor, context and (looping) pipeline parallelism, the
    last stage holding the depths and a copy of the embedding they read: the search offers each,
    counts the depths' FLOPs and memory (a pipeline's last rank the heavier by the copy and the
    depths), and each kind of layout it offers is one training accepts."""
    cfg = ONE_B.model_copy(update={"mtp_depth": 1})
    fits, _ = candidates(cfg, 2048, 64, 16, H100, allow_cp=True)
    split = {kind: next(c for c in fits if getattr(c.layout, kind) > 1) for kind in ("tp", "cp", "pp")}
    untied = ONE_B.model_copy(update={"tie_embeddings": False})
    depths = untied.model_copy(update={"mtp_depth": 1})
    first, plain_first = (rank_memory(m, 2048, 1, pp=2, embedding=True, head=False) for m in (depths, untied))
    last, plain_last = (rank_memory(depths, 2048, 1, pp=2, embedding=False, head=True, embedding_copy=True),
                        rank_memory(untied, 2048, 1, pp=2, embedding=False, head=True))
    assert first.parameters == plain_first.parameters
    assert last.parameters - plain_last.parameters == 4 * (untied.vocab * untied.dim + param_counts(depths)["mtp"])
    assert training_memory(depths, 2048, 1, micro_steps=8, pp=2).parameters == last.parameters
    plain = {c.layout: c for c in candidates(ONE_B, 2048, 64, 16, H100, allow_cp=True)[0]}
    for c in (*split.values(), min(fits, key=lambda c: c.time.total)):
        same = plain[c.layout]  # (another block and head pass, and their weights and activations, a depth)
        assert c.time.total > same.time.total and c.memory.peak > same.memory.peak
    base = load_config(None, ["model.vocab_size=32768", "model.dim=2048", "model.n_layers=16", "model.n_heads=32",
                              "model.n_kv_heads=8", "model.ffn_dim=8192", "model.max_seq_len=4096",
                              "model.mtp_depth=1", "data.seq_len=2048", "train.steps=10"])
    for best in (search(cfg, 2048, 64, 16, H100)[0], *split.values()):
        plan = {"layout": {"layout": best.layout.to_dict()}, "tokens": 10 * best.global_batch * 2048,
                "hyperparameters": {"global_batch_tokens": best.global_batch * 2048},
                "run": {"step_s": 1.0, "checkpoint_write_s": 0.1, "checkpoint_interval_steps": 100}}
        planned_config(plan, Hardware(H100, 16, 8), base=base)  # (raises what train would refuse)


def test_a_sequence_no_other_layout_fits_is_split_over_devices(tmp_path, capsys):
    """Context parallelism is searched by default only where no layout without it fits (its
    GPU path is untimed): a 1M-token sequence of a 1B model fits no layout of 16 H100s
    without it, and does with it, in a layout train accepts; a sequence that fits
    otherwise is not split unless asked for. The CLI says the plan's attention is untimed,
    and a refusal without it says what would fit."""
    million = 1 << 20
    with pytest.raises(PlanError, match="let the planner split sequences over devices"):
        search(ONE_B, million, 1, 16, H100, allow_cp=False)
    best = search(ONE_B, million, 1, 16, H100)[0]
    assert best.layout.cp > 1 and best.memory.peak <= 0.9 * H100.memory
    assert search(ONE_B, 1 << 17, 1, 16, H100)[0].layout.cp == 1
    assert any(c.layout.cp > 1 for c in search(ONE_B, 1 << 17, 1, 16, H100, allow_cp=True, top=100))
    config = tmp_path / "long.toml"
    argv = ["plan", "--params", "1e9", "--tokens", "1e10", "--gpus", "16", "--seq-len", str(million)]
    assert main([*argv, "--write-config", str(config)]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "context parallelism: its attention and all-gathers are modelled, not yet timed on a GPU" in text
    cfg = load_config(config)
    assert cfg.parallel.cp > 1 and cfg.data.seq_len == million
    check_layout(resolve_layout(cfg.parallel, 16), cfg)  # (raises what train would refuse)
    assert main([*argv, "--context-parallel", "no"]) == 2
    assert "let the planner split sequences over devices" in " ".join(capsys.readouterr().err.split())


def test_multi_token_prediction_is_timed_on_the_last_pipeline_stage():
    """Pipelined, the depths all run on the last stage beside the head: a depth adds the same
    compute to a step at pp=2 as at pp=1 (not half of it, as if spread over the stages' blocks),
    and at pp=1 the step's compute still counts every FLOP of train_flops_per_token once."""
    cfg = ONE_B.model_copy(update={"tie_embeddings": False})
    depth = cfg.model_copy(update={"mtp_depth": 1})
    added = {}
    for pp in (1, 2):
        layout = PlanLayout(pp=pp, micro_batch=1)
        added[pp] = step_time(depth, 2048, 16, layout, H100).compute - step_time(cfg, 2048, 16, layout, H100).compute
    assert added[2] == pytest.approx(added[1], rel=1e-9) and added[1] > 0
    flops = train_flops_per_token(depth, 2048, causal=True) - train_flops_per_token(cfg, 2048, causal=True)
    matmul = 16 * 2048 * flops / (H100.peak["bf16"] * Efficiency().matmul)
    assert matmul < added[1] < 1.5 * matmul  # (with the depth's elementwise work and its pass of the logits)


MOE = ["model.vocab_size=32768", "model.dim=2048", "model.n_layers=16", "model.n_heads=16", "model.n_kv_heads=4",
       "model.qk_norm=true", "model.moe_experts=64", "model.moe_top_k=8", "model.moe_ffn_dim=768",
       "model.max_seq_len=4096", "data.seq_len=4096", "train.steps=10", "train.micro_batch=1",
       "train.global_batch_tokens=262144"]


def test_a_mixture_is_timed_with_its_all_to_alls_and_searched_over_expert_parallelism():
    base = load_config(None, MOE)
    cfg, eff = base.model, Efficiency(latency=0.0)
    whole = step_time(cfg, 4096, 64, PlanLayout(dp_shard=8, micro_batch=1), H100, eff)
    split = step_time(cfg, 4096, 64, PlanLayout(dp_shard=8, micro_batch=1, ep=8), H100, eff)
    assert whole.expert_parallel == 0 and split.compute == pytest.approx(whole.compute)
    # 8 micro-batches x 16 blocks x 4 all-to-alls, 7/8 of each token's 8 routed bf16 copies leaving a rank (NVLink).
    assert split.expert_parallel == pytest.approx(8 * 16 * 4 * 7 / 8 * 4096 * 8 * 2048 * 2 / (450e9 * 0.82))
    assert split.data_parallel < whole.data_parallel  # each rank gathers and reduces 1/8 of the experts
    for recompute in ("selective", "full"):  # the forward's two again (selective keeps no collective's output)
        again = step_time(cfg, 4096, 64, PlanLayout(dp_shard=8, micro_batch=1, ep=8, recompute=recompute), H100, eff)
        assert again.expert_parallel == pytest.approx(6 / 4 * split.expert_parallel)
    # Selective recomputation of a mixture block runs its elementwise work and, its attention compiled
    # alone inside the eager region (inductor's out= matmuls, which the policy cannot keep), the
    # attention's projections again: a dense model's selective recomputation has the former alone.
    from scaletrain.model.flops import attention_linear_params
    from scaletrain.plan.memory import activation_bytes_per_token

    layout = PlanLayout(dp_shard=8, micro_batch=1, ep=8, recompute="selective")
    again = step_time(cfg, 4096, 64, layout, H100, eff)
    elementwise = 8 * 4096 * 16 * eff.elementwise * activation_bytes_per_token(cfg, True, "none") / H100.memory_bandwidth
    projections = 8 * 4096 * 16 * 2 * attention_linear_params(cfg) / (H100.peak["bf16"] * eff.matmul)
    assert again.recompute == pytest.approx(elementwise / 3 + projections, rel=1e-9)
    fits, _ = candidates(cfg, 4096, 64, 16, H100)
    assert {c.layout.ep for c in fits} == {1, 2, 4, 8, 16}
    assert any(c.layout.recompute == "selective" for c in fits)  # (a mixture's too)
    assert any(c.layout.pp > 1 for c in fits)  # pipelines of mixtures too, with their all-to-alls per stage
    piped = step_time(cfg, 4096, 64, PlanLayout(dp_shard=4, pp=2, micro_batch=1, ep=4), H100, eff)
    # 16 micro-batches a pipeline x 8 blocks a stage x 4 all-to-alls, 3/4 of the copies leaving.
    assert piped.expert_parallel == pytest.approx(16 * 16 / 2 * 4 * 3 / 4 * 4096 * 8 * 2048 * 2 / (450e9 * 0.82))
    # Tensor parallelism splits the experts too (over ep x tp ranks): each tp rank routes its half of
    # the sequences, 7/8 of the copies leaving it, and gathers a quarter of what ep = 4 alone gathers.
    both = step_time(cfg, 4096, 64, PlanLayout(dp_shard=4, tp=2, micro_batch=1, ep=4), H100, eff)
    assert both.expert_parallel == pytest.approx(16 * 16 * 4 * 7 / 8 * 2048 * 8 * 2048 * 2 / (450e9 * 0.82))
    tensor = [c for c in fits if c.layout.tp > 1]
    assert tensor and all(cfg.moe_experts % (c.layout.ep * c.layout.tp) == 0 for c in tensor)
    for c in [*fits[::6], tensor[0], tensor[-1]]:  # each one train accepts
        plan = {"layout": {"layout": c.layout.to_dict()}, "tokens": 10 * c.global_batch * 4096,
                "hyperparameters": {"global_batch_tokens": c.global_batch * 4096},
                "run": {"step_s": 1.0, "checkpoint_write_s": 0.1, "checkpoint_interval_steps": 100}}
        config = planned_config(plan, Hardware(H100, 16, 8), base=base)
        assert config.parallel.ep == c.layout.ep


def test_the_search_recomputes_only_when_memory_runs_short_and_says_when_nothing_fits():
    roomy = search(ONE_B, 2048, 64, 8, H200)[0]
    tight = search(ONE_B, 2048, 64, 8, device_from_dict({"memory_gb": 12}, H200))[0]
    assert roomy.layout.recompute == "none"
    assert tight.memory.peak <= 0.9 * 12e9 < roomy.memory.peak
    with pytest.raises(PlanError, match=r"no layout fits on 1 x H100 SXM: the least memory any needs is .* GB"):
        search(EIGHT_B, 8192, 16, 1, H100)
    odd = ModelConfig(vocab_size=512, dim=96, n_layers=3, n_heads=3, tie_embeddings=True, max_seq_len=2050)
    with pytest.raises(PlanError, match="splits this model and a batch of 3 sequences"):
        search(odd, 2050, 3, 8, H100, fixed_batch=True)  # 3 heads: no tp; 2050 tokens: no cp; tied: no pp


def test_batch_stays_near_the_rule_and_a_given_config_keeps_its_settings(tmp_path):
    model = model_for(1e8, 32768, 4096)
    plan = make_plan(model, int(2e9), 4096, Hardware(H100, 256, 8))
    rule = plan["hyperparameters"]["rule_batch_tokens"]
    assert plan["hyperparameters"]["global_batch_tokens"] <= max(2 * rule, 256 * 4096)  # one sequence a rank at most
    # More devices than the rule's batch has sequences: tensor parallelism keeps it within 2x (plain FSDP
    # over every device, of one sequence each, would be faster per token at 8x the batch); where nothing
    # keeps it, the smallest batch any layout trains.
    two_b = model_for(2e9, 32768, 4096)
    wide = make_plan(two_b, int(8e10), 4096, Hardware(H100, 4096, 8))
    rule = wide["hyperparameters"]["rule_batch_tokens"]
    assert rule < 4096 * 4096 / 4 and wide["hyperparameters"]["global_batch_tokens"] <= 2 * rule
    fastest = search(two_b, 4096, 4096, 4096, H100)[0]  # (a target of one sequence a device: nothing left out)
    assert fastest.time.tokens_per_s > wide["step"]["tokens_per_s"]
    widest = make_plan(two_b, int(8e10), 4096, Hardware(H100, 65536, 8))
    assert widest["hyperparameters"]["global_batch_tokens"] == 65536 // 8 * 4096  # dp 8,192 x tp 8: the least
    config = tmp_path / "mine.toml"
    config.write_text(plan["config"].replace("async_save = true", "async_save = false")
                      .replace("hang_timeout_s = 900.0", "hang_timeout_s = 0.0"))
    base = load_config(config)
    again = make_plan(base.model, 10**9, 4096, Hardware(H100, 8, 8, reliability=Reliability(async_save=False)),
                      batch_tokens=base.train.global_batch_tokens, base=base)
    written = tomllib.loads(again["config"])
    assert written["train"]["hang_timeout_s"] == 0 and written["checkpoint"]["async_save"] is False
    assert again["hyperparameters"]["lr"] == base.train.lr and again["hyperparameters"]["source"] == "the config"
    assert again["run"]["checkpoint_block_s"] == again["run"]["checkpoint_write_s"]  # blocking saves
    muon = make_plan(base.model, 10**9, 4096, Hardware(H100, 8, 8, reliability=Reliability(async_save=False)),
                     batch_tokens=base.train.global_batch_tokens, base=load_config(config, ["train.optimizer=muon"]))
    assert tomllib.loads(muon["config"])["train"]["optimizer"] == "muon"
    assert muon["memory"]["optimizer"] < 0.85 * again["memory"]["optimizer"]  # one moment of the block matrices
    averaged = make_plan(base.model, 10**9, 4096, Hardware(H100, 8, 8, reliability=Reliability(async_save=False)),
                         batch_tokens=base.train.global_batch_tokens, base=load_config(config, ["train.ema_decay=0.999"]))
    assert tomllib.loads(averaged["config"])["train"]["ema_decay"] == 0.999
    assert averaged["memory"]["ema"] == averaged["memory"]["parameters"] and again["memory"]["ema"] == 0


def test_a_batch_ramp_is_timed_stretch_by_stretch_and_its_batches_split_over_the_layout(tmp_path, capsys):
    """train.batch_ramp's steps are timed at their own batch: the same compute a step, fewer
    micro-batches to spread the step's fixed costs (the gradients' reduction, the optimizer)
    over, so more seconds a token; the run's tokens and steps are the config's."""
    config = tmp_path / "ramp.toml"
    config.write_text(make_plan(ONE_B, int(2e10), 4096, Hardware(H100, 64, 8), batch_tokens=2**22)["config"])
    flat = load_config(config)
    ramp = load_config(config, ["train.batch_ramp=[[524288, 2000000000], [2097152, 5000000000]]"])
    hardware = Hardware(H100, 64, 8)
    plans = {name: make_plan(cfg.model, cfg.total_tokens, 4096, hardware, batch_tokens=cfg.train.global_batch_tokens,
                             base=cfg) for name, cfg in (("flat", flat), ("ramp", ramp))}
    first, second = plans["ramp"]["batch_ramp"]
    assert [(p["steps"], p["batch_tokens"]) for p in (first, second)] == ramp.batch_schedule()[:2] \
        == [(3815, 524288), (1431, 2097152)]
    assert plans["ramp"]["tokens"] == ramp.total_tokens and plans["ramp"]["run"]["steps"] == ramp.total_steps
    assert plans["flat"]["batch_ramp"] == [] and plans["flat"]["tokens"] == flat.total_tokens
    step = plans["ramp"]["step"]
    assert step["tokens_per_s"] > second["tokens_per_s"] > first["tokens_per_s"]
    assert first["step_s"] < second["step_s"] < step["total"]
    expected = sum(p["steps"] * p["step_s"] for p in (first, second)) \
        + (ramp.total_steps - first["steps"] - second["steps"]) * step["total"]
    assert plans["ramp"]["run"]["train_hours"] * 3600 == pytest.approx(expected)
    assert plans["ramp"]["run"]["train_hours"] * 3600 > ramp.total_tokens / step["tokens_per_s"]  # all at full batch
    (tmp_path / "written.toml").write_text(plans["ramp"]["config"])
    written = load_config(tmp_path / "written.toml")
    assert written.train.batch_ramp == ramp.train.batch_ramp and written.total_tokens == ramp.total_tokens
    # Every layout it offers splits the ramp's batches too (train would refuse one that does not).
    for entry in [plans["ramp"]["layout"], *plans["ramp"]["alternatives"]]:
        lay = entry["layout"]
        dp = lay["dp_replicate"] * lay["dp_shard"]
        assert all(batch // 4096 % (dp * lay["micro_batch"]) == 0 for batch, _ in ramp.train.batch_ramp)
    assert main(["plan", str(config), "train.batch_ramp=[[524288, 2000000000]]", "--gpus", "64"]) == 0
    assert "batch ramp" in capsys.readouterr().out
    # A first batch of 4 sequences splits over 64 devices only with each sequence split too (the
    # planner's last resort); without that, the batches are named.
    tiny_first = load_config(config, ["train.micro_batch=1", "train.batch_ramp=[[16384, 2000000000]]"])
    assert make_plan(ONE_B, int(2e10), 4096, Hardware(H100, 64, 8), batch_tokens=2**22,
                     base=tiny_first)["layout"]["layout"]["cp"] > 1
    with pytest.raises(PlanError, match="batches of 4, 1024 sequences .*train.batch_ramp"):
        make_plan(ONE_B, int(2e10), 4096, Hardware(H100, 64, 8), batch_tokens=2**22, base=tiny_first,
                  context_parallel=False)


def _simulated_wall_s(needs: list[float], write_s: float, mtbf_s: float, restart_s: float, runs: int,
                      seed: int, resumed_last_s: float | None = None) -> float:
    """The mean wall-clock of `runs` jobs that each need `needs` seconds without a failure in turn
    (steps then the save that ends them), each save but the last safe only `write_s` seconds of
    progress after it, failures arriving as a Poisson process of mean gap `mtbf_s` and each
    costing `restart_s` (itself struck by failures too) and the progress since the last safe
    save: plan/cost.py's model, simulated along the run's timeline. resumed_last_s: what the last
    segment needs when restarted from the save before it (no write left to wait for)."""
    rng = np.random.default_rng(seed)
    ends = np.cumsum(needs)
    safe_at = ends[:-1] + write_s  # where each save but the last is safe
    wall, at, safe = np.zeros(runs), np.zeros(runs), np.zeros(runs)
    end = np.full(runs, ends[-1])
    working, restarting = np.ones(runs, dtype=bool), np.zeros(runs, dtype=bool)
    while working.any():
        gap = rng.exponential(mtbf_s, runs)
        restarted = restarting & (gap >= restart_s)
        wall += np.where(restarting, np.minimum(gap, restart_s), 0.0)
        trying = working & ~restarting
        wall += np.where(trying, np.minimum(gap, end - at), 0.0)
        struck = trying & (gap < end - at)
        reached = np.searchsorted(safe_at, at + gap, side="right")  # saves safe by the failure
        safe = np.where(struck, np.maximum(safe, np.where(reached > 0, ends[np.maximum(reached - 1, 0)], 0.0)), safe)
        at = np.where(struck, safe, at)
        if resumed_last_s is not None and len(needs) > 1:
            end = np.where(struck & (safe == ends[-2]), ends[-2] + resumed_last_s, end)
        working &= ~(trying & ~struck)
        restarting = (restarting & ~restarted) | struck
    return float(wall.mean())


def test_daly_interval_and_the_expected_wall_clock_of_segments_under_failures():
    # The interval: Young's sqrt(2 δ M) to first order, Daly's correction above it, M past δ = 2M.
    assert checkpoint_interval(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600), rel=0.02)
    x = 2.0 / 7200
    assert checkpoint_interval(2.0, 3600.0) == pytest.approx(120 * (1 + math.sqrt(x) / 3 + x / 9) - 2)
    assert checkpoint_interval(900.0, 400.0) == 400.0
    # Daly's own examples (his figures 3-5): δ = 5 minutes at M = 24 h, 6 h and 15 minutes.
    assert [round(checkpoint_interval(5.0, m), 1) for m in (24 * 60, 6 * 60, 15)] == [116.7, 56.7, 9.1]
    # The expected wall-clock against a simulation of the same failures (restarts struck too)...
    # with saves safe once written in the background (a failure before then loses two segments;
    # the final save waits for the write before it, here once shorter than the last segment and
    # once longer), which costs more the longer the write.
    # (the last two: a last segment of 100 s shorter than the write, whose wait a restart from the
    # save before it skips)
    for needed, interval, block, final, mtbf, restart, write in ((1000.0, 300.0, 20.0, 50.0, 800.0, 200.0, 0.0),
                                                                (100.0, 400.0, 5.0, 30.0, 300.0, 500.0, 0.0),
                                                                (1000.0, 300.0, 20.0, 50.0, 800.0, 200.0, 60.0),
                                                                (1000.0, 300.0, 20.0, 50.0, 800.0, 200.0, 250.0),
                                                                (1000.0, 300.0, 20.0, 50.0, 300.0, 200.0, 280.0)):
        full, last = divmod(needed, interval)
        needs = [interval + block] * int(full) + [max(last, write) + final]
        simulated = _simulated_wall_s(needs, write, mtbf, restart, 200_000, seed=0, resumed_last_s=last + final)
        expected = expected_wall_s(needed, interval, block, final, mtbf, restart, write)
        # (closer where the last segment is shorter than the write: a restart there that waited for
        # the write again would be 1.3% off at M = 300 s)
        assert expected == pytest.approx(simulated, rel=0.006 if write > last else 0.02)
        if write:
            assert expected > 1.05 * expected_wall_s(needed, interval, block, final, mtbf, restart)
    # ... which is the first-order goodput 1 - δ/τ - (R + τ/2)/M where all are small beside M,
    wall = expected_wall_s(1e6, 100.0, 1.0, 1.0, 1e5, 60.0)
    assert 1e6 / wall == pytest.approx(1 - 1 / 100 - (60 + 50) / 1e5, abs=2e-4)
    # the run itself and its saves where nothing fails,
    assert expected_wall_s(1000.0, 300.0, 2.0, 7.0, math.inf, 600.0) == 1000 + 3 * 2 + 7
    # but not for a run much shorter than the MTBF with long restarts: its one segment fails with
    # probability 1 - exp(-T/M) and each failure costs a restart and the segment again, where the
    # first order charged R/M and τ/2M of every second (26 s for 14.5 s on 131,072 devices).
    mtbf, needed = 3600 / (Reliability().failures_per_device_hour * 131072), 14.5
    short = expected_wall_s(needed, 1e9, 0.1, 0.5, mtbf, 600.0)
    assert short == pytest.approx(mtbf * math.exp(600 / mtbf) * math.expm1(15 / mtbf))
    assert 15 < short < 24 < needed / (1 - (600 + needed / 2) / mtbf)
    # Restarts as long as the MTBF are slow, not impossible (the first order put them below zero).
    assert 0 < 1000 / expected_wall_s(1000.0, 60.0, 1.0, 1.0, 600.0, 600.0) < 0.4

    rel = Reliability(failures_per_device_hour=1e-4, restart_s=600, host_copy_bandwidth=10e9)
    cost = run_cost(1000, 10.0, 1024, 128, 20e9, 20e9 * 1024, 700, rel)
    mtbf = 3600 / (1e-4 * 1024)
    assert cost.mtbf_hours == pytest.approx(mtbf / 3600)
    assert cost.checkpoint_block_s == pytest.approx(2.0)
    assert cost.checkpoint_write_s == pytest.approx(20e9 * 1024 / 100e9)  # the filesystem's 100 GB/s binds
    assert cost.checkpoint_interval_s >= cost.checkpoint_write_s
    assert cost.wall_hours == pytest.approx(1000 * 10 / 3600 / cost.goodput)
    assert cost.wall_hours * 3600 == pytest.approx(expected_wall_s(1e4, cost.checkpoint_interval_s, 2.0,
                                                                   cost.checkpoint_write_s, mtbf, 600,
                                                                   cost.checkpoint_write_s))
    assert cost.expected_failures == pytest.approx(cost.wall_hours * 1024 * 1e-4)
    spared = expected_wall_s(1e4, cost.checkpoint_interval_s, 2.0, cost.checkpoint_write_s, math.inf, 600,
                             cost.checkpoint_write_s)
    assert cost.lost_to_failures == pytest.approx(1 - spared / (cost.wall_hours * 3600)) and cost.lost_to_failures > 0
    assert cost.energy_kwh == pytest.approx(cost.device_hours * 700 * 1.2 / 1000)
    # The interval is Daly's in whole steps, the better of the two around it.
    quick = run_cost(10**5, 1.0, 1024, 128, 20e9, 1e9, 700, rel)
    best = checkpoint_interval(2.0, mtbf)
    assert quick.checkpoint_interval_steps in (math.floor(best), math.ceil(best))
    assert quick.wall_hours * 3600 == pytest.approx(min(expected_wall_s(1e5, steps, 2.0, 0.01, mtbf, 600)
                                                        for steps in (math.floor(best), math.ceil(best))))
    # More devices fail more often and checkpoint more often (while writes are quick)...
    small, bigger = (run_cost(1000, 10.0, n, n // 8, 20e9, 1e9, 700, rel) for n in (1024, 8192))
    assert bigger.goodput < small.goodput and bigger.checkpoint_interval_steps < small.checkpoint_interval_steps
    # With no failures only the checkpoints' blocking costs: hourly checkpoints, the last written out.
    never = run_cost(1000, 10.0, 64, 8, 20e9, 1e9, 700, Reliability(failures_per_device_hour=0))
    assert never.mtbf_hours is None and never.expected_failures == never.lost_to_failures == 0
    assert never.checkpoint_interval_s == 3600
    assert never.wall_hours * 3600 == pytest.approx(1e4 + 2 * never.checkpoint_block_s + never.checkpoint_write_s)
    # ...but never more often than a checkpoint takes to write.
    slow = run_cost(1000, 10.0, 8192, 1024, 20e9, 20e9 * 8192, 700, rel)
    assert slow.checkpoint_interval_s >= slow.checkpoint_write_s > checkpoint_interval(2.0, 3600 / (1e-4 * 8192))


@pytest.mark.parametrize("n", [2e7, 3e8, 1e9, 7e9, 7e10, 4e11])
def test_model_for_hits_the_parameter_count_with_a_sane_shape(n):
    cfg = model_for(n, 32768, 4096)
    assert param_counts(cfg)["total"] == pytest.approx(n, rel=0.06)
    assert 128 / 1.5 <= cfg.dim / cfg.n_layers <= 128 * 1.5 or cfg.n_layers == 1
    assert cfg.n_heads % cfg.kv_heads == 0 and cfg.head_dim in (64, 128)


def test_sizing_spends_the_budget_and_follows_the_law():
    law = preset("epoch")
    model, tokens, sizing = size(law, 1e22, 32768, 4096)
    assert tokens * train_flops_per_token(model, 4096) == pytest.approx(1e22, rel=1e-6)
    assert param_counts(model)["total"] == pytest.approx(law.optimum(1e22)[0], rel=0.1)
    # The law's optimum counts 6ND; the shape chosen has the least loss at the tokens the exact FLOPs
    # (attention's included) buy: 0.60B parameters at 1e20 FLOPs, not the 0.84B nearest the law's N.
    def loss(shape, compute):
        return law.loss(param_counts(shape)["total"], compute / train_flops_per_token(shape, 4096))

    chosen = size(law, 1e20, 32768, 4096)[0]
    nearest = model_for(law.optimum(1e20)[0], 32768, 4096)
    assert loss(chosen, 1e20) < loss(nearest, 1e20) - 0.005 and param_counts(chosen)["total"] < 0.8 * law.optimum(1e20)[0]
    assert loss(model, 1e22) <= loss(model_for(law.optimum(1e22)[0], 32768, 4096), 1e22)
    small, more, aware = size(law, 1e22, 32768, 4096, inference_tokens=1e13)
    assert param_counts(small)["total"] < param_counts(model)["total"] and more > tokens
    # The lifetime compute saved is the shape's planned, against the compute-optimal model's (6ND + 2N per
    # inference token both).
    optimal_n, optimal_d = law.optimum(1e22)
    assert aware.notes["lifetime_flops_saved"] == pytest.approx(
        6 * optimal_n * optimal_d + 2 * optimal_n * 1e13 - param_counts(small)["total"] * (6 * more + 2 * 1e13), rel=1e-6)
    assert aware.notes["lifetime_flops_saved"] > 0
    # ...reaching the compute-optimal model's loss with the shape actually chosen.
    assert law.loss(param_counts(small)["total"], more) == pytest.approx(aware.notes["target_loss"], rel=1e-9)
    _, _, limited = size(law, 1e22, 32768, 4096, unique_tokens=5e10)
    assert limited.kind == "data-constrained"


def test_plan_holds_the_design_contract_and_a_config_that_train_accepts(tmp_path):
    model, tokens, sizing = size(preset("epoch"), 1e21, 32768, 4096)
    plan = make_plan(model, tokens, 4096, Hardware(H100, 16, 8), sizing=sizing)
    for key in ("model", "tokens", "compute", "layout", "memory", "step", "run", "inference", "config"):
        assert key in plan
    assert plan["step"]["mfu"] < 0.79 and plan["run"]["device_hours"] > 0
    (tmp_path / "planned.toml").write_text(plan["config"])
    cfg = load_config(tmp_path / "planned.toml")
    check_layout(resolve_layout(cfg.parallel, 16), cfg)
    assert cfg.train.tokens == plan["tokens"] and cfg.checkpoint.interval == "auto"  # (the run measures its own)
    assert cfg.checkpoint.failures_per_device_hour == Reliability().failures_per_device_hour
    json.dumps(plan)


@pytest.mark.parametrize("hours, gpus", [(1.0, 8), (300.0, 64)])
def test_a_plan_for_hours_fits_in_them_and_more_hours_buy_a_bigger_model(hours, gpus):
    hardware = Hardware(H200, gpus, 8)
    plan = plan_for_time(preset("epoch"), hours, hardware, 32768, 4096)
    assert 0.9 * hours <= plan["run"]["wall_hours"] <= hours  # shapes and layouts change in steps
    assert plan["sizing"]["hours"] == hours and plan["sizing"]["kind"] == "compute-optimal"
    longer = plan_for_time(preset("epoch"), 3 * hours, hardware, 32768, 4096)
    assert longer["model"]["n"] > plan["model"]["n"] and longer["compute"] > 2 * plan["compute"]


def test_the_cli_prints_the_plan_for_people_and_writes_its_config(tmp_path, capsys):
    config = tmp_path / "run.toml"
    assert main(["plan", "--compute", "1e22", "--gpus", "32", "--price", "2", "--write-config", str(config)]) == 0
    text = capsys.readouterr().out
    for row in ("model", "predicted loss", "layout", "memory per device", "MFU", "wall-clock", "goodput",
                "device-hours", "MWh", "next best layouts", "scaletrain launch"):
        assert row in text, row
    cfg = load_config(config)
    assert resolve_layout(cfg.parallel, 32).world_size == 32 and cfg.train.schedule == "wsd"
    assert cfg.run.name == "run"  # (named after its file: `scaletrain train run.toml` trains runs/run)
    # A given config is planned as it is: its model, tokens and batch kept, the layout chosen; the
    # config written for it trains a run of its own name, not the planned config's (whose
    # checkpoints it would resume under other settings).
    assert main(["plan", str(config), "--gpus", "16", "--write-config", str(tmp_path / "run-16.toml")]) == 0
    assert load_config(tmp_path / "run-16.toml").run.name == "run-16"
    capsys.readouterr()
    # A fixed interval the config sets is replaced by Daly's for the plan's batch and step time, and said so.
    assert main(["plan", str(config), "checkpoint.interval=200", "--gpus", "16", "--write-config",
                 str(tmp_path / "fixed.toml")]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert load_config(tmp_path / "fixed.toml").checkpoint.interval == "auto"
    assert 'checkpoint.interval = "auto"' in said and "not every 200 steps as the config did" in said
    assert main(["plan", str(config), "--gpus", "16", "--json"]) == 0
    replanned = json.loads(capsys.readouterr().out)
    assert replanned["model"]["n"] == param_counts(cfg.model)["total"]
    assert replanned["hyperparameters"]["global_batch_tokens"] == cfg.train.global_batch_tokens
    assert replanned["tokens"] == cfg.total_steps * cfg.train.global_batch_tokens
    # The sizings say what they are sized against: an inference-aware run trains past its budget.
    assert main(["plan", "--compute", "1e21", "--inference-tokens", "1e13"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "the loss of the compute-optimal model of 1e+21 FLOPs (2.78B), reached by a smaller one trained" in text
    assert main(["plan", "--compute", "1e21", "--unique-tokens", "5e9"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "epochs; past about 4, each repeat teaches less" in text


def test_on_gpus_without_bf16_layouts_float16_does_not_reach_are_timed_in_float32(capsys):
    """On a V100 or T4, train.dtype = auto is float16, whose loss scaling train offers on
    data-parallel layouts of a dense model only; the others train in float32 there, and the
    planner times them so (float16 asked for outright: it leaves them out)."""
    v100 = device("V100")
    assert not v100.bf16 and not device("T4").bf16 and H100.bf16
    fsdp, split = PlanLayout(dp_shard=8), PlanLayout(dp_shard=4, tp=2)
    assert layout_dtype(ONE_B, fsdp, v100, "bf16") == "fp16" and layout_dtype(ONE_B, split, v100, "bf16") == "fp32"
    assert layout_dtype(ONE_B, split, H100, "bf16") == "bf16" and layout_dtype(ONE_B, split, v100, "fp32") == "fp32"
    assert layout_dtype(ONE_B, split, v100, "fp16") is None and layout_dtype(ONE_B, fsdp, v100, "fp16") == "fp16"
    assert layout_dtype(ONE_B, fsdp, H100, "fp16") == "fp16" and layout_dtype(ONE_B, split, H100, "fp16") is None
    assert layout_dtype(ONE_B, PlanLayout(dp_shard=8, loss_chunk_tokens=8192), v100, "bf16") == "fp32"
    assert layout_dtype(ONE_B, fsdp, v100, "bf16", float8=True) == "fp32"
    mixture = ModelConfig(vocab_size=32768, dim=1024, n_layers=8, n_heads=16, moe_experts=8, max_seq_len=2048)
    assert layout_dtype(mixture, fsdp, v100, "bf16") == "fp32"
    ranked = search(ONE_B, 2048, 64, 16, v100, top=30, gpus_per_node=8)
    assert {c.dtype for c in ranked} == {"fp16", "fp32"}  # (both kinds searched, each timed as it trains)
    for c in ranked:
        limited = c.layout.tp > 1 or c.layout.pp > 1 or c.layout.cp > 1 or c.layout.loss_chunk_tokens > 0
        assert c.dtype == ("fp32" if limited else "fp16"), describe(c.layout)
        assert c.time == step_time(ONE_B, 2048, c.global_batch, c.layout, v100, gpus_per_node=8, dtype=c.dtype)
    assert ranked[0].dtype == "fp16"
    # float16's FSDP gathers float16 parameters as bf16's gathers bf16 (the same traffic and copies);
    # its blocks hand the residual stream on in float32, whose norms keep float32 inputs.
    fsdp8 = PlanLayout(dp_shard=8, micro_batch=4)
    assert step_time(ONE_B, 2048, 64, fsdp8, H100, dtype="fp16") == step_time(ONE_B, 2048, 64, fsdp8, H100)
    as_float16, as_bf16 = fsdp8.memory(ONE_B, 2048, 64, "fp16"), fsdp8.memory(ONE_B, 2048, 64)
    assert as_float16.weight_copies == as_bf16.weight_copies
    assert as_float16.activations == as_bf16.activations + 4 * ONE_B.dim * 2048 * 4 * ONE_B.n_layers
    # Gathered in float32 under 16-bit compute (parallel.fsdp_param_dtype = float32), autocast's copy of
    # every block's weights stays on every rank for the backward pass, as on one device.
    wide = fsdp8.memory(ONE_B, 2048, 64, fsdp_param_dtype="float32")
    assert wide.weight_copies > 2 * param_counts(ONE_B)["total"] * 0.8 > as_bf16.weight_copies
    # The same layout split by tensor parallelism, timed in float32, is several times slower.
    assert step_time(ONE_B, 2048, 64, split, v100, dtype="fp32").tokens_per_s \
        < step_time(ONE_B, 2048, 64, split, v100).tokens_per_s / 3
    assert all(c.dtype == "fp16" for c in search(ONE_B, 2048, 64, 16, v100, top=30, gpus_per_node=8, dtype="fp16"))
    # The plan says what its layout computes in; a config's own float16 layout that float16 does not reach is refused.
    llama = ["plan", "configs/llama-1b.toml", "--vocab", "32768", "--gpu", "V100", "--gpus", "8", "--json"]
    assert main(llama) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "fp16"
    assert main([*llama, "parallel.tp=2", "train.micro_batch=1", "--keep-layout"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "fp32"
    assert main([*llama[:-1], "parallel.tp=2", "train.micro_batch=1", "--keep-layout"]) == 0
    assert "float16's loss scaling does not reach this layout, and V100 has no bfloat16" in \
        " ".join(capsys.readouterr().out.split())
    assert main([*llama, "parallel.tp=2", "train.micro_batch=1", "train.dtype=float16", "--keep-layout"]) == 2
    assert "not with parallel.tp = 2" in " ".join(capsys.readouterr().err.split())
    assert main([*llama[:-1], "train.dtype=float32"]) == 0  # (float32 asked for: no float16 to fall back from)
    text = " ".join(capsys.readouterr().out.split())
    assert "float32" in text and "does not reach" not in text
    assert main([*llama, "train.dtype=bfloat16"]) == 2
    assert "train.dtype = bfloat16, but V100 has no bfloat16" in " ".join(capsys.readouterr().err.split())
    assert main([*llama[:5], "H100 SXM", *llama[6:], "train.dtype=float16"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "fp16"
    with pytest.raises(PlanError, match="train.dtype = float16 leaves out tensor, context and pipeline parallelism"):
        search(EIGHT_B, 8192, 8, 8, device("V100 16GB"), gpus_per_node=8, dtype="fp16")
    assert not device_from_dict({"name": "Tesla V100-SXM2-32GB"}, base=H100).bf16  # (named: known to lack it)
    # float8 (train.float8: from compute capability 8.9) is refused where train would refuse it.
    assert main([*llama[:5], "A100", *llama[6:], "train.float8=true"]) == 2
    assert "train.float8 = true needs an NVIDIA GPU of compute capability 8.9 or newer (H100, H200, L4, RTX 40xx); " \
           "this run is on A100: leave train.float8 false" in " ".join(capsys.readouterr().err.split())
    assert main([*llama[:5], "H100 SXM", *llama[6:], "train.float8=true"]) == 0
    capsys.readouterr()
    assert not device_from_dict({"name": "NVIDIA A100-SXM4-80GB"}, base=H100).float8 and device("L4").float8
    assert device_from_dict({"name": "NVIDIA A100-SXM4-80GB", "float8": True}, base=H100).float8  # (given: as given)
    with pytest.raises(ValueError, match="bf16 = 'no' must be true or false"):
        device_from_dict({"bf16": "no"}, base=v100)
    with pytest.raises(ValueError, match="needs an fp32 entry"):
        device_from_dict({"name": "X", "peak_tflops": {"bf16": 100}, "memory_gb": 32, "memory_bandwidth_gbs": 900,
                          "intra_node_gbs": 16, "inter_node_gbs": 12.5, "watts": 300, "bf16": False})


def test_keep_layout_plans_the_configs_own_layout_beside_the_searchs_best(tmp_path, capsys):
    llama = ["configs/llama-1b.toml", "--vocab", "32768", "--gpus", "8"]
    mine = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "train.micro_batch=2"]
    config = tmp_path / "kept.toml"
    assert main(["plan", *llama, *mine, "--keep-layout", "--json", "--write-config", str(config)]) == 0
    plan = json.loads(capsys.readouterr().out)
    layout = plan["layout"]["layout"]
    assert plan["layout"]["kept"] and (layout["pp"], layout["dp_shard"], layout["micro_batch"]) == (2, 4, 2)
    assert (layout["pp_schedule"], layout["pp_stages_per_rank"]) == ("interleaved_1f1b", 2)
    model = load_config("configs/llama-1b.toml", ["model.vocab_size=32768"]).model
    expected = step_time(model, 4096, 256, PlanLayout(**layout), H100)
    assert plan["step"]["tokens_per_s"] == pytest.approx(expected.tokens_per_s)
    # The search's best follow it (here faster: the model fits without a pipeline), never itself again.
    assert plan["alternatives"] and all(alt["layout"] != layout for alt in plan["alternatives"])
    assert plan["alternatives"][0]["time"]["tokens_per_s"] > plan["step"]["tokens_per_s"]
    cfg = load_config(config)
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.train.micro_batch) == (2, "interleaved_1f1b", 2)
    assert main(["plan", *llama, *mine, "--keep-layout"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(the config's)" in text and "the search's best layouts" in text
    # parallel.recompute = auto is resolved as train resolves it on a GPU: the least that fits.
    assert main(["plan", *llama, "train.micro_batch=16", "parallel.recompute=auto", "--keep-layout", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["layout"]["recompute"] in ("selective", "full")
    # Each schedule train runs is timed, the zero-bubble ones too (with uncompiled blocks).
    zbv = ["parallel.pp=2", "parallel.pp_schedule=zbv_zero_bubble", "train.micro_batch=2", "train.compile=false"]
    assert main(["plan", *llama, *zbv, "--keep-layout", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"]["pipeline_bubble"] > 0
    for argv, message in (
            (["plan", "--compute", "1e21", "--keep-layout"], "--keep-layout plans a config's own layout"),
            ([*llama, "train.micro_batch=32", "--keep-layout"], "the config's layout (dp 8 (fsdp), micro-batch 32) "
                                                                "needs"),
            ([*llama, "parallel.tp=3", "--keep-layout"], "does not divide the 8 processes"),
            ([*llama, *zbv[:-1], "--keep-layout"], "which torch cannot do through a block that train.compile")):
        assert main(argv if argv[0] == "plan" else ["plan", *argv]) == 2, argv
        assert message in " ".join(capsys.readouterr().err.split()), argv


def test_catalog_devices_are_complete():
    for name, spec in DEVICES.items():
        assert spec.memory > 0 and spec.memory_bandwidth > 0 and spec.intra_node >= spec.inter_node * 0.6, name
        assert set(spec.peak) == {"bf16", "tf32", "fp32"}


def test_plan_refuses_bad_input_in_one_sentence(tmp_path, capsys):
    cases = [
        (["plan", "--compute", "1e21", "--gpu", "TPU v9"], "no device 'TPU v9' in the catalog"),
        (["plan", "--compute", "1e21", "--hardware", str(tmp_path / "none.json")], "does not exist"),
        (["plan", "--compute", "1e21", "--law", str(tmp_path / "law.json")], "does not exist"),
        (["plan", "--compute", "1e21", "--params", "1e9"], "give one of a config FILE, --compute C, --hours H or"),
        (["plan"], "say what to plan"),
        (["plan", "--params", "1e9"], "--params and --tokens go together"),
        (["plan", "--compute", "1e21", "--preset", "kaplan"], "no E + A/N^α + B/D^β form"),
        (["plan", "--compute", "1e21", "--gpus", "12"], "not whole nodes of 8"),
        (["plan", "--params", "4e11", "--tokens", "1e12", "--gpus", "1"], "no layout fits on 1 x H100 SXM"),
        # A mistyped device is not taken for a listed one it contains ("h100" in "H1000").
        (["plan", "--compute", "1e21", "--gpu", "H1000"], "no device 'H1000' in the catalog; did you mean"),
        (["plan", "--compute", "1e21", "--gpu", "GH200"], "no device 'GH200' in the catalog"),
        # A budget below the smallest model: refused, not planned at a thousand times its FLOPs.
        (["plan", "--compute", "1e9"], "--compute 1e+09 FLOPs is too little for the smallest model"),
        (["plan", "--compute", "1e3"], "--compute 1e+03 FLOPs is too little for the smallest model"),
        # Restarts of an hour on devices that fail every 7.5 minutes: refused, not planned at 3,000x the time.
        (["plan", "--compute", "1e21", "--failure-rate", "1", "--restart-minutes", "60"],
         "8 devices fail every 8 minutes at the assumed rate, too often for restarts of 3600 s: the run would "
         "spend 100% of its wall-clock restarting"),
        # A file where a file cannot be written: the path in a sentence, not a traceback.
        (["plan", "--compute", "1e21", "--write-config", str(tmp_path)], f"{str(tmp_path)!r} is a directory"),
        # A law whose N_opt grows as C^0.9 (a tiny sweep's) asks for a trillion parameters on a few tokens: not
        # taken for a budget below the smallest model.
        (["plan", "--compute", "1e21", "--law", str(tmp_path / "steep.json")],
         "the law sizes a model of 33,096,044,969,984 parameters on 4,974,216 tokens, under one token per parameter (its "
         "N_opt grows as C^0.9): too far from where it was measured"),
    ]
    (tmp_path / "steep.json").write_text(json.dumps({"approach3": {
        name: {"value": value} for name, value in dict(E=2.0, A=100.0, B=1e4, alpha=0.1, beta=0.9).items()}}))
    # A law's numbers that no fit writes (edited by hand): named, not a traceback or a nan loss.
    for i, (name, value) in enumerate((("alpha", "x"), ("alpha", -1e308), ("beta", float("nan")), ("E", float("inf")))):
        law = dict(E=2.0, A=100.0, B=1e4, alpha=0.3, beta=0.3) | {name: value}
        (tmp_path / f"sweep{i}").mkdir()
        (tmp_path / f"sweep{i}" / "law.json").write_text(json.dumps({"approach3": {
            key: {"value": number} for key, number in law.items()}}))
        cases.append((["plan", "--compute", "1e21", "--law", str(tmp_path / f"sweep{i}" / "law.json")],
                      f"(ValueError: approach3.{name} is {value!r}, not a finite number"))
    cases.append((["plan", "--compute", "1e21", "--law", str(tmp_path / "sweep0")],
                  f"is a directory; give a law.json written by `scaletrain fit`: the one in it, "
                  f"{str(tmp_path / 'sweep0' / 'law.json')!r}"))
    for i, (text, message) in enumerate([('{"memory_gb": -1}', "memory_gb = -1 must be a positive number"),
                                         ('{"peak_tflops": 400}', "must map dtypes to TFLOP/s"),
                                         ('{"watts": "500"}', "watts = '500' must be a positive number"),
                                         ('[1, 2]', "is a JSON object of"), ('{"gpus_per_node": 2.5}', "whole number"),
                                         ("{", "is not valid JSON")]):
        (tmp_path / f"bad{i}.json").write_text(text)
        cases.append((["plan", "--compute", "1e21", "--hardware", str(tmp_path / f"bad{i}.json")], message))
    cases.append((["plan", "--compute", "1e21", "--data", str(tmp_path)], "is not a prepared data directory"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err.replace("\n", " "), argv
    for argv in (["--gpus", "0"], ["--top", "0"], ["--seq-len", "-4"], ["--price", "-1"], ["--hours", "-1"]):
        with pytest.raises(SystemExit) as stop:  # argparse: one line naming the option
            main(["plan", "--compute", "1e21", *argv])
        assert stop.value.code == 2 and argv[0] in capsys.readouterr().err


def test_the_written_configs_command_quotes_its_path(tmp_path, capsys, monkeypatch):
    written = tmp_path / "my plan ü.toml"  # (a path with a space: the command printed must still run as shown)
    assert main(["plan", "--params", "1e8", "--tokens", "1e9", "--write-config", str(written)]) == 0
    assert f"scaletrain train '{written}' --nproc 8" in " ".join(capsys.readouterr().out.split())
    monkeypatch.chdir(tmp_path)  # written by a relative path, the config names its plan by a whole one
    assert main(["plan", "--params", "1e8", "--tokens", "1e9", "--write-config", "here.toml"]) == 0
    assert load_config(tmp_path / "here.toml").log.plan == str((tmp_path / "here.plan.json").resolve())


def test_tokens_below_one_batch_are_planned_as_one_step_and_said(capsys):
    assert main(["plan", "--params", "1e8", "--tokens", "1e3", "--json"]) == 0
    said = capsys.readouterr()
    plan = json.loads(said.out)
    # (4 sequences of 4,096 on 8 devices: dp 4 x tp 2, the least batch any layout trains, the rule's being below one)
    assert plan["run"]["steps"] == 1 and plan["tokens"] == plan["hyperparameters"]["global_batch_tokens"] == 16384
    assert ("--tokens 1e+03 is less than one step's batch of 16,384 tokens: planned as that one step"
            in " ".join(said.err.split()))
    assert "the batch is 7.68x the rule's 2,132 tokens: no layout of 8 devices keeps it within 2x" in " ".join(
        said.err.split())
    assert main(["plan", "--params", "1e8", "--tokens", "1e5", "--json"]) == 0
    said = capsys.readouterr()
    assert json.loads(said.out)["run"]["steps"] == 7 and "one step's batch" not in said.err
    assert main(["plan", "--params", "1", "--tokens", "1e9", "--json"]) == 0  # (below the family's least)
    assert ("--params 1: the nearest shape the planner builds has 8,601,984 parameters (at a vocabulary of 32,768); "
            "planned with it" in " ".join(capsys.readouterr().err.split()))


def test_the_predicted_loss_counts_the_model_as_the_law_does(capsys):
    """The law's N is the model's parameters as a sweep counts them: without multi-token
    prediction's modules, which training runs and the model leaves behind (report/run.py counts
    the same, so a report's point and the plan's interval are of one quantity)."""
    assert main(["plan", str(ROOT / "configs" / "llama-1b.toml"), "model.mtp_depth=1", "model.vocab_size=32000",
                 "--preset", "epoch", "--gpu", "H100", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    counts = param_counts(ModelConfig(**{key: value for key, value in tomllib.loads(plan["config"])["model"].items()}))
    assert counts["mtp"] > 0 and plan["model"]["n"] == counts["total"]
    assert plan["predicted_loss"]["value"] == pytest.approx(
        preset("epoch").loss(counts["total"] - counts["mtp"], plan["tokens"]), rel=1e-12)


def test_a_planned_config_trains_and_reports_against_its_plan(stdlib_data, tmp_path, capsys, monkeypatch):
    """Plan a tiny model for a 'device' described in a file, write its config, train it (on the
    CPU), and report the run against the plan. (Planned multi-device layouts pass train's own
    layout checks above; the layouts themselves are trained in test_distributed.py.)"""
    hardware = tmp_path / "cpu.json"
    hardware.write_text(json.dumps({"name": "a CPU", "peak_tflops": {"bf16": 0.1, "tf32": 0.05, "fp32": 0.05},
                                    "memory_gb": 4, "memory_bandwidth_gbs": 20, "intra_node_gbs": 5,
                                    "inter_node_gbs": 1, "watts": 100, "gpus_per_node": 2}))
    config = tmp_path / "planned.toml"
    assert main(["plan", "--params", "3e5", "--tokens", "2e5", "--seq-len", "64", "--hardware", str(hardware),
                 "--gpus", "1", "--data", str(stdlib_data), "--name", "planned", "--write-config", str(config),
                 "--global-batch-tokens", "2048", "--preset", "epoch", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["vocab_size"] == 512 and plan["hardware"]["devices"] == 1
    assert load_config(config).log.plan == str(tmp_path / "planned.plan.json")  # the config names its plan
    capsys.readouterr()
    assert plan["layout"]["layout"]["micro_batch"] == 32  # (the run halves it: not the plan's layout)
    step = Trainer.train_step

    def first_slow(self, *args, **kwargs):  # (a first step that compiles, say)
        if self.step == 0:
            time.sleep(4.0)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", first_slow)
    train(load_config(config, [f"run.dir={tmp_path}", "train.steps=11", "train.compile=false", "train.device=cpu",
                               "eval.interval=0", "eval.tokens=1024", "train.micro_batch=16"]))
    monkeypatch.undo()
    records = [json.loads(line) for line in (tmp_path / "planned" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "train"][-1] == 11
    # From step 10 the run sets itself against its plan, once, and says what falls short.
    [check] = [r for r in records if r["kind"] == "plan_check"]
    assert check["step"] == 10 and check["tokens_per_s"]["planned"] == plan["step"]["tokens_per_s"]
    # (its speed over steps 2 to 10: the first pays one-off costs, compilation on a GPU; no memory set
    # against the plan on a CPU, whose peak is the process's resident memory, torch's runtime with it)
    [tenth] = [r for r in records if r.get("kind") == "train" and r["step"] == 10]  # (steps 1 to 10)
    assert check["tokens_per_s"]["measured"] > 2 * tenth["tokens_per_s"]  # (the first step slept 4 s)
    assert check["peak_memory_gb"]["measured"] is None
    assert check["problems"][:2] == ["the plan is for 1 x a CPU, this runs on 1 x cpu",
                                     "the plan is for dp 1, micro-batch 32, this runs dp 1, micro-batch 16"]
    assert not any("memory" in problem for problem in check["problems"])
    warned = " ".join(capsys.readouterr().err.split())  # (the console's handler, which main set up, wraps lines)
    assert "against its plan" in warned and "this runs on 1 x cpu" in warned
    # The report puts the plan's predictions beside what the run measured.
    plan_file = tmp_path / "planned.plan.json"
    assert json.loads(plan_file.read_text())["layout"] == plan["layout"]
    assert main(["report", str(tmp_path / "planned"), "--plan", str(plan_file)]) == 0
    text = capsys.readouterr().out
    assert "planned tokens/s on 1 x a CPU" in text and "measured" in text
    # ... and the goodput and checkpoint blocking the plan's run model predicted (plan/cost.py).
    cells = " ".join(text.split())
    assert f"planned goodput on 1 x a CPU │ {plan['run']['goodput']:.1%} (measured " in cells
    assert f"planned checkpoint blocking (s) on 1 x a CPU │ {plan['run']['checkpoint_block_s']:.3g} (measured " in cells
    assert "predicted final validation loss" in text  # from the law the plan sized with
    # A plan sized for --unique-tokens predicts with repeated epochs: the report's point is of that too.
    from scaletrain.report.run import run_report
    from scaletrain.scaling.laws import ChinchillaLaw
    from scaletrain.scaling.optimal import data_constrained_loss
    limited = json.loads(plan_file.read_text())
    limited["sizing"]["unique_tokens"] = 1e4
    prediction = run_report(tmp_path / "planned", plan_doc=limited)["prediction"]
    law, n, tokens = ChinchillaLaw(**limited["sizing"]["law"]), prediction["n"], prediction["tokens"]
    assert prediction["loss"] == pytest.approx(data_constrained_loss(law, n, tokens, 1e4), rel=1e-12)
    assert prediction["loss"] > law.loss(n, tokens) + 1e-3 and prediction["unique_tokens"] == 1e4
    page = (tmp_path / "planned" / "report.html").read_text()
    assert "planned tokens/s (1 x a CPU, dp 1" in page
    other = dict(plan, model={**plan["model"], "n": plan["model"]["n"] + 1})
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["report", str(tmp_path / "planned"), "--plan", str(tmp_path / "other.json")]) == 2
    assert "the plan is for a model of" in capsys.readouterr().err
    for given, words in ((tmp_path / "other.json", "the plan is for a model of"), (tmp_path / "none.json", "readable")):
        with pytest.raises(ConfigError, match=f"log.plan = .*{words}"):
            train(load_config(config, [f"run.dir={tmp_path}", "run.name=other", "train.steps=2", f"log.plan={given}",
                                       "train.device=cpu"]))


def test_a_runs_layout_is_planned_with_the_chunked_loss_it_trains_with():
    """Training chunks the loss wherever the head is whole (one process, FSDP, a pipeline's last
    stage), not under tensor parallelism: the memory a run is predicted to need (what
    parallel.recompute = auto chooses by) says the same."""
    base = ["model.vocab_size=32768", "model.dim=1024", "model.n_layers=8", "model.n_heads=16", "data.seq_len=1024",
            "train.global_batch_tokens=65536", "train.steps=10"]
    for split, chunked in ((["parallel.pp=2", "parallel.dp_shard=1"], True), (["parallel.dp_shard=2"], True),
                           (["parallel.tp=2", "parallel.dp_shard=1"], False)):
        peaks = []
        for chunk in (0, 512):
            cfg = load_config(None, [*base, *split, f"train.loss_chunk_tokens={chunk}"])
            layout = PlanLayout.of(cfg, resolve_layout(cfg.parallel, 2))
            assert layout.loss_chunk_tokens == (chunk if chunked else 0), split
            peaks.append(layout.memory(cfg.model, 1024, cfg.seqs_per_step).peak)
        assert (peaks[1] < peaks[0]) == chunked, (split, peaks)


def test_stages_of_unequal_blocks_are_timed_at_the_slowest_rank_and_searched_where_the_blocks_do_not_divide():
    """parallel.pp_stage_blocks: the pipeline runs at its slowest rank's pace, the last's counting
    the output head; where the blocks split evenly over no pipeline, the search gives the ends a
    block fewer (Llama 3's 126 blocks on 16 stages: 7, 8 x 14, 7), and train accepts its config."""
    assert ends_light_blocks(126, 16) == [7, *[8] * 14, 7] and ends_light_blocks(9, 4) == [2, 3, 2, 2]

    def compute(cfg, blocks):
        return step_time(cfg, 2048, 16, PlanLayout(pp=2, micro_batch=1, pp_stage_blocks=blocks), H100).compute

    light = ONE_B.model_copy(update={"n_layers": 4, "vocab_size": 512})  # a head far cheaper than a block
    heavy = light.model_copy(update={"dim": 256, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 512,
                                     "vocab_size": 131072})  # a head of several blocks' compute
    assert compute(light, (2, 2)) < compute(light, (3, 1)) < compute(light, (1, 3))
    assert compute(light, (3, 1)) == pytest.approx(1.5 * compute(light, (2, 2)), rel=0.01)  # 3 blocks, not 2 + head
    assert compute(heavy, (3, 1)) < compute(heavy, (2, 2))  # the head's stage is the slowest: fewer blocks on it
    # Each rank's gradients are reduced and stepped at its own parameters, the slowest rank's ending
    # the step: 3 blocks and the embedding, or 3 blocks and the tied head's copy, alike.
    tied = light.model_copy(update={"tie_embeddings": True})
    optimizer = {blocks: step_time(tied, 2048, 16, PlanLayout(pp=2, micro_batch=1, pp_stage_blocks=blocks),
                                   H100).optimizer for blocks in ((3, 1), (1, 3), (2, 2))}
    assert optimizer[(3, 1)] == pytest.approx(optimizer[(1, 3)], rel=1e-3)
    assert optimizer[(2, 2)] == pytest.approx(optimizer[(3, 1)] * 2 / 3, rel=0.02)  # (the embedding is small here)
    # The head's rank given fewer blocks where the head outweighs what that costs the others (Llama 3
    # 8B's head is 2.1 blocks of FLOPs at 8K: 8, 9, 9, 6 on 4 stages, not 8 each): searched beside
    # the even split, and faster by the step-time model.
    llama8b = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                          max_seq_len=8192)
    head = _head_blocks(llama8b, 8192)
    assert head == pytest.approx(6 * 128256 * 4096 / (6 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
                                                     + 6 * 4096 * 8192))  # (attention's scores, causal half)
    assert head_balanced_blocks(32, 4, 1, "1f1b", head) == [8, 9, 9, 6]
    assert head_balanced_blocks(32, 2, 2, "interleaved_1f1b", head) == [9, 8, 8, 7]  # (rank 1: stages 1 and 3)
    assert head_balanced_blocks(126, 16, 1, "1f1b", 0.1) == ends_light_blocks(126, 16)  # (a small head: no move)
    fits, _ = candidates(llama8b, 8192, 64, 4, H100)
    timed = {}
    for c in fits:
        if c.layout.pp == 4 and c.layout.pp_schedule == "1f1b" and c.layout.dp == 1:
            timed[c.layout.pp_stage_blocks] = min(c.seconds_per_token, timed.get(c.layout.pp_stage_blocks, math.inf))
    assert set(timed) == {None, (8, 9, 9, 6)} and timed[(8, 9, 9, 6)] < timed[None]
    # 6 blocks on 4 devices: a pipeline of 4 only unevenly, its memory that of its heaviest rank.
    base = load_config(None, ["model.vocab_size=32768", "model.dim=4096", "model.n_layers=6", "model.n_heads=32",
                              "model.max_seq_len=2048", "data.seq_len=2048", "train.steps=10", "train.micro_batch=1",
                              "train.global_batch_tokens=65536"])
    fits, _ = candidates(base.model, 2048, 32, 4, H100)
    piped = next(c for c in fits if c.layout.pp == 4)
    assert piped.layout.pp_stage_blocks == (1, 2, 2, 1) and "pp 4 (1f1b, blocks 1, 2 x 2, 1)" in describe(piped.layout)
    assert piped.memory == training_memory(base.model, 2048, 1, micro_steps=32, recompute=piped.layout.recompute,
                                           pp=4, pp_stage_blocks=(1, 2, 2, 1), gather_dtype="bf16")
    heavy_ends = training_memory(base.model, 2048, 1, micro_steps=32, recompute=piped.layout.recompute, pp=4,
                                 pp_stage_blocks=(2, 1, 1, 2), gather_dtype="bf16")
    assert heavy_ends.peak > piped.memory.peak  # (the first rank, with the most micro-batches in flight, holds 2 blocks)
    plan = {"layout": {"layout": piped.layout.to_dict()}, "tokens": 10 * piped.global_batch * 2048,
            "hyperparameters": {"global_batch_tokens": piped.global_batch * 2048},
            "run": {"step_s": 1.0, "checkpoint_write_s": 0.1, "checkpoint_interval_steps": 100}}
    config = planned_config(plan, Hardware(H100, 4, 8), base=base)
    assert config.parallel.pp_stage_blocks == [1, 2, 2, 1]  # (and planned_config checked the layout as train does)
    # The run, set against its plan read back from JSON, finds the layout it was planned with.
    trained = PlanLayout.of(config, resolve_layout(config.parallel, 4)).to_dict()
    assert json.loads(json.dumps(plan["layout"]["layout"])) == trained


def test_a_model_with_a_sliding_window_is_not_planned_under_context_parallelism():
    """Train refuses context parallelism with a window shorter than the sequence; nor does the
    search offer it, even where asked to."""
    windowed = ONE_B.model_copy(update={"sliding_window": 1024, "max_seq_len": 8192})
    fits, _ = candidates(windowed, 8192, 16, 16, H100, allow_cp=True)
    assert fits and {c.layout.cp for c in fits} == {1}
    spanning = windowed.model_copy(update={"sliding_window": 8192})  # (causal attention: cp as before)
    assert any(c.layout.cp > 1 for c in candidates(spanning, 8192, 16, 16, H100, allow_cp=True)[0])


def test_masked_attention_is_timed_as_its_kernel_computes_it():
    """SDPA's mask computes every score (twice causal attention's work); FlexAttention's block
    mask the blocks a window reaches (hand-counted) and within documents at most the causal
    half; context parallelism's chunks the causal half either way. The step's compute follows,
    and FlexAttention's window keeps no mask of the scores' shape in memory."""
    cfg = ONE_B.model_copy(update={"max_seq_len": 8192})
    window, flex = {"sliding_window": 1024}, {"attention_kernel": "flex"}
    documents = {"document_mask": True}
    # 64 query blocks of 128; a window of 1,024 reaches ceil(1023 / 128) + 1 = 9 key blocks:
    # 1 + 2 + ... + 9 for the first nine query blocks, 9 for each of the other 55.
    assert scores_computed(cfg.model_copy(update={**window, **flex}), 8192) == (45 + 55 * 9) * 128 ** 2 / 8192 ** 2
    assert scores_computed(cfg, 8192) == 0.5
    assert scores_computed(cfg.model_copy(update=window), 8192) == 1.0
    assert scores_computed(cfg.model_copy(update=documents), 8192) == 1.0
    assert scores_computed(cfg.model_copy(update={**documents, **flex}), 8192) == 0.5
    assert scores_computed(cfg.model_copy(update={**documents, **flex}), 8192, cp=2) == 0.5
    assert scores_computed(cfg.model_copy(update={**window, **flex, "sliding_window": 8000}), 8192) == 0.5
    layout = PlanLayout(micro_batch=1)
    causal, sdpa, windowed = (step_time(cfg.model_copy(update=update), 8192, 8, layout, H100)
                              for update in ({}, window, {**window, **flex}))
    attention = 8 * 8192 * 16 * 12 * 32 * 64 * 8192 / (H100.peak["bf16"] * Efficiency().matmul)  # (full matrix, a step)
    assert sdpa.compute - causal.compute == pytest.approx(0.5 * attention, rel=1e-6)
    assert causal.compute - windowed.compute == pytest.approx((0.5 - scores_computed(cfg.model_copy(
        update={**window, **flex}), 8192)) * attention, rel=1e-6)
    masks = [training_memory(cfg.model_copy(update=update), 8192, 1, micro_steps=8).peak
             for update in (window, {**window, **flex}, {})]
    assert masks[0] - masks[1] >= 8192 * 8192 * 2 and masks[1] == masks[2]  # (the (T, T) bias, bf16; and more: see memory)
    # Local and global blocks (model.full_attention_layers): each timed as it attends, the
    # documents' mask kept beside the window's.
    pattern = {"full_attention_layers": [3, 7, 11, 15]}
    assert scores_computed(cfg.model_copy(update={**window, **pattern}), 8192) == (12 * 1.0 + 4 * 0.5) / 16
    assert scores_computed(cfg.model_copy(update={**window, **pattern, **documents}), 8192) == 1.0
    within = scores_computed(cfg.model_copy(update={**window, **flex}), 8192)
    assert scores_computed(cfg.model_copy(update={**window, **flex, **pattern}), 8192) == (12 * within + 4 * 0.5) / 16
    two, one = (training_memory(cfg.model_copy(update={**window, **documents, **extra}), 8192, 1, micro_steps=8).peak
                for extra in (pattern, {}))
    assert two - one == 8192 * 8192 * 2
