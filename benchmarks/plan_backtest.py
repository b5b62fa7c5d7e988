"""The planner's step-time model against published training throughput at scale.

Each row is a run whose model, hardware, layout and measured throughput were published; the
planner times the same layout (plan/timing.py) and the row prints both. The two single-H200
measurements the model's constants were fitted to are printed too, marked as calibration: the
others are out-of-sample. Pure arithmetic, runs in a second; prints JSON (one object a row).

Sources:
- Llama 3 405B on H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", tables 3 and 4,
  sections 3.3.1-3.3.2): 126 layers, width 16,384, FFN 53,248, 128 heads, 8 KV heads,
  vocabulary 128,000; 8 GPUs a node on NVLink, 400 Gb/s per GPU; FSDP over DP; no activation
  recomputation at 8K context. BF16 MFU as published. Their context parallelism's attention
  skips the masked half of the scores, as parallel/context.py's does. The 131K-context row prints DP = 4 in the
  paper; 8 is the value its GPU and token counts imply.
- Megatron-LM on A100s (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", table 1): GPT models, sequence 2,048, vocabulary 51,200,
  full recomputation, interleaved schedule, plain data parallelism (all-reduce); 8 x 200 Gb/s
  HDR InfiniBand a node (Selene). Their TFLOP/s per GPU count the recomputed forward:
  F = 96 B s l h^2 (1 + s/6h + V/16lh) per step; the row compares the step time that implies.

Assumptions the papers leave open, the same for every row: one sequence a micro-batch; two
interleaved stages a rank, their blocks split evenly or, where they do not divide, with the first
and last stages lighter (Llama 3's 126 blocks on 32 stages: 3, 4 x 30, 3); GELU MLPs of width 4h
timed as SwiGLU of width 8h/3 (the same FLOPs); multi-head attention where the paper has no GQA.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from scaletrain.config import ModelConfig  # noqa: E402
from scaletrain.parallel.layout import ends_light_blocks  # noqa: E402
from scaletrain.plan.hardware import device, device_from_dict  # noqa: E402
from scaletrain.plan.search import describe, search  # noqa: E402
from scaletrain.plan.timing import PlanLayout, step_time  # noqa: E402


def llama3(gpus: int, tp: int, cp: int, pp: int, dp: int, seq: int, batch_per_dp: int, mfu: float) -> dict:
    cfg = ModelConfig(vocab_size=128000, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                      max_seq_len=seq)
    layout = PlanLayout(dp_shard=dp, tp=tp, cp=cp, pp=pp, micro_batch=1, pp_schedule="interleaved_1f1b",
                        pp_stages_per_rank=2, pp_stage_blocks=_stage_blocks(cfg.n_layers, 2 * pp))
    assert layout.world_size == gpus
    t = step_time(cfg, seq, dp * batch_per_dp, layout, device("H100 SXM"))
    # The planner's own choice for the same model, batch and devices (context parallelism where
    # nothing fits without it, as train would search it).
    best = search(cfg, seq, dp * batch_per_dp, gpus, device("H100 SXM"), fixed_batch=True, top=1)[0]
    return {"run": f"Llama 3 405B, {gpus} H100, TP{tp} CP{cp} PP{pp} DP{dp}, seq {seq}",
            "published_mfu": mfu, "predicted_mfu": round(t.mfu, 4), "predicted_mfu_causal": round(t.mfu_causal, 4),
            "predicted_step_s": round(t.total, 3), "breakdown": _breakdown(t),
            "searched": {"layout": describe(best.layout), "predicted_mfu": round(best.time.mfu, 4),
                         "predicted_mfu_causal": round(best.time.mfu_causal, 4),
                         "peak_gb": round(best.memory.peak / 1e9, 1)}}


def megatron(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
             tflops: float) -> dict:
    seq, vocab = 2048, 51200
    cfg = ModelConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads, ffn_dim=8 * hidden // 3,
                      max_seq_len=seq)
    dp = gpus // (tp * pp)
    layout = PlanLayout(dp_replicate=dp, dp_shard=1, tp=tp, pp=pp, micro_batch=1, recompute="full",
                        pp_schedule="interleaved_1f1b", pp_stages_per_rank=2,
                        pp_stage_blocks=_stage_blocks(layers, 2 * pp))
    selene = device_from_dict({"inter_node_gbs": 25}, device("A100"))
    t = step_time(cfg, seq, batch, layout, selene)
    flops = 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    measured = flops / (gpus * tflops * 1e12)
    return {"run": f"Megatron-LM GPT {params}, {gpus} A100, TP{tp} PP{pp} DP{dp}", "published_tflops": tflops,
            "predicted_tflops": round(flops / (gpus * t.total) / 1e12, 1), "published_step_s": round(measured, 2),
            "predicted_step_s": round(t.total, 2), "breakdown": _breakdown(t)}


def _stage_blocks(n_layers: int, stages: int) -> tuple[int, ...] | None:
    """An even split (None), or where the blocks do not divide the first and last stages lighter,
    as Llama 3's 126 blocks were split (section 3.3.2)."""
    return None if n_layers % stages == 0 else tuple(ends_light_blocks(n_layers, stages))


def calibration(name: str, cfg: ModelConfig, batch: int, tokens_per_s: float) -> dict:
    t = step_time(cfg, 2048, batch, PlanLayout(micro_batch=batch), device("H200"))
    return {"run": f"{name} on one H200 (calibration point, not a prediction)", "published_tokens_per_s": tokens_per_s,
            "predicted_tokens_per_s": round(t.tokens_per_s)}


def _breakdown(t) -> dict:
    keys = ("compute", "recompute", "tensor_parallel", "context_parallel", "data_parallel", "pipeline_bubble",
            "pipeline_sends", "optimizer")
    return {key: round(getattr(t, key) / t.total, 3) for key in keys if getattr(t, key)}


def main() -> None:
    rows = [
        calibration("Llama 126M", ModelConfig(vocab_size=32768, dim=768, n_layers=12, n_heads=12, n_kv_heads=4), 16,
                    501e3),
        calibration("Llama 1.1B", ModelConfig(vocab_size=32768, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                              ffn_dim=8192), 8, 72.5e3),
        llama3(8192, 8, 1, 16, 64, 8192, 32, 0.43),
        llama3(16384, 8, 1, 16, 128, 8192, 16, 0.41),
        llama3(16384, 8, 16, 16, 8, 131072, 16, 0.38),
        megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
        megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
        megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
        megatron("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    ]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
