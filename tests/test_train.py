"""Training end to end on a tiny model and real text: resume is bit-exact, checkpoints are safe."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import glitched, nan_norm_once_after, run_cli, tiny_config
from scaletrain.config import ConfigError
from scaletrain.parallel.mesh import shutdown
from scaletrain.plan.cost import Reliability, expected_wall_s
from scaletrain.report.goodput import account
from scaletrain.train import checkpoint
from scaletrain.train.metrics import Heartbeat, read_metrics
from scaletrain.train.resilience import StoppedBySignal, loss_spike
from scaletrain.train.trainer import Trainer, TrainingDiverged, train

# Records time to the millisecond and setup_s too (train/metrics.py): the parts of a run's
# wall-clock, added up, can pass it by a few of those roundings (CI once saw 0.4 ms).
ROUNDING_S = 5e-3


def losses(run_dir: Path, kind: str = "train") -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, kind)}


def test_resume_is_bit_exact_with_grad_accumulation_and_eval(stdlib_data, tmp_path):
    """2k steps in one go vs k steps, stop, resume: every later train and eval loss is identical.

    Cosine schedule, 2 micro-batches per step, an eval pass before the stop and after it; the
    interrupted run goes through the CLI in two fresh processes, as a user would run it.
    """
    k = 6
    common = ["train.steps=12", "eval.interval=4", "checkpoint.interval=5", "train.warmup_steps=3"]
    whole = tmp_path / "whole"
    train(tiny_config(stdlib_data, whole, *common))

    split = tmp_path / "split"
    args = ["train", "configs/tiny.toml", f"data.path={stdlib_data}", f"run.dir={tmp_path}", "run.name=split", *common]
    first = run_cli(*args, f"--stop-at-step={k}")
    assert first.returncode == 0, first.stderr
    assert "stopped at step 6" in first.stdout
    assert max(losses(split)) == k
    second = run_cli(*args)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr

    expected, got = losses(whole), losses(split)
    assert sorted(got) == list(range(1, 13))
    for step in range(k + 1, 13):
        assert got[step] == expected[step], f"step {step}: {got[step]!r} != {expected[step]!r}"
    assert losses(split, "eval") == losses(whole, "eval")  # steps 4, 8, 12
    # The gradient noise scale's moving averages are checkpointed with the rest.
    noise = [{r["step"]: r["noise_scale"] for r in read_metrics(run, "train")} for run in (whole, split)]
    assert all(noise[1][step] == noise[0][step] for step in range(k + 1, 13))
    assert len(losses(whole, "eval")) == 3
    # Logged every 3 steps, so that the stop's step is looked at only because it stops: the
    # noise scale takes in the steps a run that never stopped looks at, not the stop's.
    logged = [*common, "log.interval=3"]
    train(tiny_config(stdlib_data, tmp_path / "whole-3", *logged))
    train(tiny_config(stdlib_data, tmp_path / "split-3", *logged), stop_at_step=7)
    train(tiny_config(stdlib_data, tmp_path / "split-3", *logged))
    noise = [{r["step"]: (r["loss"], r.get("noise_scale"), r.get("noise_trace")) for r in read_metrics(run, "train")}
             for run in (tmp_path / "whole-3", tmp_path / "split-3")]
    assert all(noise[1][step] == noise[0][step] for step in (9, 12))


@pytest.mark.parametrize("setting, package", [("log.tensorboard=true", "tensorboard"),
                                              ("log.wandb_project=p", "wandb")])
def test_a_tracker_whose_package_is_missing_is_a_config_error_before_training(stdlib_data, tmp_path, monkeypatch,
                                                                             setting, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` finds when the package is not installed
    with pytest.raises(ConfigError, match=rf"needs the {package} package.*pip install 'scaletrain\[{package}\]'"):
        Trainer(tiny_config(stdlib_data, tmp_path / "run", "train.steps=1", setting))
    assert not (tmp_path / "run").exists()


def test_weights_and_biases_failing_to_start_is_a_config_error_that_says_what_to_do(stdlib_data, tmp_path,
                                                                                     monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise RuntimeError("api key not configured (no-tty)")
    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError, match=r"log.wandb_project = 'p': Weights & Biases did not start \(api key not "
                                          r"configured \(no-tty\)\); run `wandb login`, or set WANDB_MODE=offline"):
        train(tiny_config(stdlib_data, tmp_path / "run", "train.steps=1", "log.wandb_project=p"))
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))  # nothing trained


def test_mfu_divides_the_jobs_flops_by_the_peak_of_all_its_devices(stdlib_data, tmp_path):
    """tokens/s counts the whole job's batch, so its MFU is against every device's peak: a
    4-way data-parallel job at the speed of one device at full peak is at 25%."""
    import dataclasses

    trainer = Trainer(tiny_config(stdlib_data, tmp_path / "run", "train.steps=1"))
    trainer.peak_flops = 1e12  # a CPU's peak is not known; as for one of a GPU's
    full = 1e12 / trainer.flops_per_token
    assert trainer.mfu(full) == pytest.approx(1.0)
    trainer.layout = dataclasses.replace(trainer.layout, dp_shard=4)
    assert trainer.mfu(full) == pytest.approx(0.25)
    assert trainer.mfu(full, causal=True) == pytest.approx(0.25 * trainer.causal_flops_per_token / trainer.flops_per_token)


def test_metrics_records_carry_the_documented_fields(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    result = train(tiny_config(stdlib_data, run_dir, "train.steps=4", "eval.interval=2"))
    assert result.step == 4 and result.tokens == 4 * 512
    records = read_metrics(run_dir)
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end" and "checkpoint" in kinds
    for r in read_metrics(run_dir, "train"):
        for key in ["step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb", "data_wait_ms"]:
            assert key in r, key
        assert r["mfu"] is None  # no peak FLOP/s is known for a CPU
        assert r["tokens_per_s"] > 0 and r["mem_gb"] > 0
    assert [r["step"] for r in read_metrics(run_dir, "eval")] == [2, 4]
    assert all(r["measured_tokens"] == 1024 for r in read_metrics(run_dir, "eval"))  # (tiny.toml's eval.tokens)
    assert (run_dir / "config.toml").is_file() and (run_dir / "tokenizer.json").is_file()
    resolved = (run_dir / "config.toml").read_text()
    assert "vocab_size = 512" in resolved  # filled in from the tokenizer


def test_training_lowers_the_loss_and_says_the_time_left(stdlib_data, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        train(tiny_config(stdlib_data, run_dir, "train.steps=30", "eval.interval=0"))
    values = losses(run_dir)
    assert sum(list(values.values())[-5:]) / 5 < values[1] - 0.5
    # The time left, at the pace of the tokens since the first step (which pays one-off costs): from
    # the second step on, and not at the last.
    lines = [r.getMessage() for r in caplog.records if " tok/s" in r.getMessage()]
    assert [line.split()[1] for line in lines] == [f"{step}/30" for step in range(1, 31)]
    left = [float(re.search(r"  ([\d.]+) s left$", line).group(1)) for line in lines[1:-1]]
    assert all(seconds >= 0 for seconds in left) and left[0] > left[-1]
    assert not lines[0].endswith("left") and not lines[-1].endswith("left")


def test_checkpoints_are_committed_pointed_to_and_pruned(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=8", "checkpoint.interval=2", "checkpoint.keep=2",
                      "eval.interval=0"))
    root = run_dir / "checkpoints"
    assert [p.name for p in checkpoint.all_checkpoints(root)] == ["step_0000008", "step_0000006"]
    assert (root / "latest").read_text().strip() == "step_0000008"
    marker = json.loads((root / "step_0000008" / checkpoint.MARKER).read_text())
    assert marker["step"] == 8 and ".metadata" in marker["files"]
    # checkpoint.keep_every: the multiples of 4 stay beside the 2 newest, saved in the background too
    kept = tmp_path / "kept"
    train(tiny_config(stdlib_data, kept, "train.steps=10", "checkpoint.interval=2", "checkpoint.keep=2",
                      "checkpoint.keep_every=4", "checkpoint.async_save=true", "eval.interval=0"))
    assert [p.name for p in checkpoint.all_checkpoints(kept / "checkpoints")] == ["step_0000010", "step_0000008",
                                                                                 "step_0000004"]
    # A stop's checkpoint (step 3, between the scheduled ones) is kept while checkpoint.keep has room beside
    # them, and never in place of one: the run keeps the scheduled checkpoints a run that never stopped keeps.
    for keep, names in ((3, ["step_0000008", "step_0000004", "step_0000003"]), (2, ["step_0000008", "step_0000004"])):
        stopped = tmp_path / f"stopped-{keep}"
        common = ["train.steps=8", "checkpoint.interval=4", f"checkpoint.keep={keep}", "eval.interval=0"]
        train(tiny_config(stdlib_data, stopped, *common), stop_at_step=3)
        assert not checkpoint.is_scheduled(stopped / "checkpoints" / "step_0000003")
        train(tiny_config(stdlib_data, stopped, *common))
        assert [p.name for p in checkpoint.all_checkpoints(stopped / "checkpoints")] == names, keep


def test_an_automatic_interval_is_dalys_from_what_the_run_measures(stdlib_data, tmp_path):
    """checkpoint.interval = "auto": the first save after a tenth of the run, then each after the
    steps that Daly's interval (no less than the blocking) takes at the measured step
    time (in whole steps as the planner takes them: plan/cost.whole_steps), and at every multiple
    of keep_every; a resumed run measures again from its first save."""
    common = ["train.steps=60", "checkpoint.interval=auto", "checkpoint.failures_per_device_hour=20000",
              "checkpoint.keep_every=25", "checkpoint.keep=100", "eval.interval=0", "log.interval=5"]
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, *common))
    records = read_metrics(run_dir, "checkpoint")
    assert records[0]["step"] == 6 and records[-1]["step"] == 60 and "interval_steps" not in records[-1]
    mtbf = 3600 / 20000
    for record, after in zip(records, records[1:]):  # (a keep_every save comes between, and schedules anew)
        assert after["step"] == min(record["step"] + record["interval_steps"], 25 * (record["step"] // 25 + 1), 60)
        blocking, x = record["measured_blocking_s"], record["measured_blocking_s"] / (2 * mtbf)
        daly = math.sqrt(2 * blocking * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - blocking if x < 1 else mtbf
        daly = max(daly, blocking)
        if after is not records[-1]:
            assert record["mtbf_s"] == mtbf and record["measured_blocking_s"] == pytest.approx(record["blocking_s"],
                                                                                               abs=1e-4)
            step_s = record["measured_step_s"]
            steps, shortest = daly / step_s, max(1, math.ceil(blocking / step_s))
            # the fewer or the more whole steps, whichever the rest of the run expects to end sooner with
            left = (60 - record["step"]) * step_s
            best = min({max(shortest, math.floor(steps)), max(shortest, math.ceil(steps))}, key=lambda k: expected_wall_s(
                left, k * step_s, blocking, blocking, mtbf, Reliability().restart_s))
            assert record["interval_steps"] == best
    assert {25, 50} <= {r["step"] for r in records}
    # (At the default failure rate this run would save at step 6 and at the end; here Daly's interval is
    # a few steps, unless a save blocks on this machine for as long as ten steps or more.)
    assert len(records) > 4 or min(r["interval_steps"] for r in records[:-1]) >= 10
    split = tmp_path / "split"
    train(tiny_config(stdlib_data, split, *common), stop_at_step=30)
    train(tiny_config(stdlib_data, split, *common))
    assert losses(split) == losses(run_dir)  # (step 30, where it stopped, is a logged step anyway)
    assert 36 in {r["step"] for r in read_metrics(split, "checkpoint")}  # the resumed invocation's first save


class RefusingStager:
    """A page-locking stager whose host refuses to lock memory (as a sandbox may: the GPU's
    stager is never made on a CPU, so the refusal is what is injected)."""

    should_synchronize_after_execute = False

    def __init__(self):
        self.staged = self.closed = 0

    def stage(self, state_dict):
        self.staged += 1
        raise RuntimeError("CUDA error: operation not permitted when registering host memory")

    def synchronize_staging(self):
        pass

    def close(self):
        self.closed += 1


def test_background_checkpoints_hold_the_state_of_their_step_and_resume_exactly(stdlib_data, tmp_path, caplog):
    """Async saves every 2 steps while training goes on changing the weights: each checkpoint is
    committed with the state of its own step, and resuming from step 4 logs the losses of the
    run that never stopped — the resumed run's page-locked copies refused, each of its saves
    made with pageable ones after one warning."""
    common = ["train.steps=8", "eval.interval=0", "checkpoint.keep=4", "train.warmup_steps=2"]
    whole = tmp_path / "whole"
    train(tiny_config(stdlib_data, whole, *common, "checkpoint.interval=0"))
    split = tmp_path / "split"
    background = [*common, "checkpoint.interval=2", "checkpoint.async_save=true"]
    train(tiny_config(stdlib_data, split, *background), stop_at_step=5)
    records = read_metrics(split, "checkpoint")
    assert [r["step"] for r in records] == [2, 4, 5] and all(r["background"] for r in records)
    assert all(r["blocking_s"] >= 0 for r in records)
    root = split / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_0000005", "step_0000004", "step_0000002"]
    shutil.rmtree(root / "step_0000005")  # resume from 4, a checkpoint written while steps 5 trained
    trainer = Trainer(tiny_config(stdlib_data, split, *background))
    trainer.stager = refusing = RefusingStager()
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        trainer.fit()
    shutdown()
    assert (refusing.staged, refusing.closed) == (1, 1) and caplog.text.count("page-locked memory failed") == 1
    assert [r["step"] for r in read_metrics(split, "checkpoint")][-2:] == [6, 8]
    assert checkpoint.complete_checkpoints(root)[0].name == "step_0000008"
    expected, got = losses(whole), losses(split)
    assert [got[s] for s in range(5, 9)] == [expected[s] for s in range(5, 9)]


def test_one_stager_serves_every_background_save_into_the_same_host_buffers(tmp_path):
    """The trainer's stager (page-locked on a GPU; pageable here, the same code) copies the state of
    each save in turn into the buffers the first save allocated: torch 2.11's own DefaultStager
    released them after each copy (and failed the next save), so that every save of a GPU run would
    have locked its gigabytes of host memory again while training waited."""
    state = {"w": torch.arange(4.0), "nested": {"m": torch.ones(3)}}
    stager = checkpoint.pinned_stager(pinned=False)
    buffers = set()
    for step in (1, 2, 3):
        state["w"] += 1
        checkpoint.save_async(tmp_path, step, 0, state, keep=3, stager=stager).wait()
        loaded = {"w": torch.zeros(4), "nested": {"m": torch.zeros(3)}}
        checkpoint.load(checkpoint.checkpoint_dir(tmp_path, step), loaded)
        assert torch.equal(loaded["w"], torch.arange(4.0) + step) and torch.equal(loaded["nested"]["m"], torch.ones(3))
        buffers.add(stager.stage(state)["w"].data_ptr())
    stager.close()
    assert len(buffers) == 1


def test_truncated_or_unmarked_newest_checkpoint_falls_back_to_the_previous(stdlib_data, tmp_path, caplog):
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=9", "checkpoint.interval=3", "checkpoint.keep=3",
                      "eval.interval=0")
    train(cfg, stop_at_step=9)
    root = run_dir / "checkpoints"
    newest, middle = root / "step_0000009", root / "step_0000006"
    data_file = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    (middle / checkpoint.MARKER).unlink()  # as if the save had died before its marker

    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        trainer = Trainer(cfg)
        assert trainer.resume() == 3
    text = caplog.text
    assert "step_0000009" in text and "truncated" in text
    assert "step_0000006" in text and "COMMITTED" in text


@pytest.mark.parametrize("damage", ["metadata", "tensor bytes", "unreadable"])
def test_corrupted_checkpoint_of_the_right_size_is_reported_and_skipped(stdlib_data, tmp_path, caplog, monkeypatch,
                                                                         damage):
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=4", "checkpoint.interval=2", "eval.interval=0")
    train(cfg)
    newest = run_dir / "checkpoints" / "step_0000004"
    if damage == "unreadable":  # a disk that fails the read (root reads any file, so the failure is injected)
        crc32 = checkpoint._crc32

        def failing(path):
            if path.parent == newest:
                raise OSError(5, "Input/output error")
            return crc32(path)
        monkeypatch.setattr(checkpoint, "_crc32", failing)
    else:
        target = newest / ".metadata" if damage == "metadata" else next(newest.glob("*.distcp"))
        payload = bytearray(target.read_bytes())
        middle = len(payload) // 2
        payload[middle:middle + 64] = bytes(64)  # same size, different bytes
        target.write_bytes(bytes(payload))
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        assert Trainer(cfg).resume() == 2
    assert "step_0000004" in caplog.text
    assert ("cannot be read" if damage == "unreadable" else "corrupted") in caplog.text


def test_a_full_disk_at_a_save_is_said_in_one_sentence_and_loses_nothing(stdlib_data, tmp_path, monkeypatch):
    """The disk fills while step 4's checkpoint is written (in the background, then in the
    foreground): DCP's writer fails with torch.save's zip writer's error ("unexpected pos"), which
    says nothing of space, or an OSError of ENOSPC, and DCP wraps it in its CheckpointException (a
    BaseException). The run says the disk is full, removes the unfinished directory (whose bytes
    the next try needs) and keeps step 2's checkpoint, which it resumes from."""
    import contextlib
    import errno

    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream
    for async_save, error, free in ((True, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                                                        "704 vs 598"), 0),
                                    (False, OSError(errno.ENOSPC, "No space left on device"), 10**12)):
        @contextlib.contextmanager
        def filling(self, path, mode):  # DCP's own writer, its files of step 4 cut short by the disk
            if "step_0000004" in str(path) and "w" in mode:
                Path(path).write_bytes(bytes(4096))
                raise error
            with real(self, path, mode) as stream:
                yield stream

        run_dir = tmp_path / f"async-{async_save}"
        cfg = tiny_config(stdlib_data, run_dir, "train.steps=6", "checkpoint.interval=2", "eval.interval=0",
                          f"checkpoint.async_save={str(async_save).lower()}")
        usage = shutil.disk_usage(tmp_path)
        with monkeypatch.context() as patched:
            patched.setattr(checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=free))
            patched.setattr(filesystem.FileSystem, "create_stream", filling)
            with pytest.raises(checkpoint.CheckpointError, match=r"step_0000004' could not be written: the disk holding "
                               r"it is full \([\d.]+ MB written before it ran out; the last checkpoint took [\d.]+ MB\); "
                               "free space there"):
                train(cfg)
        assert [p.name for p in checkpoint.all_checkpoints(run_dir / "checkpoints")] == ["step_0000002"]
        assert train(cfg).step == 6  # resumed from step 2, room made
    # A filesystem that reports no size (some FUSE mounts: 0 of 0 bytes free) says nothing of
    # space: the writer's own error is what is raised, not a full disk.
    cfg = tiny_config(stdlib_data, tmp_path / "fuse", "train.steps=4", "checkpoint.interval=2", "eval.interval=0",
                      "checkpoint.async_save=false")
    @contextlib.contextmanager
    def failing(self, path, mode):
        if "step_0000002" in str(path) and "w" in mode:
            raise RuntimeError("unexpected pos 704 vs 598")
        with real(self, path, mode) as stream:
            yield stream

    with monkeypatch.context() as patched:
        patched.setattr(checkpoint.shutil, "disk_usage", lambda path: usage._replace(total=0, used=0, free=0))
        patched.setattr(filesystem.FileSystem, "create_stream", failing)
        with pytest.raises(BaseException) as raised:
            train(cfg)
    assert "disk holding it is full" not in str(raised.value) and "unexpected pos" in repr(raised.value)


