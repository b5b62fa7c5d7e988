"""The moving average of the weights (train.ema_decay): its recursion from the run's first weights,
its evaluation during training and afterwards, its export, exact resume, and refusals."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from conftest import run_cli, tiny_config
from scaletrain.cli import eval_table
from scaletrain.config import ConfigError
from scaletrain.evaluate import evaluate_run, weights_to_evaluate
from scaletrain.generate import load_model
from scaletrain.hf import export_hf
from scaletrain.train.checkpoint import CheckpointError
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import Trainer, train

COMMON = ["train.steps=4", "train.ema_decay=0.5", "checkpoint.interval=1", "checkpoint.keep=4", "eval.interval=2"]


@pytest.fixture(scope="module")
def ema_run(stdlib_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ema") / "run"
    train(tiny_config(stdlib_data, run_dir, *COMMON))
    return run_dir


def test_the_average_follows_its_recursion_from_the_runs_first_weights(stdlib_data, ema_run, tmp_path):
    first = Trainer(tiny_config(stdlib_data, tmp_path / "fresh", *COMMON))  # the same seed: the same first weights
    previous = {name: value.clone() for name, value in first.model.state_dict().items()}
    first.loader.close()
    for step in range(1, 5):
        weights = load_model(ema_run, step=step)[0].state_dict()
        average = load_model(ema_run, step=step, ema=True)[0].state_dict()
        for name, value in average.items():
            torch.testing.assert_close(value, 0.5 * previous[name] + 0.5 * weights[name], rtol=0, atol=1e-6)
            assert not torch.equal(value, weights[name]), (step, name)
        previous = average


def test_evaluations_measure_the_average_as_eval_and_export_take_it(stdlib_data, ema_run, tmp_path):
    records = {r["step"]: r for r in read_metrics(ema_run, "eval")}
    assert set(records) == {2, 4} and all(r["ema_loss"] != r["loss"] for r in records.values())
    [measured] = evaluate_run(ema_run, steps=[4], ema=True)
    assert measured["ema"] and abs(measured["loss"] - records[4]["ema_loss"]) < 1e-6
    [plain] = evaluate_run(ema_run, steps=[4])
    assert abs(plain["loss"] - records[4]["loss"]) < 1e-6

    export_hf(ema_run, tmp_path / "hf", ema=True)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    average = load_model(ema_run, ema=True)[0]
    assert torch.equal(exported["model.embed_tokens.weight"], average.tok_embeddings.weight.detach())
    card = " ".join((tmp_path / "hf" / "README.md").read_text().split())
    assert "moving average of the run's, decay 0.5 a step" in card
    assert f"| validation loss of the moving average at step 4 ({records[4]['tokens']:,} tokens) | " \
           f"{records[4]['ema_loss']:.4f} |" in card  # the exported weights' loss, not the run's own
    assert f"{records[4]['loss']:.4f}" not in card
    with pytest.raises(ConfigError, match=r"Hugging Face model, one set of weights.*moving average \(--ema\)"):
        weights_to_evaluate(tmp_path / "hf", ema=True)  # (an export keeps no average of its own)
    # Both kinds of averaging: the mean of the last two checkpoints' moving averages.
    three, four = (load_model(ema_run, step=step, ema=True)[0].state_dict() for step in (3, 4))
    mean = load_model(ema_run, step=4, average=2, ema=True)[0].state_dict()
    for name, value in mean.items():
        torch.testing.assert_close(value, (three[name] + four[name]) / 2, rtol=0, atol=1e-7)
    [both] = evaluate_run(ema_run, steps=[4], ema=True, average=2)
    assert both["ema"] and both["averaged_steps"] == [3, 4] and both["loss"] != measured["loss"]
    printed = io.StringIO()  # the title `scaletrain eval --ema --average 2` prints
    Console(file=printed, width=300).print(eval_table(str(ema_run), [both]))
    assert ("(each the mean of 2 checkpoints' moving averages of the weights, ending at its step)"
            in " ".join(printed.getvalue().split()))
    export_hf(ema_run, tmp_path / "both", average=2, ema=True)
    exported = load_file(tmp_path / "both" / "model.safetensors")
    assert torch.equal(exported["model.embed_tokens.weight"], mean["tok_embeddings.weight"])
    assert ("the mean of the moving averages of the run's weights (decay 0.5 a step) held by that checkpoint and the 1 "
            "before it") in " ".join((tmp_path / "both" / "README.md").read_text().split())
    assert "not of the mean exported (`scaletrain eval --average 2 --ema` measures it)" in " ".join(
        (tmp_path / "both" / "README.md").read_text().split())
    memory = read_metrics(ema_run, "memory")[0]["bytes_by_rank"][0]
    assert memory["ema"] == memory["parameters"]  # float32, as the weights
    report = run_cli("report", str(ema_run))
    assert report.returncode == 0, report.stderr
    [line] = [line for line in report.stdout.splitlines() if "final validation loss, moving average" in line]
    assert f"{records[4]['ema_loss']:.4f}" in line


def test_a_run_with_an_average_resumes_exactly_and_one_without_is_refused_it(stdlib_data, ema_run, tmp_path):
    split = tmp_path / "split"
    train(tiny_config(stdlib_data, split, *COMMON), stop_at_step=3)
    train(tiny_config(stdlib_data, split, *COMMON))
    assert [r["ema_loss"] for r in read_metrics(split, "eval")] == [r["ema_loss"] for r in read_metrics(ema_run, "eval")]

    plain = tmp_path / "plain"
    train(tiny_config(stdlib_data, plain, "train.steps=2", "eval.interval=0"))
    with pytest.raises(CheckpointError, match="holds no moving average of the weights .*train.ema_decay = 0"):
        list(evaluate_run(plain, ema=True))
    refused = run_cli("export", str(plain), "--ema", "--out", str(tmp_path / "out"))
    assert refused.returncode != 0 and "holds no moving average" in refused.stderr
    assert not (tmp_path / "out").exists()
    # Tied embeddings: one average of the one matrix.
    tied = tmp_path / "tied"
    train(tiny_config(stdlib_data, tied, "train.steps=2", "eval.interval=2", "train.ema_decay=0.5",
                      "model.tie_embeddings=true"))
    memory = read_metrics(tied, "memory")[0]["bytes_by_rank"][0]
    assert memory["ema"] == memory["parameters"]
    averaged = load_model(tied, ema=True)[0]
    assert averaged.output.weight is averaged.tok_embeddings.weight
    # Turned on when the run resumes: the average begins from the weights it resumes with.
    train(tiny_config(stdlib_data, plain, "train.steps=3", "eval.interval=0", "train.ema_decay=0.9"))
    assert "ema_loss" in read_metrics(plain, "eval")[-1]
    assert json.loads((plain / "metrics.jsonl").read_text().splitlines()[-1])["kind"] == "end"
