"""`scaletrain eval`: a run's checkpoints measured after training, as training measured them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli, tiny_config
from scaletrain.config import ConfigError, load_config
from scaletrain.data.loader import eval_batches
from scaletrain.data.shards import read_index
from scaletrain.data.tokenizer import load_tokenizer
from scaletrain.evaluate import evaluate_run
from scaletrain.train.checkpoint import CheckpointError
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train


@pytest.fixture(scope="module")
def evaluated_run(stdlib_data, next_line_task, short_documents, tmp_path_factory):
    """4 steps with a checkpoint and an evaluation (validation loss, a held-out set's and a task) every 2."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=4", "checkpoint.interval=2", "eval.interval=2",
                      f"eval.tasks=['{next_line_task}']", "eval.task_examples=12",
                      f"eval.data={{documents = '{short_documents}'}}"))
    return run_dir


def _listing(run_dir):
    return sorted((str(p.relative_to(run_dir)), p.stat().st_size) for p in run_dir.rglob("*"))


def test_every_checkpoint_measures_what_training_measured_and_the_run_is_left_as_it_was(evaluated_run):
    before = _listing(evaluated_run)
    records = list(evaluate_run(evaluated_run, every=True))
    assert [(r["step"], r["tokens"]) for r in records] == [(2, 1024), (4, 2048)]
    for record, logged in zip(records, read_metrics(evaluated_run, "eval"), strict=True):
        for key in ("loss", "loss_by_source", "bits_per_byte", "bits_per_byte_by_source", "task_accuracy",
                    "task_accuracy_norm", "task_nll", "heldout_loss", "heldout_bits_per_byte"):
            assert record[key] == logged[key], key  # the same numbers, to the bit
    assert _listing(evaluated_run) == before
    # Bits per byte: the loss in bits over the bytes the validation windows' target tokens decode
    # to (the stdlib's text decodes whole: no window cuts a character in two here).
    data = Path(load_config(evaluated_run / "config.toml").data.path)
    tokenizer, eos = load_tokenizer(data), read_index(data)["eos_id"]
    targets = torch.cat([t[t != -100] for _, t in eval_batches(data, 64, 1024, 4)])
    text = tokenizer.decode([i for i in targets.tolist() if i != eos])
    assert "\ufffd" not in text
    assert records[-1]["bits_per_byte"] == pytest.approx(records[-1]["loss"] / math.log(2) * len(targets)
                                                         / len(text.encode()), rel=1e-9)
    # The newest by default; chosen steps in the order given.
    assert [r["step"] for r in evaluate_run(evaluated_run, tasks=[])] == [4]
    assert [r["step"] for r in evaluate_run(evaluated_run, steps=[4, 2], tasks=[])] == [4, 2]


def test_a_checkpoint_the_run_prunes_while_it_is_read_is_skipped(evaluated_run, tmp_path, monkeypatch, caplog):
    """A run evaluated while it trains prunes its older checkpoints as it goes: one that is gone
    by the time it is read is passed over with a warning, not the end of the evaluation."""
    from scaletrain.train import checkpoint

    live = tmp_path / "live"
    shutil.copytree(evaluated_run, live)
    load = checkpoint.load

    def pruned_first(path, state, optional=()):
        if checkpoint.step_of(path) == 2:
            shutil.rmtree(path)  # the training run's pruning, between the listing and the read
        return load(path, state, optional)

    monkeypatch.setattr(checkpoint, "load", pruned_first)
    assert [r["step"] for r in evaluate_run(live, every=True, tasks=[])] == [4]
    assert "step_0000002 is gone (the run pruned it while it was read): skipped" in caplog.text

    def damaged(path, state, optional=()):
        raise checkpoint.CheckpointDamaged(f"checkpoint {path} is not usable: a file changed")

    monkeypatch.setattr(checkpoint, "load", damaged)  # damaged, not gone: the evaluation stops, saying so
    with pytest.raises(CheckpointError, match="a file changed"):
        next(evaluate_run(live, steps=[4], tasks=[]))