def test_checkpoint_directories_a_run_could_not_save_into_are_refused_before_it_trains(stdlib_data, tmp_path,
                                                                                       monkeypatch):
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=4", "checkpoint.interval=2", "eval.interval=0")
    train(cfg, stop_at_step=2)
    root = run_dir / "checkpoints"
    # A file where a step's directory goes: said before the steps to it, not at its save, by name.
    (root / "step_0000004").write_text("x")
    with pytest.raises(checkpoint.CheckpointError, match=r"'.*step_0000004' is a file where the run saves a "
                       "checkpoint's directory; move it away or delete it"):
        train(cfg)
    assert max(r["step"] for r in read_metrics(run_dir, "train")) == 2
    (root / "step_0000004").unlink()
    (root / "step_0000004").symlink_to(tmp_path / "nowhere")
    with pytest.raises(checkpoint.CheckpointError, match="step_0000004' is a link to nothing where the run saves"):
        train(cfg)
    (root / "step_0000004").unlink()
    # A directory the run may not write (root writes anywhere: the read-only answer is injected).
    writable = os.access
    monkeypatch.setattr(checkpoint.os, "access", lambda path, mode, **how: Path(path) != root and writable(path, mode))
    with pytest.raises(checkpoint.CheckpointError, match="checkpoints cannot be written under .*checkpoints' "
                       r"\(a read-only filesystem, or no permission to write there\)"):
        train(cfg)
    monkeypatch.undo()
    # A save that never finished, at a step the resumed run does not save at (a leftover of another
    # interval): its growing bytes are the watchdog's sign of a save, whatever other directory lies
    # newer, and the next commit removes it.
    leftover, foreign = root / "step_0000003", root / "step_0000999"
    leftover.mkdir()
    foreign.mkdir()
    (foreign / "x").write_bytes(bytes(3))
    before = checkpoint.bytes_on_disk(root)
    (leftover / "__0_0.distcp").write_bytes(bytes(100))
    assert checkpoint.bytes_on_disk(root) == before + 100
    shutil.rmtree(foreign)
    assert train(cfg).step == 4
    assert [p.name for p in checkpoint.all_checkpoints(root)] == ["step_0000004", "step_0000002"]


