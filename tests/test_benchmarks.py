"""The benchmarks run and print the JSON they promise (their numbers are recorded in BENCHMARKS.md, not tested)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


def test_cpu_throughput_benchmark_prints_json():
    result = subprocess.run([sys.executable, "benchmarks/cpu_throughput.py", "--config", "configs/tiny.toml",
                             "--vocab-size", "512", "--steps", "1"], capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tokens_per_s"] > 0 and 0 < report["mfu_vs_measured_matmul"]
    assert report["model_gflops_per_s"] == pytest.approx(report["tokens_per_s"] * report["train_flops_per_token"] / 1e9, rel=1e-2)
