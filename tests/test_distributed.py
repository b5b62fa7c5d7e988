"""Data parallelism in real processes over gloo: every layout trains the losses of one process
on the same global batch, and a checkpoint saved by one layout resumes in another."""

from __future__ import annotations

import pytest

from conftest import run_cli, tiny_config
from scaletrain.config import ConfigError, ParallelConfig
from scaletrain.parallel.mesh import resolve_layout
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

STEPS = ["train.steps=6", "eval.interval=3", "checkpoint.interval=3"]


def records(run_dir, kind):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, kind)}


# Failures of the machinery rather than of the code under test: a port taken between torchrun
# choosing it and binding it, a loopback connection dropped on an overloaded 2-core machine.
TRANSIENT = ("Address already in use", "EADDRINUSE", "Connection reset by peer", "Connection closed by peer")


def launch(stdlib_data, run_dir, nproc: int, *overrides: str):
    """`scaletrain train configs/tiny.toml --nproc N` as a user runs it (torchrun, gloo); one
    retry, from the same state, when the launch itself failed for a transient network reason."""
    args = ["train", "configs/tiny.toml", f"data.path={stdlib_data}", f"run.dir={run_dir.parent}",
            f"run.name={run_dir.name}", *STEPS, *overrides, f"--nproc={nproc}"]
    result = run_cli(*args, timeout=240)
    if result.returncode != 0 and any(word in result.stderr for word in TRANSIENT):
        print("retrying a launch that failed for a transient reason:\n" + result.stderr[-2000:])
        result = run_cli(*args, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train(tiny_config(stdlib_data, run_dir, *STEPS))
    return run_dir


def assert_parity(run_dir, reference, tolerance=1e-5):
    for kind in ("train", "eval"):
        got, expected = records(run_dir, kind), records(reference, kind)
        assert sorted(got) == sorted(expected), kind
        for step in expected:
            assert abs(got[step] - expected[step]) <= tolerance, (kind, step, got[step], expected[step])


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
                                    ["parallel.dp_shard=2", "train.micro_batch=2", "parallel.recompute=selective"],
                                    ["parallel.tp=2", "parallel.dp_shard=1"],
                                    ["parallel.tp=2", "parallel.dp_shard=2"]],
                         ids=["fsdp", "replicate", "fsdp-grad-accumulation-recompute", "tp", "fsdp-x-tp"])
def test_parallel_layouts_train_the_losses_of_one_process(stdlib_data, reference, tmp_path, layout):
    run_dir = tmp_path / "run"
    nproc = 4 if "parallel.dp_shard=2" in layout and "parallel.tp=2" in layout else 2
    launch(stdlib_data, run_dir, nproc, *layout)
    assert_parity(run_dir, reference)


def test_each_rank_reports_the_bytes_it_holds(stdlib_data, reference, tmp_path):
    """Sharding over 2 ranks halves what each holds (up to the split of odd-sized tensors)."""
    run_dir = tmp_path / "run"
    launch(stdlib_data, run_dir, 2, "parallel.dp_shard=2", "train.steps=1", "--stop-at-step=1")
    sharded = read_metrics(run_dir, "memory")[0]["bytes_by_rank"]
    whole = read_metrics(reference, "memory")[0]["bytes_by_rank"][0]
    assert len(sharded) == 2
    for component in ("parameters", "gradients", "optimizer"):
        assert sum(rank[component] for rank in sharded) == pytest.approx(whole[component], rel=0.01), component
        assert max(rank[component] for rank in sharded) < 0.55 * whole[component], component
    assert whole["optimizer"] > 2 * whole["parameters"]  # AdamW: two moments per parameter, plus step counts


def test_a_sharded_run_resumes_exactly_in_the_same_layout(stdlib_data, reference, tmp_path):
    run_dir = tmp_path / "run"
    launch(stdlib_data, run_dir, 2, "parallel.dp_shard=2", "--stop-at-step=3")
    launch(stdlib_data, run_dir, 2, "parallel.dp_shard=2")
    assert_parity(run_dir, reference)


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.tp=2", "parallel.dp_shard=1"]],
                         ids=["fsdp", "tp"])
def test_a_checkpoint_of_two_ranks_resumes_in_one_process(stdlib_data, reference, tmp_path, layout):
    """Saved by 2 ranks at step 3, resumed by one process: the same losses as a run that never
    changed layout, and the data continues where it stopped."""
    run_dir = tmp_path / "run"
    launch(stdlib_data, run_dir, 2, *layout, "--stop-at-step=3")
    assert max(records(run_dir, "train")) == 3
    train(tiny_config(stdlib_data, run_dir, *STEPS))
    assert_parity(run_dir, reference)


@pytest.mark.parametrize("replicate, shard, world, words", [
    (1, 3, 2, "1 x 3 x 1 = 3, but 2 processes"),
    (3, -1, 4, "dp_replicate = 3 x parallel.tp = 1 does not divide the 4 processes"),
])
def test_a_layout_that_does_not_fit_the_processes_is_refused_with_the_constraint(replicate, shard, world, words):
    with pytest.raises(ConfigError, match=words):
        resolve_layout(ParallelConfig(dp_replicate=replicate, dp_shard=shard), world)


@pytest.mark.parametrize("override, words", [
    ("model.n_heads=3", "model.n_heads = 3 is not divisible by parallel.tp = 2"),
    ("model.tie_embeddings=true", "model.tie_embeddings = true is not supported with parallel.tp > 1"),
    ("data.seq_len=63 train.global_batch_tokens=504", "data.seq_len = 63 is not divisible by parallel.tp = 2"),
])
def test_a_model_that_tensor_parallelism_cannot_split_is_refused(stdlib_data, tmp_path, override, words):
    from scaletrain.parallel.mesh import check_model_fits

    overrides = override.split() + (["model.dim=96", "model.n_kv_heads=3"] if "n_heads" in override else [])
    cfg = tiny_config(stdlib_data, tmp_path / "run", "model.vocab_size=4096", *overrides)
    with pytest.raises(ConfigError, match=words):
        check_model_fits(resolve_layout(ParallelConfig(tp=2, dp_shard=1), 2), cfg.model, cfg.data.seq_len)


def test_layouts_resolve_all_remaining_processes():
    assert resolve_layout(ParallelConfig(), 4).dp_shard == 4
    assert resolve_layout(ParallelConfig(dp_replicate=2), 4).dp_shard == 2
    assert resolve_layout(ParallelConfig(tp=2), 8).dp_shard == 4


def test_nproc_with_a_layout_that_does_not_fit_is_one_line_before_any_process_starts(stdlib_data, tmp_path):
    result = run_cli("train", "configs/tiny.toml", f"data.path={stdlib_data}", f"run.dir={tmp_path}",
                     "parallel.dp_shard=3", "--nproc=2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "1 x 3 x 1 = 3, but 2 processes" in result.stderr