def test_checkpoints_that_all_fail_to_load_stop_the_run_instead_of_restarting_it(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=4", "checkpoint.interval=2", "eval.interval=0")
    train(cfg)
    for path in checkpoint.all_checkpoints(run_dir / "checkpoints"):
        data_file = next(path.glob("*.distcp"))
        data_file.write_bytes(data_file.read_bytes()[:100])  # committed, then damaged
    with pytest.raises(checkpoint.CheckpointError, match="none of the 2 checkpoints"):
        train(cfg)
    assert [p.name for p in checkpoint.all_checkpoints(run_dir / "checkpoints")] == ["step_0000004", "step_0000002"]


def test_a_run_stopped_while_writing_its_first_checkpoint_starts_again(stdlib_data, tmp_path, caplog):
    """Saves that never committed hold no run to protect: resume = auto starts from step 0 (and
    so does resume = never), training what a fresh run trains."""
    fresh, run_dir = tmp_path / "fresh", tmp_path / "run"
    common = ["train.steps=3", "eval.interval=0", "checkpoint.interval=2"]
    train(tiny_config(stdlib_data, fresh, *common))
    leftover = run_dir / "checkpoints" / "step_0000002"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half a save")
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        result = train(tiny_config(stdlib_data, run_dir, *common))
    assert result.resumed_from is None and "was ever committed" in caplog.text
    assert losses(run_dir) == losses(fresh)
    assert checkpoint.check_complete(leftover) is None  # the save of step 2 replaced the leftover


def test_an_intact_checkpoint_that_does_not_fit_is_raised_not_skipped(stdlib_data, tmp_path):
    """A checkpoint that passes its checksums but does not fit the state is no damage to fall
    back from (an older one would not fit either): the error names what is missing. State the
    trainer marks optional (the CUDA generator's, absent from a CPU run's checkpoint) is left
    out instead."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=4", "checkpoint.interval=2", "eval.interval=0")
    train(cfg)
    trainer = Trainer(cfg)
    root = run_dir / "checkpoints"
    state = trainer.state()
    state["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)  # what a GPU run's state holds
    assert checkpoint.load_newest(root, state, optional=("rng.cuda",)) == root / "step_0000004"
    assert "cuda" not in state["rng"]
    state["extra"] = {"w": torch.zeros(3)}
    with pytest.raises(checkpoint.CheckpointError, match="step_0000004 holds no 'extra' entries") as error:
        checkpoint.load_newest(root, state)
    assert not isinstance(error.value, checkpoint.CheckpointDamaged)


def test_a_resumed_run_takes_the_optimizer_settings_of_its_config(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=2", "eval.interval=0", "train.weight_decay=0.1",
                      "train.beta2=0.95", "train.eps=1e-8"))
    trainer = Trainer(tiny_config(stdlib_data, run_dir, "train.steps=4", "eval.interval=0", "train.weight_decay=0.02",
                                  "train.beta2=0.99", "train.eps=1e-6"))
    assert trainer.resume() == 2
    decay, vectors = trainer.optimizer.param_groups
    assert (decay["weight_decay"], vectors["weight_decay"]) == (0.02, 0.0)
    assert all(group["betas"][1] == 0.99 and group["eps"] == 1e-6 for group in (decay, vectors))


def test_a_fresh_run_trains_the_same_whether_resume_is_auto_or_never(stdlib_data, tmp_path):
    auto, never = tmp_path / "auto", tmp_path / "never"
    train(tiny_config(stdlib_data, auto, "train.steps=3", "eval.interval=0"))
    train(tiny_config(stdlib_data, never, "train.steps=3", "eval.interval=0", "checkpoint.resume=never"))
    assert losses(auto) == losses(never)


def test_every_rng_state_round_trips_through_a_checkpoint(stdlib_data, tmp_path):
    import random

    import numpy as np

    cfg = tiny_config(stdlib_data, tmp_path / "run", "train.steps=4", "eval.interval=0")
    train(cfg, stop_at_step=2)
    expected = (torch.rand(3), random.random(), np.random.rand())  # the draws that would come next
    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    assert Trainer(cfg).resume() == 2
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


def test_resuming_on_other_data_is_refused(stdlib_data, tmp_path):
    from scaletrain.data import prepare
    from scaletrain.data.shards import DataError

    cfg = tiny_config(stdlib_data, tmp_path / "run", "train.steps=4", "eval.interval=0")
    train(cfg, stop_at_step=2)
    other = tmp_path / "other"
    prepare(["builtin:python-stdlib"], other, vocab_size=512, max_bytes=300_000, val_fraction=0.05)
    with pytest.raises(ConfigError, match="another tokenizer"):
        train(tiny_config(other, tmp_path / "run", "train.steps=4", "eval.interval=0"))
    same_tokenizer = tmp_path / "same-tokenizer"
    prepare(["builtin:python-stdlib"], same_tokenizer, vocab_size=512, max_bytes=300_000, val_fraction=0.05,
            tokenizer=stdlib_data / "tokenizer.json")
    with pytest.raises(DataError, match="original data.path"):
        train(tiny_config(same_tokenizer, tmp_path / "run", "train.steps=4", "eval.interval=0"))


def test_a_validation_split_too_small_is_refused_before_training(stdlib_data, tmp_path, caplog):
    with pytest.raises(ConfigError, match="'val' split"):
        Trainer(tiny_config(stdlib_data, tmp_path / "run", "data.seq_len=64", "model.max_seq_len=100000",
                            "data.seq_len=50000", "train.global_batch_tokens=200000", "train.micro_batch=4"))
    # Smaller than eval.tokens asks, but a window or more: said at the start, and each eval record
    # says what it measured.
    with caplog.at_level("WARNING", logger="scaletrain"):
        train(tiny_config(stdlib_data, tmp_path / "short", "train.steps=2", "eval.interval=0", "eval.tokens=100000000"))
    [record] = read_metrics(tmp_path / "short", "eval")
    assert 64 <= record["measured_tokens"] < 100_000_000
    assert f"eval.tokens = 100000000, but the validation split of {stdlib_data} holds " in caplog.text
    # One whole window fewer than asked is said too; a remainder short of a window is not asked for.
    from scaletrain.data.shards import read_index
    seq = Trainer(tiny_config(stdlib_data, tmp_path / "edge")).cfg.data.seq_len
    held = (read_index(stdlib_data)["splits"]["val"]["tokens"] - 1) // seq * seq
    for tokens, said in ((held + seq, True), (held + seq - 1, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="scaletrain"):
            Trainer(tiny_config(stdlib_data, tmp_path / "edge", f"eval.tokens={tokens}"))
        assert ("but the validation split of" in caplog.text) == said, tokens


def test_a_run_that_ends_above_the_uniform_loss_says_so(stdlib_data, tmp_path, caplog):
    """No NaN, no spike judged (off by default): a rate far too high without clipping drives the loss
    above ln(vocabulary) and keeps it there; the run ends, and says it learned nothing."""
    with caplog.at_level("WARNING", logger="scaletrain"):
        result = train(tiny_config(stdlib_data, tmp_path / "high", "train.lr=5", "train.clip=0", "train.steps=8",
                                   "eval.interval=0", "checkpoint.interval=0"))
    assert result.train_loss > math.log(512) + 0.5
    assert "above 6.238 = ln(vocabulary), the loss of predicting every token alike" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="scaletrain"):
        train(tiny_config(stdlib_data, tmp_path / "fine", "train.steps=8", "eval.interval=0", "checkpoint.interval=0"))
    assert "ln(vocabulary)" not in caplog.text


def test_a_finished_run_trained_again_trains_and_records_nothing(stdlib_data, tmp_path):
    """(A resume and an end record of it would be counted by the report as a restart lasting from
    the run's end to now.)"""
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=3", "eval.interval=0")
    first = train(cfg)
    written = (run_dir / "metrics.jsonl").read_bytes()
    again = train(cfg)
    assert (run_dir / "metrics.jsonl").read_bytes() == written
    assert (again.resumed_from, again.step, again.train_loss, again.val_loss) == (3, 3, first.train_loss, first.val_loss)
    # Nor does one stopped at a step it has passed: refused, as training nothing.
    longer = tiny_config(stdlib_data, run_dir, "train.steps=5", "eval.interval=0")
    with pytest.raises(ConfigError, match="--stop-at-step 2 is not after step 3, where the run resumes"):
        train(longer, stop_at_step=2)
    assert (run_dir / "metrics.jsonl").read_bytes() == written


def test_divergence_stops_at_the_step_and_keeps_the_last_good_checkpoint(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=30", "train.lr=1e4", "train.warmup_steps=0",
                      "train.clip=0", "checkpoint.interval=1", "checkpoint.keep=50", "eval.interval=0")
    with pytest.raises(TrainingDiverged) as error:
        train(cfg)
    message = str(error.value)
    assert message.startswith("step ") and "nothing was saved" in message
    bad_step = int(message.split()[1].rstrip(":"))
    saved = [int(p.name.removeprefix("step_")) for p in checkpoint.complete_checkpoints(run_dir / "checkpoints")]
    assert max(saved) == bad_step - 1
    assert read_metrics(run_dir)[-1]["kind"] == "diverged"
    # Reported and compared as far as its applied updates went, steps and tokens alike.
    from scaletrain.report.compare import _read
    from scaletrain.report.run import run_report
    compared, summary = _read(run_dir), run_report(run_dir)
    assert compared["step"] == summary["step"] == bad_step - 1
    assert compared["tokens"] == summary["tokens"] == (bad_step - 1) * cfg.train.global_batch_tokens


def test_a_step_not_looked_at_never_applies_a_non_finite_update(stdlib_data, tmp_path):
    """Between the steps it logs, checkpoints or evaluates, the loop does not wait for the loss
    (train_step(look=False)); a step whose gradient is not finite is skipped on the device and
    raised at the next look, naming that step."""
    from scaletrain.train.trainer import Trainer

    trainer = Trainer(tiny_config(stdlib_data, tmp_path / "run", "train.steps=30", "train.lr=1e4",
                                  "train.warmup_steps=0", "train.clip=0", "eval.interval=0"))
    before = None
    while trainer.first_bad[0] < 0 and trainer.step < 30:
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        assert trainer.train_step(look=False)[:2] == (None, None)
    bad_step = int(trainer.first_bad[0])
    assert bad_step == trainer.step  # it diverged, and ...
    for name, p in trainer.model.named_parameters():  # ... its update was not applied
        assert torch.equal(p.detach(), before[name]), name
    with pytest.raises(TrainingDiverged, match=f"^step {bad_step}: loss is .* gradient norm (nan|inf)"):
        trainer.train_step(look=True)
    # Run by the loop with checkpoints every 10 steps: raised at the next look, nothing saved after.
    run_dir = tmp_path / "loop"
    with pytest.raises(TrainingDiverged, match=f"^step {bad_step}:"):
        train(tiny_config(stdlib_data, run_dir, "train.steps=30", "train.lr=1e4", "train.warmup_steps=0",
                          "train.clip=0", "checkpoint.interval=10", "log.interval=10", "eval.interval=0"))
    saved = [int(p.name.removeprefix("step_")) for p in checkpoint.complete_checkpoints(run_dir / "checkpoints")]
    assert all(step < bad_step for step in saved)


def test_a_run_directory_refuses_checkpoints_of_a_different_model(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=2", "eval.interval=0"))
    with pytest.raises(ConfigError, match="model"):
        Trainer(tiny_config(stdlib_data, run_dir, "train.steps=2", "model.dim=128"))
    with pytest.raises(ConfigError, match="checkpoint.resume = 'never'"):
        Trainer(tiny_config(stdlib_data, run_dir, "train.steps=2", "checkpoint.resume=never"))


def test_a_missing_data_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.path.*scaletrain data prepare"):
        Trainer(tiny_config(tmp_path / "nowhere", tmp_path / "run"))


def test_a_run_resumes_on_its_data_moved_and_says_when_a_longer_schedule_warms_it_up_again(stdlib_data, tmp_path,
                                                                                            caplog):
    """The same data under another directory name (one source, named by its directory) resumes
    exactly; a finished cosine run extended to more steps resumes at a higher rate, and says so."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["train.steps=4", "train.warmup_steps=1", "checkpoint.interval=2", "eval.interval=0"]
    train(tiny_config(stdlib_data, whole, *common))
    train(tiny_config(stdlib_data, split, *common), stop_at_step=2)
    moved = tmp_path / "elsewhere" / "stdlib-copy"
    moved.parent.mkdir()
    moved.symlink_to(stdlib_data, target_is_directory=True)
    train(tiny_config(moved, split, *common))
    assert losses(split) == losses(whole)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        train(tiny_config(moved, split, *common[1:], "train.steps=8"))
    assert re.search(r"with train.steps changed, the learning rate after step 4 is [\d.e-]+, where the schedule it "
                     r"trained with gave [\d.e-]+: a run past its decay that trains on warms up again", caplog.text)
    assert sorted(losses(split)) == list(range(1, 9))


def test_resume_from_an_explicit_checkpoint_path(stdlib_data, tmp_path):
    first = tmp_path / "first"
    train(tiny_config(stdlib_data, first, "train.steps=4", "checkpoint.interval=2", "eval.interval=0"))
    second = tmp_path / "second"
    # What a run killed while writing its first checkpoint leaves: a save with no marker, which
    # is no history to protect (a sweep's cooldown branch restarts from its trunk over it).
    (second / "checkpoints" / "step_0000003").mkdir(parents=True)
    cfg = tiny_config(stdlib_data, second, "train.steps=4", "eval.interval=0", "checkpoint.interval=3",
                      f"checkpoint.resume={first / 'checkpoints' / 'step_0000002'}")
    result = train(cfg)
    assert result.resumed_from == 2
    assert losses(second) == {step: loss for step, loss in losses(first).items() if step > 2}
    assert checkpoint.check_complete(second / "checkpoints" / "step_0000003") is None
    # A complete newer checkpoint is a history: going back to step 2 over it is refused.
    with pytest.raises(ConfigError, match="older than checkpoints already in .*step_0000004, step_0000003.*new run.name"):
        Trainer(cfg).resume()
    # A checkpoint of another model: said in the run's words, not torch's size mismatch.
    other = tiny_config(stdlib_data, tmp_path / "third", "train.steps=4", "model.dim=32", "model.n_heads=2",
                        "model.n_kv_heads=1", f"checkpoint.resume={first / 'checkpoints' / 'step_0000002'}")
    with pytest.raises(ConfigError, match=r"step_0000002' is of another run \(model.dim 64 then, 32 now.*; resume it "
                                          r"with that run's settings, or start from its weights with checkpoint.init_from"):
        Trainer(other).resume()


@pytest.fixture(scope="module")
def first_stage(stdlib_data, tmp_path_factory) -> Path:
    """A run of 4 steps with checkpoints at steps 2 and 4: the stage the tests below continue."""
    run_dir = tmp_path_factory.mktemp("stages") / "first"
    train(tiny_config(stdlib_data, run_dir, "train.steps=4", "checkpoint.interval=2", "eval.interval=0"))
    return run_dir


def _states_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name


def test_a_run_starts_its_next_stage_from_another_runs_checkpoint_and_resumes_exactly(
        stdlib_data, short_documents, first_stage, tmp_path):
    """checkpoint.init_from = a run directory: its newest checkpoint's weights and optimizer state,
    as resuming it would load them; then this run's own steps, schedule and data (other documents,
    sequences twice as long under YaRN's rotary scaling: a context extension). Stopped part-way, the stage resumes from its own
    checkpoint with the losses of one that never stopped."""
    def stage(run_dir: Path, *overrides: str):
        return tiny_config(short_documents, run_dir, "train.steps=3", "train.warmup_steps=0", "eval.interval=0",
                           "checkpoint.interval=1", "data.seq_len=128", "model.max_seq_len=128",
                           'model.rope_scaling={type = "yarn", factor = 2, original_max_seq_len = 64}',
                           f"checkpoint.init_from={first_stage}", *overrides)

    second = Trainer(stage(tmp_path / "second"))
    info = second.init_from_checkpoint()
    assert (info["init_from"], info["init_step"]) == (str(first_stage / "checkpoints" / "step_0000004"), 4)
    resumed = Trainer(tiny_config(stdlib_data, tmp_path / "resumed", "train.steps=8", "eval.interval=0",
                                  f"checkpoint.resume={first_stage / 'checkpoints' / 'step_0000004'}"))
    resumed.resume()
    _states_equal(second.model, resumed.model)
    theirs, ours = resumed.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert theirs and sorted(theirs) == sorted(ours)
    for index in theirs:
        for key, value in theirs[index].items():
            assert torch.equal(value, ours[index][key]), (index, key)
    assert second.step == 0 and second.loader.state_dict()["consumed"] == 0
    for trainer in (second, resumed):
        trainer.loader.close()

    train(stage(tmp_path / "second"), stop_at_step=2)
    assert train(stage(tmp_path / "second")).resumed_from == 2
    train(stage(tmp_path / "whole"))
    assert losses(tmp_path / "second") == losses(tmp_path / "whole")
    start = read_metrics(tmp_path / "whole", "start")[0]
    assert (start["init_step"], start["init_tokens"], start["init_optimizer"]) == (4, 4 * 512, True)
    # The optimizer's moments matter: afresh, the first loss (the same weights on the same batch)
    # is the same and the next ones are not.
    train(stage(tmp_path / "afresh", "checkpoint.init_optimizer=false"))
    afresh, whole = losses(tmp_path / "afresh"), losses(tmp_path / "whole")
    assert afresh[1] == whole[1]
    assert abs(afresh[2] - whole[2]) > 1e-4
    assert whole[1] < losses(first_stage)[1] - 0.1  # it starts from the trained model


def test_a_checkpoint_that_does_not_fit_the_next_stage_is_refused_in_one_sentence(
        stdlib_data, first_stage, tmp_path):
    from tokenizers import Tokenizer

    def refused(match: str, init_from: Path, *overrides: str):
        with pytest.raises(ConfigError, match=match):
            Trainer(tiny_config(stdlib_data, tmp_path / "next", "train.steps=2", f"checkpoint.init_from={init_from}",
                                *overrides))

    refused(r"holds another model: it has no layers.2.attention_norm.weight \(and \d+ more\); its run had "
            r"model.n_layers = 2; model.\* must describe", first_stage, "model.n_layers=3")
    refused(r"its tok_embeddings.weight is 512x64, this model's 512x128 .*model.dim = 64", first_stage,
            "model.dim=128")
    refused(r"was trained with train.optimizer = 'adamw'.*set train.optimizer = 'adamw', or "
            r"checkpoint.init_optimizer = false", first_stage, "train.optimizer=muon")
    refused(r"was trained with model.mup_base_dim = unset, model.mup_base_layers = unset, this run with 32, 1: "
            r"its weights hold muP's multipliers folded in .*keeps its parametrization; set it as that run had it",
            first_stage, "model.mup_base_dim=32", "model.mup_base_layers=1")
    refused("neither a Hugging Face model directory .* nor a scaletrain run directory or checkpoint", tmp_path)
    with pytest.raises(ConfigError, match="is this run's own directory: a next stage is a run of its own"):
        Trainer(tiny_config(stdlib_data, first_stage, "train.steps=6", f"checkpoint.init_from={first_stage}"))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    refused("is a run directory without a complete checkpoint", tmp_path / "empty")
    shutil.copytree(first_stage, tmp_path / "retokenized")
    other = Tokenizer.from_file(str(tmp_path / "retokenized" / "tokenizer.json"))
    other.add_tokens(["<|another|>"])
    other.save(str(tmp_path / "retokenized" / "tokenizer.json"))
    refused("its tokenizer is not the one the data was prepared with", tmp_path / "retokenized")
    (tmp_path / "retokenized" / "checkpoints" / "step_0000002" / "__0_0.distcp").write_bytes(b"cut")
    refused("checkpoint .*step_0000002 is not usable: file __0_0.distcp is 3 bytes",
            tmp_path / "retokenized" / "checkpoints" / "step_0000002")
    # A checkpoint copied away from its run's config.toml: the optimizer's state itself is missed.
    shutil.copytree(first_stage / "checkpoints" / "step_0000004", tmp_path / "copied")
    muon = Trainer(tiny_config(stdlib_data, tmp_path / "muon", "train.steps=2",
                               f"checkpoint.init_from={tmp_path / 'copied'}", "train.optimizer=muon"))
    with pytest.raises(ConfigError, match="holds no optimizer state .*checkpoint.init_optimizer = false"):
        muon.init_from_checkpoint()
    muon.loader.close()
    fresh = Trainer(tiny_config(stdlib_data, tmp_path / "muon", "train.steps=2", "checkpoint.init_optimizer=false",
                                f"checkpoint.init_from={tmp_path / 'copied'}", "train.optimizer=muon"))
    fresh.init_from_checkpoint()  # its weights alone fit
    fresh.loader.close()


def test_a_next_stage_may_switch_the_experts_routing_biases_on_or_off(stdlib_data, tmp_path):
    """The routing biases of auxiliary-loss-free balancing are the one kind of weight a stage may
    add (they start at zero) or drop; everything else comes from the checkpoint."""
    moe = ["model.moe_experts=4", "model.moe_score=sigmoid", "train.steps=3", "eval.interval=0"]
    train(tiny_config(stdlib_data, tmp_path / "plain", *moe))
    train(tiny_config(stdlib_data, tmp_path / "biased", *moe, "model.moe_bias_update=0.01"))
    for source, bias_update in (("plain", "0.01"), ("biased", "0.0")):
        stage = Trainer(tiny_config(stdlib_data, tmp_path / f"from-{source}", *moe, f"model.moe_bias_update={bias_update}",
                                    f"checkpoint.init_from={tmp_path / source}"))
        stage.init_from_checkpoint()
        reference = Trainer(tiny_config(stdlib_data, tmp_path / f"resumed-{source}", *moe, "train.steps=5",
                                        f"model.moe_bias_update={0.01 if source == 'biased' else 0.0}",
                                        f"checkpoint.resume={tmp_path / source / 'checkpoints' / 'step_0000003'}"))
        reference.resume()
        ours, theirs = stage.model.state_dict(), reference.model.state_dict()
        for name, tensor in ours.items():
            if name.endswith("expert_bias"):
                assert not tensor.any(), name  # switched on: from zero
            else:
                assert torch.equal(tensor, theirs[name]), name
        if source == "biased":
            assert any(t.any() for name, t in theirs.items() if name.endswith("expert_bias"))  # (dropped: not zero)
        for trainer in (stage, reference):
            trainer.loader.close()


def test_a_batch_ramp_trains_its_small_batches_first_and_resumes_and_rewinds_exactly(stdlib_data, tmp_path,
                                                                                     monkeypatch, caplog):
    """train.batch_ramp = [[256, 768]]: steps of 256 tokens (one micro-batch of 4) until 768
    tokens are trained, then of 512 (two). The first steps are those of a run whose batch is 256
    throughout, to the bit; the records count each step's tokens, the data its sequences; stopped
    inside the ramp and after it, the run resumes exactly; a NaN inside the ramp rewinds to the
    checkpoint before it and skips the 256-token batch read since."""
    common = ["train.steps=5", "eval.interval=0", "checkpoint.interval=1", "train.batch_ramp=[[256, 768]]"]
    ramp = tmp_path / "ramp"
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        train(tiny_config(stdlib_data, ramp, *common))
    # The time left is said at the pace since the batch last grew (a small step costs more per
    # token): none at step 4, the first of 512 tokens, as none at the first step.
    lines = [r.getMessage() for r in caplog.records if " tok/s" in r.getMessage()]
    assert [line.endswith(" left") for line in lines] == [False, True, True, False, False]
    small = tmp_path / "small"
    train(tiny_config(stdlib_data, small, "train.steps=5", "eval.interval=0", "train.global_batch_tokens=256"))
    got, reference = losses(ramp), losses(small)
    assert [got[step] for step in (1, 2, 3)] == [reference[step] for step in (1, 2, 3)]
    assert abs(got[4] - reference[4]) > 1e-4  # twice the batch from step 4
    records = read_metrics(ramp, "train")
    assert [r["tokens"] for r in records] == [256, 512, 768, 1280, 1792]
    assert [r["tokens_by_source"]["stdlib"] for r in records] == [256, 512, 768, 1280, 1792]

    for stop in (2, 4):
        stopped = tmp_path / f"stopped-{stop}"
        train(tiny_config(stdlib_data, stopped, *common), stop_at_step=stop)
        assert train(tiny_config(stdlib_data, stopped, *common)).resumed_from == stop
        assert losses(stopped) == got

    monkeypatch.setattr(Trainer, "_clip_gradients", nan_norm_once_after(1))  # step 2's norm reads NaN
    rewound = tmp_path / "rewound"
    train(tiny_config(stdlib_data, rewound, *common, "train.rewinds=1", "log.interval=2"))
    [rewind] = read_metrics(rewound, "rewind")
    assert (rewind["step"], rewind["diverged_at"], rewind["skipped_steps"]) == (1, 2, 1)
    end = read_metrics(rewound, "end")[-1]
    assert end["tokens"] == 1792 and end["tokens_by_source"] == {"stdlib": 1792 + 256}  # step 2 again of 256
    final = Trainer(tiny_config(stdlib_data, rewound, *common, "train.rewinds=1"))
    final.resume()
    state = final.loader.state_dict()  # the batch sizes follow training's steps, the draws the data's
    final.loader.close()
    assert (state["step"], state["draws"], state["micro"], state["consumed"]) == (5, 6, 0, (1792 + 256) // 64)
    # A ramp the run ends inside of never trains the global batch: said.
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        Trainer(tiny_config(stdlib_data, tmp_path / "short", "train.steps=2", "train.batch_ramp=[[256, 768]]")).loader.close()
    assert "train.batch_ramp reaches 768 tokens, beyond the run's 512: train.global_batch_tokens = 512 is never " \
           "trained" in caplog.text


def test_multiple_choice_tasks_score_each_choice_by_its_log_probability_after_the_context(
        stdlib_data, next_line_task, tmp_path, caplog):
    """eval.tasks: each evaluation logs a task's accuracy, length-normalised accuracy and the right
    choice's loss per token; the scores are the choice's log-probability after the context, as a
    plain forward of the model over each unpadded (and, when too long, left-cut) text gives it."""
    from scaletrain.data.tokenizer import load_tokenizer
    from scaletrain.train.tasks import load_task

    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=6", "eval.interval=3", f"eval.tasks=['{next_line_task}']",
                      "eval.task_examples=20")
    train(cfg)
    evals = read_metrics(run_dir, "eval")
    assert [sorted(r["task_accuracy"]) for r in evals] == [["next_line"], ["next_line"]]
    assert evals[1]["task_nll"]["next_line"] < evals[0]["task_nll"]["next_line"]  # it learns

    trainer = Trainer(cfg)
    trainer.resume()
    [task] = trainer.tasks
    assert task.examples == 20 and len(task.inputs) == 80
    scores = trainer.task_scores(task)
    tokenizer, model = load_tokenizer(stdlib_data), trainer.model.eval()
    eos = tokenizer.token_to_id("<|endoftext|>")

    def expected_scores(lines: list[str]) -> list[float]:
        expected = []
        for line in lines:
            example = json.loads(line)
            context = tokenizer.encode(example["context"], add_special_tokens=False).ids
            for choice in example["choices"]:
                whole = tokenizer.encode(example["context"] + choice, add_special_tokens=False).ids
                shared = next((i for i, (a, b) in enumerate(zip(context, whole)) if a != b),
                              min(len(context), len(whole)))
                scored = len(whole) - min(shared, len(whole) - 1)
                full = torch.tensor([eos, *whole][-65:])
                with torch.no_grad():
                    logprobs = torch.log_softmax(model(full[None, :-1]), dim=-1)[0]
                targets = full[1:]
                expected.append(logprobs[torch.arange(len(targets)), targets][-scored:].sum().item())
        return expected

    expected = expected_scores(next_line_task.read_text().splitlines()[:20])
    assert scores == pytest.approx(expected, abs=1e-4)
    # Rows all shorter than the sequence (and than the 64 positions each batch is rounded up to).
    short = tmp_path / "short.jsonl"
    short.write_text('{"context": "import", "choices": [" os", " sys"], "label": 0}\n'
                     '{"context": "def f(x):\\n    return", "choices": [" x", " None"], "label": 0}\n')
    short_task = load_task(short, tokenizer, eos, 64, 2)
    assert short_task.inputs.shape[1] < 64
    with caplog.at_level(logging.WARNING, logger="scaletrain"):  # a choice longer than the sequence: said
        cut = load_task(short, tokenizer, eos, 1, 2)
    assert (cut.tokens == 1).all() and "2 choices of" in caplog.text and "are longer than data.seq_len = 1 tokens " \
        "and are scored on their last 1 only" in caplog.text
    assert trainer.task_scores(short_task) == pytest.approx(expected_scores(short.read_text().splitlines()), abs=1e-4)
    right = [json.loads(line)["label"] for line in next_line_task.read_text().splitlines()[:20]]
    accuracy = sum(max(range(4), key=lambda c: expected[4 * i + c]) == label for i, label in enumerate(right)) / 20
    assert evals[1]["task_accuracy"]["next_line"] == pytest.approx(accuracy)
    trainer.loader.close()

    # Tokenized as the data was: a tokenizer's post-processor adds no token to the rows.
    from tokenizers.processors import TemplateProcessing
    with_bos = load_tokenizer(stdlib_data)
    with_bos.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eos)])
    assert with_bos.encode("x = 1").ids[0] == eos
    plain, bos = (load_task(next_line_task, t, eos, 64, 5) for t in (tokenizer, with_bos))
    assert (plain.inputs == bos.inputs).all() and (plain.targets == bos.targets).all()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "label": 1}\n{"context": "a", "choices": ["b"], "label": 0}\n')
    with pytest.raises(ConfigError, match=r"line 2 of .*bad.jsonl' is not an example; each line must be "):
        Trainer(tiny_config(stdlib_data, tmp_path / "other", "train.steps=2", f"eval.tasks=['{bad}']"))
    bad.write_text('{"context": "a", "choices": ["b", "c"], "label": true}\n')  # (JSON's true is not the index 1)
    with pytest.raises(ConfigError, match=r"line 1 of .*bad.jsonl' is not an example"):
        Trainer(tiny_config(stdlib_data, tmp_path / "other", "train.steps=2", f"eval.tasks=['{bad}']"))


def test_compiled_blocks_train_the_same_losses(stdlib_data, tmp_path):
    """train.compile = true compiles each block with inductor; losses match eager to float32 rounding."""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    common = ["train.steps=3", "eval.interval=0", "model.n_layers=1"]
    import torch._dynamo

    train(tiny_config(stdlib_data, eager, *common))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    train(tiny_config(stdlib_data, compiled, *common, "train.compile=true"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the block, compiled: not eager again
    expected, got = losses(eager), losses(compiled)
    assert sorted(got) == [1, 2, 3]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-5)


def test_a_mixture_trains_reports_tokens_per_source_and_resumes_exactly(mixture_root, tmp_path):
    mix = ["data.mix={stdlib = 0.7, project = 0.3}", f"data.path={mixture_root}", "eval.interval=3"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(tiny_config(mixture_root, whole, "train.steps=6", *mix))
    cfg = tiny_config(mixture_root, split, "train.steps=6", *mix)
    train(cfg, stop_at_step=3)
    train(cfg)
    assert losses(split) == losses(whole)
    records = read_metrics(whole, "train")
    for r in records:
        assert sum(r["tokens_by_source"].values()) == r["step"] * 8 * 64  # 8 sequences of 64 per step
        assert set(r["epochs_by_source"]) == {"stdlib", "project"}
    evals = read_metrics(whole, "eval")
    assert set(evals[-1]["loss_by_source"]) == {"stdlib", "project"}
    by_source = evals[-1]["loss_by_source"]
    assert evals[-1]["loss"] == pytest.approx(0.7 * by_source["stdlib"] + 0.3 * by_source["project"])
    # Each source's loss is that source's own validation loss: the final checkpoint evaluated on it alone.
    from scaletrain.evaluate import evaluate_run

    for name in ("stdlib", "project"):
        [alone] = evaluate_run(whole, data=str(mixture_root / name), tasks=[])
        assert alone["step"] == evals[-1]["step"] and alone["loss"] == pytest.approx(by_source[name], rel=1e-6), name


def test_a_mixture_of_different_tokenizers_is_refused(mixture_root, tmp_path):
    from scaletrain.data import prepare

    prepare([str(mixture_root / "project" / "stats.json")], tmp_path / "other", vocab_size=300, val_fraction=0.5)
    (tmp_path / "stdlib").symlink_to(mixture_root / "stdlib")
    with pytest.raises(ConfigError, match="different tokenizers"):
        Trainer(tiny_config(tmp_path, tmp_path / "run", "data.mix={stdlib = 1, other = 1}"))


def test_repeating_a_source_more_than_four_epochs_is_warned(mixture_root, tmp_path, caplog):
    mix = ["data.mix={stdlib = 0.1, project = 0.9}", f"data.path={mixture_root}"]
    probe = Trainer(tiny_config(mixture_root, tmp_path / "probe", *mix, "train.steps=1"))
    windows = {source.name: source.windows for source in probe.loader.sources}
    probe.loader.close()
    # Steps for 6 epochs of 'project' (this project's own code: its size changes with every commit),
    # at a share of it that repeats 'stdlib' at most about twice meanwhile.
    share = min(0.99, math.ceil(100 / (1 + windows["stdlib"] / (3 * windows["project"]))) / 100)
    steps = math.ceil(6 * windows["project"] / (share * probe.cfg.seqs_per_step))
    assert (1 - share) * steps * probe.cfg.seqs_per_step / windows["stdlib"] < 4
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        Trainer(tiny_config(mixture_root, tmp_path / "run", f"data.path={mixture_root}", f"train.steps={steps}",
                            f"data.mix={{stdlib = {1 - share:.2f}, project = {share:.2f}}}"))
    assert "'project' would be repeated 6.0 times" in caplog.text and "'stdlib'" not in caplog.text
    # A step larger than a source repeats it within the step, in however short a run.
    caplog.clear()
    micro, seq = probe.cfg.train.micro_batch, probe.cfg.data.seq_len
    seqs = micro * math.ceil((windows["stdlib"] / 0.1 + 1) / micro)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        Trainer(tiny_config(mixture_root, tmp_path / "big", *mix, "train.steps=1",
                            f"train.global_batch_tokens={seqs * seq}"))
    assert (f"source 'stdlib' holds {windows['stdlib']} sequences of data.seq_len {seq}, fewer than its share of a "
            f"step ({math.ceil(0.1 * seqs)})" in caplog.text and "train.global_batch_tokens" in caplog.text)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_trains_the_same_losses_and_reads_the_same_checkpoints(stdlib_data, tmp_path, mode):
    plain, recomputed = tmp_path / "plain", tmp_path / "recomputed"
    common = ["train.steps=4", "eval.interval=0", "checkpoint.interval=2"]
    train(tiny_config(stdlib_data, plain, *common))
    train(tiny_config(stdlib_data, recomputed, *common, f"parallel.recompute={mode}"), stop_at_step=2)
    assert losses(recomputed) == {step: loss for step, loss in losses(plain).items() if step <= 2}
    # checkpoint keys do not depend on the wrapper: resume the recomputed run without it
    train(tiny_config(stdlib_data, recomputed, *common))
    assert losses(recomputed) == losses(plain)


def test_float8_on_a_cpu_is_refused_in_one_sentence_before_anything_starts(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="compute capability 8.9 or newer.*this run is on cpu"):
        Trainer(tiny_config(stdlib_data, run_dir, "train.float8=true"))
    assert not run_dir.exists()


def _signal_when(run_dir: Path, step: int, signum: int) -> threading.Thread:
    """A thread that sends this process `signum` once the run has logged `step`."""
    def watch():
        deadline = time.time() + 60
        while time.time() < deadline:
            if (run_dir / "metrics.jsonl").is_file() and max(losses(run_dir), default=0) >= step:
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.01)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_signal_stops_after_the_next_step_with_a_checkpoint_and_the_run_resumes_exactly(stdlib_data, tmp_path,
                                                                                        monkeypatch):
    """What a scheduler's preemption notice does to one process (SIGUSR1 here; SIGTERM across
    processes in test_distributed): the run ends a step later with a checkpoint of that step,
    not at the last interval, and running it again gives the losses of a run never stopped.
    With TensorBoard, Weights & Biases (offline) and the profiler on: both invocations add to
    the same TensorBoard scalars and the same W&B run, and steps 2 and 3 are traced."""
    common = ["train.steps=100", "checkpoint.interval=1000", "eval.interval=50"]
    whole = tmp_path / "whole"
    train(tiny_config(stdlib_data, whole, *common))
    stopped = tmp_path / "stopped"
    _signal_when(stopped, 3, signal.SIGUSR1)
    monkeypatch.setenv("WANDB_MODE", "offline")
    common += ["log.tensorboard=true", "log.wandb_project=scaletrain-tests", "log.profile_steps=[2, 3]"]
    with pytest.raises(StoppedBySignal, match=r"stopped by SIGUSR1 after step \d+ with a checkpoint at .*; run the "
                                              "same command to continue") as info:
        train(tiny_config(stdlib_data, stopped, *common))
    step = info.value.step
    assert 3 < step < 100 and info.value.code == 128 + signal.SIGUSR1
    assert [checkpoint.step_of(p) for p in checkpoint.complete_checkpoints(stopped / "checkpoints")] == [step]
    assert max(losses(stopped)) == step
    end = read_metrics(stopped, "end")[-1]
    assert (end["step"], end["complete"], end["stopped_by"]) == (step, False, "SIGUSR1")
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handlers are the process's again
    result = train(tiny_config(stdlib_data, stopped, *common))
    assert result.resumed_from == step and result.step == 100
    assert losses(stopped) == losses(whole) and losses(stopped, "eval") == losses(whole, "eval")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(stopped / "tensorboard"))
    events.Reload()
    for kind in ("train", "eval"):
        logged = {event.step: event.value for event in events.Scalars(f"{kind}/loss")}
        assert logged == pytest.approx(losses(whole, kind), rel=1e-6)  # float32 in the event files
    assert {event.step for event in events.Scalars("train/tokens_per_s")} == set(range(1, 101))
    runs = sorted((stopped / "wandb").glob("offline-run-*"))
    run_id = (stopped / "wandb_id").read_text().strip()
    # One W&B run, resumed (wandb suffixes the second directory with -1 when both start in one second).
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", run.name) for run in runs)
    assert all(b"train/loss" in next(run.glob("*.wandb")).read_bytes() for run in runs)
    trace = json.loads((stopped / "profile" / "steps_2-3_rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"step 2", "step 3"} <= names and "step 4" not in names and "aten::mm" in names


def test_stop_signals_leave_a_signal_the_process_ignores_ignored_and_restore_the_others():
    """SIGHUP under `nohup` stays ignored (the run goes on when its terminal closes); the stop
    signals the process answers are recorded, and the previous handlers are back afterwards."""
    from scaletrain.train.resilience import StopSignals

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stops = StopSignals()
        stops.install()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert all(signal.getsignal(signum) != handler for signum, handler in before.items())
        os.kill(os.getpid(), signal.SIGHUP)
        assert stops.stop_before_next_step() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stops.stop_before_next_step() == signal.SIGUSR1
        stops.uninstall(finished=True)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert {signum: signal.getsignal(signum) for signum in before} == before
    finally:
        signal.signal(signal.SIGHUP, previous)


WATCHED_SAVE = """
import sys, threading, time
from pathlib import Path
from scaletrain.train import checkpoint
from scaletrain.train.resilience import Watchdog

root = Path(sys.argv[1])
(root / "step_0000001").mkdir(parents=True)

def write():  # a save that takes 3 s, three times the hang timeout, and then stops
    with open(root / "step_0000001" / "__0_0.distcp", "wb") as f:
        for _ in range(30):
            f.write(bytes(1000))
            f.flush()
            time.sleep(0.1)
    print(f"written after {time.monotonic() - start:.2f} s", flush=True)

start = time.monotonic()
dog = Watchdog(1.0, on_hang=lambda quiet: print(f"ended after {time.monotonic() - start:.2f} s, {quiet:.2f} s since "
                                                "the last beat", flush=True),
               progress=lambda: checkpoint.bytes_on_disk(root))
dog.beat()
threading.Thread(target=write, daemon=True).start()
time.sleep(60)  # the loop, waiting for the save
"""


def test_the_watchdog_lets_a_long_save_run_while_it_writes_and_ends_a_silent_process_after(tmp_path):
    """train.hang_timeout_s = 1 and a checkpoint that takes 3 s to write: no hang while its bytes
    grow; once they stop, the process ends with status 75 a timeout later."""
    result = subprocess.run([sys.executable, "-c", WATCHED_SAVE, str(tmp_path / "checkpoints")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 75, result.stderr[-3000:]
    ended = float(result.stdout.split("ended after ")[1].split()[0])
    written = float(result.stdout.split("written after ")[1].split()[0])
    # (a timeout after the last look that saw bytes grow, which is up to a look, 0.25 s, before the
    # last byte; whatever the machine's speed)
    assert written > 3.0 and 0.5 <= ended - written < 2.5, result.stdout
    assert float(result.stdout.split(", ")[1].split()[0]) > 3.0  # the hang reported from the last beat
    assert "a checkpoint is still being written: not a hang" in result.stderr


def assert_accounted(time_: dict) -> None:
    """The goodput account (report/goodput.py) measured the wall-clock: setup, steps redone and
    checkpoints each seen, and what no record accounts for ("other", the rest of the wall-clock
    once the parts are summed) a small share (1-3% measured on this VM; 15% allowed for load)."""
    parts = time_["parts"]
    assert parts["setup"] > 0 and parts["steps_redone"] > 0 and parts["checkpoints"] > 0, parts
    assert parts["other"] < 0.15 * time_["wall_s"], (parts, time_["wall_s"])


def test_a_divergence_rewinds_to_the_checkpoint_skips_the_batches_since_and_resumes_exactly(
        stdlib_data, tmp_path, monkeypatch):
    """train.rewinds = 1: step 7's gradient is NaN (its update is skipped on the device); the loop
    sees it at step 8, goes back to step 4's checkpoint with the data at step 8 (4 steps of
    batches skipped) and trains to the end. A run stopped after the rewind and resumed gives the
    same losses."""
    common = ["train.steps=12", "checkpoint.interval=4", "eval.interval=0", "log.interval=4", "train.rewinds=1"]
    monkeypatch.setattr(Trainer, "_clip_gradients", nan_norm_once_after(6))
    whole = tmp_path / "whole"
    result = train(tiny_config(stdlib_data, whole, *common))
    assert result.step == 12 and math.isfinite(result.train_loss)
    [rewind] = read_metrics(whole, "rewind")
    assert (rewind["step"], rewind["diverged_at"], rewind["skipped_steps"]) == (4, 7, 4)
    assert rewind["checkpoint"].endswith("step_0000004")
    assert sorted(losses(whole)) == [4, 8, 12]  # step 8 of the diverged attempt is superseded
    end = read_metrics(whole, "end")[-1]
    assert end["tokens_by_source"] == {"stdlib": (12 + 4) * 512}  # the skipped batches were read, never trained

    # Stopped after the rewind (10); between the checkpoint and the divergence (5: the stop's own
    # checkpoint is not one the schedule saved, so the rewind still goes back to step 4); at the
    # diverged step itself (7: the stop's look finds it a step before the schedule's would, and the
    # batches up to that look, step 8's, are skipped as well): the same losses as never stopping.
    for stop in (10, 5, 7):
        monkeypatch.setattr(Trainer, "_clip_gradients", nan_norm_once_after(6))
        split = tmp_path / f"split-{stop}"
        train(tiny_config(stdlib_data, split, *common), stop_at_step=stop)
        monkeypatch.setattr(Trainer, "_clip_gradients", nan_norm_once_after(6 if stop < 7 else -1))
        train(tiny_config(stdlib_data, split, *common))
        got = losses(split)
        if stop != 5:  # (step 5's record, of a history the rewind left, is superseded)
            assert got.pop(stop)  # the stop logs its own step too
        assert got == losses(whole), stop
        [rewound] = read_metrics(split, "rewind")
        assert (rewound["checkpoint"][-4:], rewound["diverged_at"], rewound["skipped_steps"]) == ("0004", 7, 4), stop

    # A crash after the rewind, before the next checkpoint: the run resumes from step 4's
    # checkpoint past the skipped batches, as the rewound run went on, not into them again.
    monkeypatch.setattr(Trainer, "_clip_gradients", nan_norm_once_after(6))
    real_save = Trainer.save

    def crash_at_8(self, *args, **kwargs):
        if self.step == 8:
            raise RuntimeError("the node went away")
        return real_save(self, *args, **kwargs)
    monkeypatch.setattr(Trainer, "save", crash_at_8)
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="the node went away"):
        train(tiny_config(stdlib_data, crashed, *common))
    recorded = checkpoint.rewound(crashed / "checkpoints" / "step_0000004")
    assert (recorded["diverged_at"], recorded["skipped_steps"]) == (7, 4)
    monkeypatch.setattr(Trainer, "save", real_save)
    assert train(tiny_config(stdlib_data, crashed, *common)).resumed_from == 4
    assert losses(crashed) == losses(whole)
    # Its wall-clock (report/goodput.py): the rewind's unlogged steps (5 to the diverged 8) and the
    # crashed attempt's logged step 8 were trained again; every part is measured.
    [rewind] = read_metrics(crashed, "rewind")
    every, kept = read_metrics(crashed, superseded=True), read_metrics(crashed)
    [lost] = [r for r in every if r["kind"] == "train" and r not in kept]
    assert lost["step"] == 8 and lost["time"] > rewind["time"]
    time_ = account(every, kept)
    assert (time_["invocations"], time_["rewinds"]) == (2, 1) and rewind["lost_s"] > 0 and rewind["seconds"] > 0
    assert time_["parts"]["steps_redone"] == pytest.approx(rewind["lost_s"] + lost["step_s"])
    assert time_["parts"]["steps"] == pytest.approx(sum(r["step_s"] for r in kept if r["kind"] in ("train", "checkpoint")))
    assert all(r["setup_s"] > 0 for r in every if r["kind"] in ("start", "resume"))
    assert sum(time_["parts"].values()) == pytest.approx(time_["wall_s"], abs=ROUNDING_S) and 0 < time_["goodput"] < 1
    assert_accounted(time_)


def test_spike_statistics_flag_a_jump_not_noise_or_a_falling_loss():
    """A loss falling as training does, with noise of 0.02, is never flagged at 7 standard
    deviations, and the spread is the noise's (successive differences: not the fall's); a jump of
    0.5 is flagged, only once the window's steps have been seen; a NaN changes nothing."""
    torch.manual_seed(0)
    steps = torch.arange(400, dtype=torch.float32)
    series = 3 + 4 * torch.exp(-steps / 40) + 0.02 * torch.randn(400)
    stats = torch.zeros(4)
    for loss in series:
        stats, spike = loss_spike(stats, loss, sigmas=7, window=100)
        assert not spike
    assert stats[0] == 400 and abs(stats[1] - series[-100:].mean()) < 0.02 and 0.015 < stats[2].sqrt() < 0.025
    kept, spike = loss_spike(stats, torch.tensor(float("nan")), sigmas=7, window=100)
    assert not spike and torch.equal(kept, stats)
    assert loss_spike(stats, series[-1] + 0.5, sigmas=7, window=100)[1]
    assert not loss_spike(stats, series[-1] - 0.5, sigmas=7, window=100)[1]  # a fall is no spike
    early = torch.zeros(4)
    for loss in (4.0, 4.02, 3.98):
        early, _ = loss_spike(early, torch.tensor(loss), sigmas=7, window=8)
    assert not loss_spike(early, torch.tensor(9.0), sigmas=7, window=8)[1]  # 3 steps seen: too few to judge
    # Plain averages over the window's first half: the mean, and half the mean square step.
    assert early[0] == 3 and abs(early[1] - 4.0) < 1e-6 and abs(early[2] - (0.02 ** 2 + 0.04 ** 2) / 4) < 1e-6