def test_the_evaluations_one_step_splits_over_any_layout(evaluated_run, tmp_path):
    """The evaluation's made-up step must pass train's layout checks whatever the layout: a
    zero-bubble V schedule needs pp x 2 micro-batches on each pipeline (checked here on the
    config alone: model.n_layers=4 gives it the stages, not weights to load)."""
    from scaletrain.evaluate import evaluation_config
    from scaletrain.parallel.layout import check_layout, resolve_layout

    [newest] = evaluated_run.joinpath("checkpoints").glob("step_0000004")
    for overrides in (["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_schedule=zbv_zero_bubble"],
                      ["parallel.tp=2", "parallel.dp_shard=2"], ["parallel.dp_shard=4"]):
        cfg = evaluation_config(evaluated_run, newest, None, [], ["model.n_layers=4", *overrides], 4,
                                tmp_path / "scratch")
        check_layout(resolve_layout(cfg.parallel, 4), cfg)


def test_other_data_another_context_length_and_other_tasks(evaluated_run, short_documents, next_line_task):
    [own] = evaluate_run(evaluated_run, tasks=[])
    assert "task_accuracy" not in own
    [other] = evaluate_run(evaluated_run, data=str(short_documents), tasks=[])
    assert list(other["loss_by_source"]) == ["documents"] and other["loss"] != own["loss"]
    # eval.data's held-out set is measured as the same data given as the run's own is.
    assert own["heldout_loss"] == {"documents": other["loss"]} and set(own["heldout_bits_per_byte"]) == {"documents"}
    assert own["measured_tokens"] == other["measured_tokens"]  # (the held-out set's tokens are not the run's)
    from scaletrain.report.run import run_report

    assert run_report(evaluated_run)["heldout_loss"] == read_metrics(evaluated_run, "eval")[-1]["heldout_loss"]
    shown = " ".join(run_cli("report", str(evaluated_run)).stdout.replace("│", " ").split())
    assert "held-out" in shown and f"documents {own['heldout_loss']['documents']:.4f}" in shown
    # Sequences twice as long as trained (what a context-extension stage would be measured at).
    [longer] = evaluate_run(evaluated_run, tasks=[str(next_line_task)],
                            overrides=["data.seq_len=128", "model.max_seq_len=128", "eval.task_examples=4"])
    assert longer["loss"] == pytest.approx(own["loss"], rel=0.2) and longer["loss"] != own["loss"]
    assert longer["task_accuracy"]["next_line"] in (0, 0.25, 0.5, 0.75, 1)  # (of eval.task_examples = 4 examples)


def test_a_held_out_set_of_another_tokenizer_is_refused_before_training(stdlib_data, tmp_path):
    from scaletrain.data import prepare

    (tmp_path / "other.txt").write_text("Text of another corpus, tokenized its own way. " * 40)
    other = tmp_path / "other"
    prepare([str(tmp_path / "other.txt")], other, vocab_size=300, filters="none", workers=1)
    for name in ("other", stdlib_data.name):  # (also under the training data's own name)
        with pytest.raises(ConfigError, match="eval.data: the data directories .* have different tokenizers"):
            train(tiny_config(stdlib_data, tmp_path / "run", f"eval.data={{{name} = '{other}'}}"))
    # A held-out set without a validation split is refused before the first step, not at the first evaluation.
    unsplit = tmp_path / "unsplit"
    prepare([str(tmp_path / "other.txt")], unsplit, vocab_size=300, filters="none", workers=1, val_fraction=0,
            tokenizer=stdlib_data / "tokenizer.json")
    with pytest.raises(ConfigError, match="eval.data's 'unsplit': .*val"):
        train(tiny_config(stdlib_data, tmp_path / "run", f"eval.data={{unsplit = '{unsplit}'}}"))
    assert not (tmp_path / "run").exists()


