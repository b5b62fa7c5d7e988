"""`scaletrain cooldown`: a learning-rate decay branched off a checkpoint of a run's stable stretch
trains the losses of a run given that schedule from the start; refusals in one line."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_cli, tiny_config
from scaletrain.config import ConfigError, load_config
from scaletrain.cooldown import cooldown_config
from scaletrain.data.shards import DataError
from scaletrain.model.flops import param_counts
from scaletrain.scaling.laws import ChinchillaLaw
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

WSD = ["train.schedule=wsd", "train.warmup_steps=2", "eval.interval=0", "log.interval=1", "checkpoint.keep=10"]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def test_a_cooldown_branch_trains_what_that_schedule_trains_from_the_start(stdlib_data, tmp_path):
    """The run: 16 steps of WSD whose decay starts at 12, checkpoints every 4. A branch off step 8
    decaying over 3 steps (1-sqrt) equals a run of 11 steps whose WSD decay is its last 3, trained
    from step 0 — its steps 9-11 exactly, the schedule's rates too — and stopped and run again it
    resumes its own checkpoints."""
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, *WSD, "train.steps=16", "train.decay_fraction=0.25",
                      "checkpoint.interval=4"))
    reference = tmp_path / "reference"
    train(tiny_config(stdlib_data, reference, *WSD, "train.steps=11", f"train.decay_fraction={3 / 11}",
                      "train.decay_shape=1-sqrt", "checkpoint.interval=0"))
    result = run_cli("cooldown", str(run_dir), "--step", "8", "--steps", "3", "--decay-shape", "1-sqrt",
                     "--stop-at-step", "10")
    assert result.returncode == 0, result.stderr
    branch = tmp_path / "run-cooldown-8"
    assert f"wrote {tmp_path / 'run-cooldown-8.toml'}" in " ".join(result.stdout.split())
    assert max(losses(branch)) == 10
    # Run again, it resumes its own checkpoint, even after the run has pruned the one it came from.
    pruned = tmp_path / "step_8"
    shutil.move(run_dir / "checkpoints" / "step_0000008", pruned)
    result = run_cli("cooldown", str(run_dir), "--step", "8", "--steps", "3", "--decay-shape", "1-sqrt")
    assert result.returncode == 0, result.stderr
    shutil.move(pruned, run_dir / "checkpoints" / "step_0000008")
    got, expected = losses(branch), losses(reference)
    assert [got[s] for s in (9, 10, 11)] == [expected[s] for s in (9, 10, 11)]
    rates = {r["step"]: r["lr"] for r in read_metrics(branch, "train")}
    assert rates == {r["step"]: r["lr"] for r in read_metrics(reference, "train") if r["step"] > 8}
    assert read_metrics(branch, "end")[-1]["complete"]

    # The run's report sets the branch's annealed loss against the law's L(N, D) at its tokens.
    law = ChinchillaLaw(E=2.0, A=60.0, B=400.0, alpha=0.3, beta=0.3)
    (tmp_path / "law.json").write_text(json.dumps(
        {"approach3": {k: {"value": v} for k, v in law.to_dict().items() if k != "source"}, "bootstrap": []}))
    result = run_cli("report", str(run_dir), "--law", str(tmp_path / "law.json"))
    assert result.returncode == 0, result.stderr
    final = read_metrics(branch, "eval")[-1]
    n = param_counts(load_config(run_dir / "config.toml").model)["total"]
    predicted = law.loss(n, final["tokens"])
    assert final["step"] == 11 and final["tokens"] == 11 * 512
    assert (f"cooldown from step 8 (run-cooldown-8) │ {final['loss']:.4f} at {final['tokens']:,} tokens (law "
            f"{predicted:.4f}, {(final['loss'] - predicted) / predicted:+.2%})") in " ".join(result.stdout.split())
    assert "cooldown from step 8 (run-cooldown-8)" in (run_dir / "report.html").read_text()
    # A run moved since it trained branches beside where it is now, where its report looks.
    moved = tmp_path / "moved" / "run"
    shutil.copytree(run_dir, moved)
    assert cooldown_config(moved, 8, 3).run_dir == tmp_path / "moved" / "run-cooldown-8"
    # The branch run again under another decay (or min_lr_ratio) would train no one schedule: refused.
    assert cooldown_config(run_dir, 8, 3, "1-sqrt").checkpoint.resume == "auto"
    with pytest.raises(ConfigError, match=r"holds this branch begun with train.decay_shape = '1-sqrt', not 'linear': "
                                          r"resumed, it would train no one schedule"):
        cooldown_config(run_dir, 8, 3, "linear")
    with pytest.raises(ConfigError, match=r"train.min_lr_ratio = 0.1, not 0.5"):
        cooldown_config(run_dir, 8, 3, "1-sqrt", overrides=["train.min_lr_ratio=0.5"])


def test_a_cooldown_is_refused_off_the_stable_stretch_or_without_its_checkpoint(stdlib_data, tmp_path, caplog):
    cosine = tmp_path / "cosine"
    train(tiny_config(stdlib_data, cosine, "train.steps=8", "train.warmup_steps=2", "eval.interval=0",
                      "checkpoint.interval=4"))
    with pytest.raises(ConfigError, match=r"trains a 'cosine' schedule, whose learning rate decays from its warmup "
                                          r"on \(0\.00\d+ before step 4, of its peak train\.lr = 0\.003\); a cooldown "
                                          r"branches from the stable stretch of a 'wsd' or 'constant' schedule"):
        cooldown_config(cosine, 4, 2)
    with pytest.raises(ConfigError, match="has no complete checkpoint of step 5; it has 4, 8"):
        cooldown_config(cosine, 5, 2)
    result = run_cli("cooldown", str(tmp_path), "--step", "4", "--steps", "2")
    assert result.returncode == 2 and "is not a run directory" in result.stderr and "Traceback" not in result.stderr
    constant = tmp_path / "constant"
    train(tiny_config(stdlib_data, constant, "train.steps=8", "train.warmup_steps=6", "train.schedule=constant",
                      "eval.interval=0", "checkpoint.interval=4"))
    with pytest.raises(ConfigError, match="in its warmup"):
        cooldown_config(constant, 4, 2)
    # The branch resumes the run's checkpoint: it keeps the run's model, and its data is checked
    # before its config is written.
    with pytest.raises(ConfigError, match="keeps the run's model; drop the overrides of model.dim"):
        cooldown_config(constant, 8, 4, overrides=["model.dim=32", "model.n_heads=2"])
    with pytest.raises(DataError, match="does not exist; create it with `scaletrain data prepare`"):
        cooldown_config(constant, 8, 4, overrides=[f"data.path={tmp_path / 'nowhere'}"])
    # What makes it a branch is its own: a schedule, length or start of the user's would undo it.
    for overrides, message in ((["train.schedule=constant"], "sets train.schedule itself .* give --steps instead"),
                               (["checkpoint.resume=never", "train.decay_shape=linear"],
                                r"sets checkpoint.resume, train.decay_shape itself .* give --decay-shape, --step")):
        with pytest.raises(ConfigError, match=message):
            cooldown_config(constant, 8, 4, overrides=overrides)
    branch = cooldown_config(constant, 8, 4, name="annealed", overrides=["train.min_lr_ratio=0"])
    assert (branch.run.name, branch.train.steps, branch.train.min_lr_ratio) == ("annealed", 12, 0.0)
    assert branch.checkpoint.resume.endswith("step_0000008")
    caplog.clear()  # a decay longer than the run it branches from is trained, and said to be unusual
    assert cooldown_config(constant, 8, 40, name="long").train.steps == 48
    assert "a cooldown of 40 steps is longer than the 8 steps it branches from: its decay is 83%" in caplog.text
    assert "give --steps about 2 for that" in caplog.text
    # On two processes (the one process's checkpoint resharded over them).
    result = run_cli("cooldown", str(constant), "--step", "8", "--steps", "2", "--nproc", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_metrics(tmp_path / "constant-cooldown-8", "end")[-1]["complete"]
    # What is there is not written over: the run itself, another branch, a branch of other steps, a
    # foreign file of the branch's name; options are checked before anything is written.
    done = tmp_path / "constant-cooldown-8"
    before = {p: p.read_bytes() for p in (done / "branch.json", done / "config.toml", tmp_path / "constant-cooldown-8.toml")}
    with pytest.raises(ConfigError, match="'constant' is the run's own name"):
        cooldown_config(constant, 8, 2, name="constant")
    with pytest.raises(ConfigError, match="holds this run's branch from step 8 over 2 steps; give --steps 2 to resume"):
        cooldown_config(constant, 8, 3)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "branch.json").write_text(json.dumps({"of": "/runs/other", "step": 3, "steps": 1}))
    with pytest.raises(ConfigError, match="already holds a branch of '/runs/other' from step 3; give --name a new name"):
        cooldown_config(constant, 8, 2, name="elsewhere")
    with pytest.raises(ConfigError, match="already holds files of another run"):
        cooldown_config(constant, 8, 2, name="cosine")
    (tmp_path / "notes.toml").write_text("my notes\n")
    with pytest.raises(ConfigError, match="notes.toml' exists and is not a config of run 'notes'"):
        cooldown_config(constant, 8, 2, name="notes")
    result = run_cli("cooldown", str(constant), "--step", "8", "--steps", "2", "--name", "fresh", "--stop-at-step", "0")
    assert result.returncode == 2 and "--stop-at-step 0 must be a step number" in result.stderr
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "fresh.toml").exists()
    assert {p: p.read_bytes() for p in before} == before and (tmp_path / "notes.toml").read_text() == "my notes\n"
    assert cooldown_config(constant, 8, 2).checkpoint.resume == "auto"  # the same branch again resumes its own