def test_a_loss_spike_rewinds_to_before_it_and_a_resumed_run_judges_it_alike(stdlib_data, tmp_path, caplog):
    """train.spike_sigmas = 4: the update of step 12 takes 100 times its learning rate, and step
    13's loss jumps (a real spike, its loss still finite). The look at step 16 finds it; step
    12's checkpoint holds the update that made it, so the run goes back to step 8's, discards
    step 12's and skips the batches read since, with no spike in the steps before or after. A
    run stopped at step 6 and resumed keeps the loss statistics in its checkpoint: it finds the
    same spike, with the same numbers, and logs the same losses. With no checkpoint to go back to
    the spike is only logged and the run goes on."""
    common = ["train.steps=20", "checkpoint.interval=4", "eval.interval=0", "log.interval=4", "train.rewinds=1",
              "train.spike_sigmas=4", "train.spike_window=6"]
    whole = tmp_path / "whole"
    with glitched("spike", 12):  # (with TensorBoard: its scalars past the rewind are dropped, then retrained)
        assert train(tiny_config(stdlib_data, whole, *common, "log.tensorboard=true")).step == 20
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(whole / "tensorboard"))
    events.Reload()
    logged = events.Scalars("train/loss")  # each step once: the diverged steps' events purged
    assert [e.step for e in logged] == sorted(losses(whole))
    assert [e.value for e in logged] == pytest.approx([losses(whole)[e.step] for e in logged], rel=1e-6)
    [rewind] = read_metrics(whole, "rewind")
    assert (rewind["cause"], rewind["step"], rewind["diverged_at"], rewind["skipped_steps"]) == ("spike", 8, 13, 8)
    assert rewind["discarded"] == ["step_0000012"] and rewind["message"].startswith("a loss spike at step 13: loss ")
    assert not read_metrics(whole, "spike")  # (it would log any later one: no rewind is left)
    assert checkpoint.rewound(whole / "checkpoints" / "step_0000012") is None  # trained again, not the discarded one

    split = tmp_path / "split"
    train(tiny_config(stdlib_data, split, *common), stop_at_step=6)
    with glitched("spike", 12):
        assert train(tiny_config(stdlib_data, split, *common)).resumed_from == 6
    [again] = read_metrics(split, "rewind")
    assert again["message"] == rewind["message"] and "standard deviations above" in again["message"]
    got = losses(split)
    assert got.pop(6)  # the stop logs its own step too
    assert got == losses(whole)

    on = tmp_path / "on"
    with glitched("spike", 12), caplog.at_level(logging.WARNING, logger="scaletrain"):
        assert train(tiny_config(stdlib_data, on, *common, "checkpoint.interval=0")).step == 20
    [spike] = read_metrics(on, "spike")
    assert spike["step"] == 13 and spike["loss"] > spike["mean"] + 4 * spike["std"]
    assert not read_metrics(on, "rewind") and "no checkpoint from before step 12 to go back to" in caplog.text