def test_checkpoints_averaged_in_the_trainers_layout_and_in_the_export_are_the_same_model(evaluated_run, stdlib_data,
                                                                                         tmp_path):
    """--average K: the mean of a checkpoint's weights and the K - 1 before it (LAWA), summed
    shard by shard in the trainer for eval, whole in one process for export: the same weights."""
    from scaletrain.generate import load_model
    from scaletrain.hf import export_hf

    [averaged] = evaluate_run(evaluated_run, average=2, tasks=[])
    assert (averaged["step"], averaged["averaged_steps"]) == (4, [2, 4])
    assert [r["step"] for r in evaluate_run(evaluated_run, every=True, average=2, tasks=[])] == [4]
    [alone] = evaluate_run(evaluated_run, tasks=[])
    assert averaged["loss"] != alone["loss"]
    mean, _, _ = load_model(evaluated_run, average=2)
    two, four = (load_model(evaluated_run, step=step)[0].state_dict() for step in (2, 4))
    for name, value in mean.state_dict().items():
        assert torch.equal(value, (two[name] + four[name]) / 2), name
    export_hf(evaluated_run, tmp_path / "hf", average=2)
    assert "the mean of that checkpoint's and the 1 before it" in (tmp_path / "hf" / "README.md").read_text()
    [exported] = evaluate_run(tmp_path / "hf", data=str(stdlib_data), overrides=["eval.tokens=1024",
                                                                                  "train.micro_batch=4"])
    assert exported["loss"] == pytest.approx(averaged["loss"], rel=1e-6)
    with pytest.raises(CheckpointError, match="an average of 3 checkpoints ending at step 4 needs 2 .* keeps 1"):
        next(evaluate_run(evaluated_run, average=3))
    with pytest.raises(ConfigError, match="keeps 2 complete checkpoints, fewer than an average of 3"):
        next(evaluate_run(evaluated_run, every=True, average=3))


def test_requests_that_cannot_be_served_are_refused_in_one_sentence(evaluated_run, stdlib_data, tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        next(evaluate_run(tmp_path))
    with pytest.raises(CheckpointError, match="no complete checkpoint of step 3; .* steps: 2, 4"):
        next(evaluate_run(evaluated_run, steps=[2, 3]))
    retokenized = tmp_path / "retokenized"
    shutil.copytree(stdlib_data, retokenized)
    tokenizer = json.loads((retokenized / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # (another tokenizer of the same size: two tokens' ids swapped)
    first, second = list(vocab)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (retokenized / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="another tokenizer than the run .*--tokenizer"):
        next(evaluate_run(evaluated_run, data=str(retokenized)))
    with pytest.raises(ConfigError, match=r"model.dim = 32: the checkpoints of .* hold the model of its config "
                                          r"\(model.dim = 64\); drop the override"):
        next(evaluate_run(evaluated_run, overrides=["model.dim=32"]))
    with pytest.raises(ConfigError, match="eval.tokenz"):
        next(evaluate_run(evaluated_run, overrides=["eval.tokenz=5"]))
    moved = tmp_path / "moved"  # a run whose data is not where its config says (another machine, another folder)
    shutil.copytree(evaluated_run, moved)
    (moved / "config.toml").write_text((moved / "config.toml").read_text().replace(str(stdlib_data),
                                                                                      str(tmp_path / "elsewhere")))
    with pytest.raises(ConfigError, match="elsewhere.*give it with --data DIR"):
        next(evaluate_run(moved))


def test_the_command_across_two_tensor_parallel_processes_measures_what_one_does(evaluated_run, next_line_task,
                                                                                   tmp_path):
    """`--nproc 2` with a layout given after the options (overrides may follow them)."""
    one = list(evaluate_run(evaluated_run, steps=[2, 4], tasks=[str(next_line_task)]))
    out = tmp_path / "evals.jsonl"
    result = run_cli("eval", str(evaluated_run), "--step", "2", "--step", "4", "--tasks", str(next_line_task),
                     "--out", str(out), "--nproc", "2", "parallel.tp=2", "eval.task_examples=12")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "next_line accuracy" in result.stdout
    two = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in two] == [2, 4]
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["task_accuracy"] == a["task_accuracy"]
        assert b["task_nll"]["next_line"] == pytest.approx(a["task_nll"]["next_line"], abs=1e-5)
    result = run_cli("eval", str(evaluated_run), "--all", "--step", "2")
    assert result.returncode == 2 and "not both" in result.stderr
    # Averaged checkpoints across two FSDP shards (each rank adds up its own rows).
    [averaged] = evaluate_run(evaluated_run, average=2, tasks=[])
    result = run_cli("eval", str(evaluated_run), "--average", "2", "--tasks", "--out", str(out), "--nproc", "2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    [sharded] = [json.loads(line) for line in out.read_text().splitlines()]
    assert sharded["averaged_steps"] == [2, 4] and sharded["loss"] == pytest.approx(averaged["loss"], abs=1e-5)
