"""The benchmarks run and print the JSON they promise (their numbers are recorded in BENCHMARKS.md, not tested)."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_with_retry
from zygote import run_script


def test_cpu_throughput_benchmark_prints_json():
    result = run_script("benchmarks/cpu_throughput.py", "--config", "configs/tiny.toml",
                        "--vocab-size", "512", "--steps", "1", "--documents", "16", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tokens_per_s"] > 0 and 0 < report["mfu_vs_measured_matmul"]
    masked = report["document_mask"]
    assert masked["tokens_per_s"] > 0 and masked["ratio_to_causal"] > 0
    assert masked["saved_bytes_per_micro_batch"] > masked["causal_saved_bytes"] > 0  # the masks, one per block
    assert report["model_gflops_per_s"] == pytest.approx(report["tokens_per_s"] * report["train_flops_per_token"] / 1e9, rel=1e-2)


def test_gpu_suite_runs_its_configs_ablations_and_resume_check_on_tiny_shapes(tmp_path):
    out = tmp_path / "suite.json"
    result = run_script("benchmarks/gpu_suite.py", "--tiny", "--configs", "llama-126m",
                        "--steps", "4", "--warmup", "2", "--log-every", "2", "--out", str(out), "--work",
                        str(tmp_path / "work"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = [report["configs"]["llama-126m"], *report["ablations"].values()]
    assert len(rows) == 8 and report["ablations"]["llama-126m, loss read every step"]["log_every"] == 1
    for row in rows:
        assert row["timed_steps"] == 2 and row["tokens_per_s"] > 0 and row["step_ms"] > 0
        assert 0 <= row["data_wait_share"] < 1 and row["cold_start_s"] >= 0
        assert len(row["checkpoint_blocking_s"]) == 2  # at step 2 (two thirds of 4, rounded down) and the end
        assert row["mfu"] is None and row["mfu_6n"] is None  # no peak is known for a CPU
    assert report["resume"]["bit_exact"] and report["resume"]["repeatable"] and report["suite_s"] > 0
    assert "llama-126m" in result.stdout.splitlines()[1]  # the table comes before the JSON
    # The reference measured in the same process, as a bare loop: a row of its own, and the ratio.
    plain = report["baselines"]["llama-126m"]
    assert plain["timed_steps"] == 2 and plain["tokens_per_s"] > 0 and math.isfinite(plain["final_loss"])
    ratio = report["configs"]["llama-126m"]["mean_tokens_per_s"] / plain["mean_tokens_per_s"]
    assert f"x{ratio:.2f}; " in result.stdout.splitlines()[1]
    assert any(line.startswith("plain loop: llama-126m") for line in result.stdout.splitlines())
    runs = tmp_path / "work" / "runs"  # each measured run's checkpoints removed once measured
    assert (runs / "llama-126m" / "metrics.jsonl").exists() and not list(runs.glob("llama-126m/checkpoints/step_*"))
    assert not list(runs.glob("ablation-*/checkpoints/step_*"))


def test_the_plain_gpt2_loop_trains_and_counts_its_flops_as_the_trainer_counts_the_suites_gpt2(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite
    import plain_loops

    from scaletrain.config import load_config
    from scaletrain.model.flops import train_flops_per_token

    result = run_script("benchmarks/plain_loops.py", "--tiny", "--names", "gpt2-124m", "--steps", "3", "--warmup", "1",
                        timeout=300)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)["gpt2-124m"]
    assert row["timed_steps"] == 2 and row["tokens_per_s"] > 0 and math.isfinite(row["final_loss"])
    shape, seqs, seq_len = plain_loops.GPT2_SHAPES["gpt2-124m"]
    model = plain_loops.GPT2(**shape, seq_len=seq_len)
    assert sum(p.numel() for p in model.parameters()) == 124_475_904  # nanoGPT's count of its 124M config
    suites = load_config(None, [*gpu_suite.CONFIGS["gpt2-124m"][0], "train.steps=1", f"model.max_seq_len={seq_len}",
                                f"data.seq_len={seq_len}"]).model
    for causal in (False, True):
        assert model.flops_per_token(seq_len, causal) == train_flops_per_token(suites, seq_len, causal)


def test_the_suites_issue_mfu_is_the_count_of_issue_6s_reference_table(monkeypatch):
    """Issue 6 counts 6 N + 12 L d T with N every parameter (its table's MFUs at its tokens/s);
    the trainer's MFU leaves the untied embedding out, so its goals are read against this one."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite

    for name, (_, reference) in gpu_suite.CONFIGS.items():
        assert gpu_suite.issue_mfu(name, reference["tokens_per_s"], "NVIDIA H200") == pytest.approx(reference["mfu"],
                                                                                                   abs=6e-4)
    assert gpu_suite.issue_mfu("llama-126m", 501e3, "cpu") is None


def test_the_suites_budget_leaves_out_the_rows_that_would_not_end_in_time(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite

    now = [0.0]
    budget = gpu_suite.Budget(100, clock=lambda: now[0])
    assert budget.refusal("config") is None  # (nothing timed yet: the first row of a section runs)

    def config_row() -> str:
        now[0] += 60
        return "measured"
    assert budget.row("config", config_row) == "measured"
    assert budget.refusal("config") == "not run: 40 s of the suite's 100 left, less than the longest config row took (60 s)"
    assert budget.refusal("ablation") is None  # another section's rows: their own length
    now[0] = 130
    assert budget.refusal("ablation") == "not run: the suite's 100 s were spent (--budget-s)"
    # A section's row is taken to need at least what it is expected to (the longest of its rows,
    # which may come after shorter ones), and more where one took more.
    now[0] = 0.0
    expecting = gpu_suite.Budget(100, clock=lambda: now[0], expected={"ablation": 30})
    now[0] = 80
    assert expecting.refusal("ablation") == ("not run: 20 s of the suite's 100 left, less than one ablation row "
                                             "is expected to take (30 s)")
    now[0] = 50

    def short_row() -> None:
        now[0] += 10
    expecting.row("ablation", short_row)
    now[0] = 85  # (15 s left: more than the 10 s the row took, less than the 30 expected)
    assert expecting.refusal("ablation").endswith("is expected to take (30 s)") and expecting.refusal("config") is None
    now[0] = 20

    def long_row() -> None:
        now[0] += 40
    expecting.row("ablation", long_row)
    assert expecting.refusal("ablation") == "not run: 40 s of the suite's 100 left, less than the longest ablation row took (40 s)"


def test_loss_chunk_benchmark_prints_both_variants_with_the_same_loss():
    result = run_script("benchmarks/loss_chunk.py", "--tokens", "256", "--dim", "32", "--vocab",
                        "512", "--chunk", "64", "--repeats", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["whole"]["chunk"] == 0 and report["chunked"]["chunk"] == 64
    assert report["loss_difference"] < 1e-5 and report["time_ratio_chunked_over_whole"] > 0


def test_data_wait_benchmark_reports_both_loaders():
    result = run_script("benchmarks/data_wait.py", "--seq-len", "64", "--micro-batch", "4",
                        "--step-ms", "2", "--steps", "8", "--max-bytes", "1000000", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["plain"]["median_wait_ms"] > 0 and report["prefetched"]["median_wait_ms"] >= 0


def test_stop_vote_benchmark_prints_both_variants():
    result = run_with_retry(lambda: subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "benchmarks/stop_vote.py",
         "--steps", "5", "--rounds", "1", "--width", "16"], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), "the stop-vote benchmark")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["step_us_with_vote"] > 0 and report["step_us_without_vote"] > 0


def test_pipeline_schedules_benchmark_times_each_schedule_beside_the_model(stdlib_data):
    result = run_script("benchmarks/pipeline_schedules.py", "--data", str(stdlib_data), "--schedules", "dualpipev",
                        "--steps", "3", "--dim", "64", "--layers", "4", "--seq-len", "64", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert set(report["schedules"]) == {"dualpipev m=4", "dualpipev m=8"}
    for name, row in report["schedules"].items():
        assert row["step_s"] > 0 and row["predicted_s"] > 0 and row["predicted_bubble"] == 0.333, name
    assert report["timed_steps"] == 1 and math.isfinite(report["microbatch_s"])  # (two steps' slope: noise may zero it)


def test_plan_backtest_prints_a_prediction_beside_each_published_figure():
    result = run_script("benchmarks/plan_backtest.py", timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 9
    for row in rows:
        published = [k for k in row if k.startswith("published_")]
        assert published and all(row[k.replace("published_", "predicted_")] > 0 for k in published)
    searched = [row["searched"] for row in rows if "searched" in row]  # (the planner's own layout, Llama 3's rows)
    assert len(searched) == 3 and all(s["predicted_mfu"] > 0 and s["layout"] for s in searched)
    assert " cp " in searched[-1]["layout"]  # (128 sequences of 128K on 16,384 GPUs: only split sequences fit)
    # (126 blocks on 16,384 GPUs: pipelines of stages of unequal blocks, which no even split gives)
    assert " pp " in searched[1]["layout"] and "blocks " in searched[1]["layout"]


def test_moe_layer_benchmark_prints_json():
    result = run_script("benchmarks/moe_layer.py", "--tokens", "64", "--dim", "32",
                        "--experts", "4", "--repeats", "1", timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["moe_ms"] > 0 and report["dense_same_flops_ms"] > 0 and report["overhead"] > 0
    assert report["grouped_gemm"] is True and report["moe_loop_ms"] > 0  # a CPU runs the grouped GEMM


def test_spike_scores_benchmark_tells_a_real_spike_from_an_ordinary_run(stdlib_data):
    result = run_script("benchmarks/spike_scores.py", "configs/tiny.toml", f"data.path={stdlib_data}",
                        "train.steps=40", "--windows", "10,20", "--boost", "30", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    for window, entry in report["windows"].items():
        assert entry["judged_steps"] == 40 - int(window)
        assert entry["boosted_spike_sigmas"] > max(entry["max_sigmas"], 4)


def test_optimizers_benchmark_trains_both_and_muon_holds_fewer_optimizer_bytes(stdlib_data):
    result = run_script("benchmarks/optimizers.py", "configs/tiny.toml",
                        f"data.path={stdlib_data}", "train.steps=6", "eval.interval=3", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    adamw, muon = report["adamw"], report["muon"]
    assert set(adamw["val_loss_by_step"]) == set(muon["val_loss_by_step"]) == {"3", "6"}
    assert adamw["train_loss_last_tenth"] != muon["train_loss_last_tenth"]
    assert muon["optimizer_bytes"] < 0.75 * adamw["optimizer_bytes"] and report["muon_step_time_ratio"] > 0


def test_muon_step_benchmark_prints_json_and_finds_both_ways_equal():
    result = run_script("benchmarks/muon_step.py", "--dim", "64", "--layers", "1",
                        "--repeats", "1", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["identical"] and report["matrices"] == 7 and report["gathered_s"] > 0 and report["shared_out_s"] > 0


def test_task_scoring_benchmark_compares_gathered_and_split_logits_over_two_processes():
    result = run_script("benchmarks/task_scoring.py", "--rows", "2", "--seq-len", "64",
                        "--vocab", "512", "--repeats", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["difference"] < 1e-6 and report["gathered"]["median_s"] > 0 and report["split"]["median_s"] > 0


def test_mup_transfer_benchmark_trains_every_width_or_depth_and_rate_both_ways(stdlib_data):
    result = run_script("benchmarks/mup_transfer.py", "configs/tiny.toml", f"data.path={stdlib_data}",
                        "train.steps=3", "--widths", "32,64", "--lrs", "0.001,0.01", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    standard, mup = report["standard"], report["mup"]
    assert report["mup_base_dim"] == 32
    assert standard["val_loss"]["32"] == mup["val_loss"]["32"]  # the same model at the base width
    assert standard["val_loss"]["64"] != mup["val_loss"]["64"]
    for entry in (standard, mup):
        assert set(entry["val_loss"]["64"]) == {"0.001", "0.01"} and entry["best_lr"]["64"] in (0.001, 0.01)
    # Across depth: depth-wise muP on a base of one block.
    result = run_script("benchmarks/mup_transfer.py", "configs/tiny.toml", f"data.path={stdlib_data}",
                        "train.steps=3", "--depths", "1,3", "--lrs", "0.01", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    standard, mup = report["standard"], report["mup"]
    assert report["mup_base_layers"] == 1 and report["depths"] == [1, 3]
    assert standard["val_loss"]["1"] == mup["val_loss"]["1"] and standard["val_loss"]["3"] != mup["val_loss"]["3"]


def test_mtp_benchmark_trains_each_depth_and_sets_it_against_the_first(stdlib_data):
    result = run_script("benchmarks/mtp.py", "configs/tiny.toml", f"data.path={stdlib_data}",
                        "train.steps=2", "eval.interval=1", "--depths", "0,1", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    plain, mtp = report["depths"]["0"], report["depths"]["1"]
    assert set(plain["val_loss"]) == {"1", "2"} and plain["mtp_loss"] is None and mtp["mtp_loss"] > 0
    assert plain["final_val_loss_minus_first"] == 0 and mtp["flops_ratio_to_first"] > 1
    assert mtp["val_loss"]["1"] != plain["val_loss"]["1"]  # its gradient reaches the trunk from the first update