def test_a_divergence_that_recurs_after_its_rewinds_stops_the_run(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="nothing was saved over the last good checkpoint"):
        train(tiny_config(stdlib_data, run_dir, "train.steps=30", "train.lr=1e4", "train.warmup_steps=0",
                          "train.clip=0", "checkpoint.interval=2", "eval.interval=0", "train.rewinds=2"))
    kinds = [r["kind"] for r in read_metrics(run_dir) if r["kind"] in ("rewind", "diverged")]
    assert kinds == ["rewind", "rewind", "diverged"]


def test_norms_by_part_add_up_to_the_whole_and_are_the_weights_of_the_checkpoint(stdlib_data, tmp_path):
    """log.norms: each part's gradient norm, squared and summed, is the step's grad_norm; each
    part's weight norm is that of the checkpoint's weights (after the update); tied weights count
    once, in the embedding."""
    from scaletrain.generate import load_model
    from scaletrain.train.trainer import model_part

    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=3", "log.norms=true", "eval.interval=0",
                      "checkpoint.interval=1", "checkpoint.keep=3", "model.mtp_depth=1",
                      "model.tie_embeddings=true"))
    records = read_metrics(run_dir, "train")
    assert list(records[0]["grad_norm_by_part"]) == ["embedding", "layers.0", "layers.1", "mtp.0", "head"]
    for record in records:
        whole = math.sqrt(sum(n ** 2 for n in record["grad_norm_by_part"].values()))
        assert whole == pytest.approx(record["grad_norm"], rel=1e-5)
        model = load_model(run_dir, step=record["step"])[0]
        squares: dict[str, float] = {}
        for name, p in model.named_parameters():
            squares[model_part(name)] = squares.get(model_part(name), 0.0) + p.detach().double().square().sum().item()
        assert record["weight_norm_by_part"] == pytest.approx({k: math.sqrt(v) for k, v in squares.items()}, rel=1e-5)


def test_a_crashed_invocations_training_past_its_last_record_counts_as_redone_by_its_heartbeat(
        stdlib_data, tmp_path, monkeypatch):
    """Records at step 4 (train, checkpoint), then steps 5 and 6 trained with no record and the
    process dies in step 7: its heartbeat (every step here) said step 6; the resumed invocation's
    resume record carries that beat's time, and the goodput counts the seconds from the last
    record to it as steps redone, the rest of the gap as the restart."""
    monkeypatch.setattr(Heartbeat, "EVERY", 0.0)
    real_step = Trainer.train_step

    def dies_in_step_7(self, *args, **kwargs):
        if self.step == 6:
            raise RuntimeError("the node went away")
        return real_step(self, *args, **kwargs)
    monkeypatch.setattr(Trainer, "train_step", dies_in_step_7)
    common = ["train.steps=8", "checkpoint.interval=4", "eval.interval=0", "log.interval=4"]
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the node went away"):
        train(tiny_config(stdlib_data, run_dir, *common))
    beat = json.loads((run_dir / "heartbeat.json").read_text())
    last = max(r["time"] for r in read_metrics(run_dir))
    assert beat["step"] == 6 and beat["time"] >= last
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert train(tiny_config(stdlib_data, run_dir, *common)).resumed_from == 4
    [resume] = read_metrics(run_dir, "resume")
    assert resume["last_alive"] == beat["time"]
    time_ = account(read_metrics(run_dir, superseded=True), read_metrics(run_dir))
    assert time_["parts"]["steps_redone"] == pytest.approx(beat["time"] - last, abs=1e-6)
    assert json.loads((run_dir / "heartbeat.json").read_text())["step"] == 8
    assert sum(time_["parts"].values()) == pytest.approx(time_["wall_s"], abs=ROUNDING_S)
    assert_accounted(time_)
    # An invocation's end beats whatever the last beat's age: its last moment alive, not a step before.
    monkeypatch.setattr(Heartbeat, "EVERY", 3600.0)
    train(tiny_config(stdlib_data, tmp_path / "short", "train.steps=2", "eval.interval=0"))
    beat = json.loads((tmp_path / "short" / "heartbeat.json").read_text())
    assert beat["step"] == 2 and beat["time"] >= max(r["time"] for r in read_metrics(tmp_path / "short", "train"))


def test_float16_scales_the_loss_skips_overflowing_steps_resumes_exactly_and_is_refused_where_it_cannot(
        stdlib_data, tmp_path, monkeypatch):
    """train.dtype = float16 (on the CPU here, as on a GPU without bfloat16): the loss is scaled,
    a step whose gradient overflows float16 is skipped and the scale halved, 3 steps without one
    double it (here; 2,000 by default); the scale is checkpointed, so a resumed run logs the
    same losses; a one-off non-finite gradient is an overflow, not a divergence."""
    from scaletrain.parallel.layout import resolve_layout
    from scaletrain.train import trainer as trainer_module
    from scaletrain.train.trainer import check_float16

    common = ["train.steps=10", "train.dtype=float16", "eval.interval=0", "log.interval=1", "checkpoint.interval=5"]
    train(tiny_config(stdlib_data, tmp_path / "float32", "train.steps=10", "eval.interval=0", "log.interval=1"))
    monkeypatch.setattr(trainer_module, "LOSS_SCALE_START", 2.0 ** 24)  # (this model's gradients overflow above 2^21)
    train(tiny_config(stdlib_data, tmp_path / "high", *common))
    records = read_metrics(tmp_path / "high", "train")
    scales = [2.0 ** 24] + [r["loss_scale"] for r in records]
    halved = [after == before / 2 for before, after in zip(scales, scales[1:])]
    assert halved[:3] == [True] * 3 and not all(halved), scales
    assert all(half == (not math.isfinite(r["grad_norm"])) for half, r in zip(halved, records))  # (skipped)
    # Scaled below overflow: float32's first loss to float16's precision; 3 steps without an
    # overflow double the scale (here), and a resumed run takes it from its checkpoint.
    monkeypatch.setattr(trainer_module, "LOSS_SCALE_START", 2.0 ** 10)
    monkeypatch.setattr(trainer_module, "LOSS_SCALE_GROWTH_STEPS", 3)
    train(tiny_config(stdlib_data, tmp_path / "whole", *common))
    records = read_metrics(tmp_path / "whole", "train")
    assert [r["loss_scale"] for r in records] == [2.0 ** e for e in (10, 10, 11, 11, 11, 12, 12, 12, 13, 13)]
    assert records[0]["loss"] == pytest.approx(losses(tmp_path / "float32")[1], rel=1e-3)
    train(tiny_config(stdlib_data, tmp_path / "split", *common), stop_at_step=5)
    train(tiny_config(stdlib_data, tmp_path / "split", *common))
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    assert [r["loss_scale"] for r in read_metrics(tmp_path / "split", "train")] == [r["loss_scale"] for r in records]
    # A forward pass that overflows once (its loss and gradient not finite), at a step looked
    # at: skipped and the scale halved, the run goes on.
    mean = Trainer._mean_over_last_stage
    monkeypatch.setattr(Trainer, "_mean_over_last_stage",
                        lambda self, value: mean(self, value) * (math.inf if self.step == 2 else 1.0))
    with glitched("nan", 2):
        train(tiny_config(stdlib_data, tmp_path / "glitch", *common[:-1], "train.steps=4"))
    glitch = read_metrics(tmp_path / "glitch", "train")
    assert [r["loss_scale"] for r in glitch] == [2.0 ** e for e in (10, 10, 9, 9)] and glitch[2]["loss"] == math.inf
    monkeypatch.setattr(Trainer, "_mean_over_last_stage", mean)
    # On a GPU without bfloat16, auto takes float16, or float32 where its scaling does not reach.
    monkeypatch.setattr(trainer_module, "training_dtype", lambda choice, device: torch.float16)
    assert Trainer(tiny_config(stdlib_data, tmp_path / "moe", "model.moe_experts=4")).dtype == torch.float32
    assert Trainer(tiny_config(stdlib_data, tmp_path / "dense")).dtype == torch.float16
    # Where the scale does not reach, refused in one sentence.
    cfg = tiny_config(stdlib_data, tmp_path / "tp", "train.dtype=float16", "parallel.tp=2")
    with pytest.raises(ConfigError, match="train.dtype = float16 scales the loss on one device or data-parallel "
                                          "layouts of a dense model, not with parallel.tp = 2; use train.dtype = "
                                          "float32"):
        check_float16(cfg, resolve_layout(cfg.parallel, 2))
    cfg = tiny_config(stdlib_data, tmp_path / "chunked", "train.dtype=float16", "train.loss_chunk_tokens=64")
    with pytest.raises(ConfigError, match="not with train.loss_chunk_tokens = 64"):
        check_float16(cfg, resolve_layout(cfg.parallel, 1))
