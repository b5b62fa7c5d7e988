"""The `scaletrain` command as a user runs it: real processes, real files, one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_cli, tiny_config
from scaletrain.errors import UserError
from scaletrain.generate import generate_text
from scaletrain.train.trainer import train


def assert_one_line_error(result, *words):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], (word, result.stderr)


@pytest.fixture(scope="module")
def trained_run(stdlib_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    train(tiny_config(stdlib_data, run_dir, "train.steps=6", "eval.interval=0"))
    return run_dir


def test_help_lists_the_commands():
    result = run_cli("--help", fresh=True)  # `python -m scaletrain.cli` in a new interpreter, not a fork
    assert result.returncode == 0
    for command in ["data", "train", "generate"]:
        assert command in result.stdout


def test_data_prepare_writes_a_data_directory_then_reuses_it(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    sources = [p for p in sorted((ROOT / "src" / "scaletrain").rglob("*.py")) if p.stat().st_size]
    for i, path in enumerate(sources):
        (corpus / f"{i}.txt").write_text(path.read_text())
    out = tmp_path / "data"
    args = ["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.1",
            "--filters", "none", "--workers", "1"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert "train tokens" in first.stdout
    for name in ["tokenizer.json", "index.json", "stats.json", "manifest.json"]:
        assert (out / name).is_file(), name
    stats = json.loads((out / "stats.json").read_text())
    assert stats["documents"]["kept"] == len(list(corpus.iterdir()))
    again = run_cli(*args)
    assert again.returncode == 0 and "reused" in again.stdout
    # Other options into the same directory: refused in one line, then replaced when asked.
    assert_one_line_error(run_cli(*args, "--seed", "1"), "holds a finished prepare of other sources or options")
    assert json.loads((out / "stats.json").read_text()) == stats
    replaced = run_cli(*args, "--seed", "1", "--overwrite")
    assert replaced.returncode == 0 and "it was replaced" in " ".join(replaced.stderr.split()), replaced.stderr


def test_data_prepare_reports_bad_input_in_one_line(tmp_path):
    assert_one_line_error(run_cli("data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o")),
                          "missing")
    (tmp_path / "a.txt").write_text("some text " * 20)
    assert_one_line_error(run_cli("data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"),
                                  "--vocab-size", "100"), "257")


def test_train_reports_a_bad_config_in_one_line(stdlib_data, tmp_path):
    result = run_cli("train", "configs/tiny.toml", f"data.path={stdlib_data}", f"run.dir={tmp_path}",
                     "train.micro_batch=3")
    assert_one_line_error(result, "train.global_batch_tokens", "multiple of 192")
    result = run_cli("train", "configs/tiny.toml", f"data.path={tmp_path / 'none'}", fresh=True)  # (likewise)
    assert_one_line_error(result, "data.path", "scaletrain data prepare")
    from scaletrain.config import ConfigError, load_config

    # From another working directory: the config of that name that comes with scaletrain is named.
    with pytest.raises(ConfigError, match=f"the one of that name that comes with scaletrain is "
                                          f"'{ROOT / 'configs' / 'tiny.toml'}'"):
        load_config(tmp_path / "configs" / "tiny.toml")


def test_generate_prints_a_sample_from_the_newest_checkpoint(trained_run):
    result = run_cli("generate", str(trained_run), "--prompt", "def ", "--max-new-tokens", "20")
    assert result.returncode == 0, result.stderr
    sample = result.stdout.split("def ", 1)[1].split("─")[0]  # between the prompt and the closing rule
    assert sample.rstrip("\n") or sample.count("\n") > 1, result.stdout  # something was generated


def test_generate_reports_bad_requests_in_one_line(tmp_path, trained_run, caplog):
    assert_one_line_error(run_cli("generate", str(tmp_path)), "not a run directory")
    # The others in this process (every UserError reaches the command line as the one above did).
    with pytest.raises(UserError, match="temperature must be"):
        generate_text(trained_run, "", temperature=-1)
    # A temperature that float32 holds as 0 is greedy (it divided the largest logit to 0 / 0: NaN).
    assert generate_text(trained_run, "def", temperature=1e-300, max_new_tokens=8) == generate_text(
        trained_run, "def", temperature=0, max_new_tokens=8)
    with pytest.raises(UserError, match="shorten the prompt"):
        generate_text(trained_run, "x = 1\n" * 100)
    with caplog.at_level("WARNING", logger="scaletrain"):  # (the context ends a long request: said, not silent)
        generate_text(trained_run, "x = 1\n" * 10, max_new_tokens=10_000, temperature=0)
    assert "the model's context is 64 tokens (model.max_seq_len) and the prompt takes" in caplog.text
    # A checkpoint given where its run is asked for: the run and --step to give instead.
    with pytest.raises(UserError, match=r"is a checkpoint of the run .*tiny'; give the run directory, with --step 6"):
        generate_text(trained_run / "checkpoints" / "step_0000006", "")


def test_nucleus_sampling_keeps_the_likeliest_tokens_whose_probabilities_reach_p():
    """Of probabilities 0.5, 0.3, 0.15, 0.05, top_p 0.7 keeps the first two (0.5 < 0.7 before the
    second, 0.8 before the third), sampled in proportion 5:3; a tiny p keeps the likeliest alone."""
    from scaletrain.model.sample import _pick

    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log().repeat(20000, 1)
    picked = _pick(logits, 1.0, None, torch.Generator().manual_seed(0), top_p=0.7)
    counts = torch.bincount(picked, minlength=4)
    assert counts[0] == counts[2] == 0 and abs(counts[1] / 20000 - 0.625) < 0.015
    assert (_pick(logits[:5], 1.0, None, torch.Generator().manual_seed(0), top_p=1e-9) == 1).all()
    assert torch.bincount(_pick(logits, 1.0, None, torch.Generator().manual_seed(0), top_p=1.0), minlength=4).min() > 0


def test_generate_samples_several_continuations_from_a_chosen_checkpoint(trained_run):
    texts = generate_text(trained_run, "def ", max_new_tokens=12, temperature=1.0, samples=3, seed=1)
    assert len(texts) == 3 and all(text.startswith("def ") for text in texts) and len(set(texts)) > 1
    # The first of several is the one sampled alone only by chance; greedy ones are all the same.
    assert len(set(generate_text(trained_run, "def ", max_new_tokens=8, temperature=0, samples=2))) == 1
    steps = sorted(int(p.name.split("_")[1]) for p in (trained_run / "checkpoints").glob("step_*"))
    older = generate_text(trained_run, "def ", max_new_tokens=16, temperature=0, step=steps[0])
    assert older == generate_text(trained_run, "def ", max_new_tokens=16, temperature=0, step=steps[0], average=1)
    result = run_cli("generate", str(trained_run), "--prompt", "def ", "--max-new-tokens", "8", "--samples", "2",
                     "--top-p", "0.9", "--step", str(steps[-1]), "--device", "cpu")
    assert result.returncode == 0 and "sample 2 of 2" in result.stdout, result.stderr
    assert_one_line_error(run_cli("generate", str(trained_run), "--step", "999"), "has no checkpoint of step 999")
    refused = run_cli("generate", str(trained_run), "--top-p", "0")  # (argparse's usage, then its one line)
    assert refused.returncode == 2 and "--top-p: '0' must be above 0 and at most 1" in refused.stderr
    if not torch.cuda.is_available():
        assert_one_line_error(run_cli("generate", str(trained_run), "--device", "cuda"), "torch sees no GPU here")


def test_data_seed_draws_the_data_order_apart_from_the_initialisation(stdlib_data, trained_run, tmp_path):
    """data.seed (OLMo's data_seed) seeds the data order, run.seed then only the initialisation;
    unset, run.seed seeds both, as before. A resume refuses another data order, not another
    run.seed that leaves the order as it was."""
    from scaletrain.config import ConfigError, load_config
    from scaletrain.train.trainer import Trainer, check_run_dir, resolve

    def trainer(*overrides):
        return Trainer(tiny_config(stdlib_data, tmp_path / "_".join(overrides).replace(".", "-"), *overrides))

    plain, data_apart, init_apart = trainer("run.seed=3"), trainer("run.seed=3", "data.seed=5"), \
        trainer("run.seed=4", "data.seed=3")
    assert plain.loader.loader.seed == 3 and data_apart.loader.loader.seed == 5 and init_apart.loader.loader.seed == 3
    weights = [dict(t.model.named_parameters())["tok_embeddings.weight"].detach() for t in (plain, data_apart, init_apart)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    resumed = str(trained_run / "config.toml")  # (trained with run.seed 0)
    check_run_dir(resolve(load_config(resumed, ["run.seed=5", "data.seed=0"])))  # (the same order: taken)
    for overrides, message in ((["run.seed=5"], "run.seed 0 then, 5 now"), (["data.seed=2"], "data.seed None then, 2 now")):
        with pytest.raises(ConfigError, match=message):
            check_run_dir(resolve(load_config(resumed, overrides)))


def test_greedy_text_is_the_same_with_and_without_the_kv_cache(trained_run):
    cached = generate_text(trained_run, "import os\n", max_new_tokens=40, temperature=0, use_cache=True)
    uncached = generate_text(trained_run, "import os\n", max_new_tokens=40, temperature=0, use_cache=False)
    assert cached == uncached and len(cached) > len("import os\n")


def test_the_example_stage_config_continues_tiny_at_twice_the_context(stdlib_data, trained_run, tmp_path):
    """configs/tiny-stage.toml as a user runs it after configs/tiny.toml: the first stage's newest
    checkpoint, sequences of 128 under YaRN, the learning rate decaying from the peak to zero."""
    from scaletrain.train.metrics import read_metrics

    result = run_cli("train", "configs/tiny-stage.toml", f"data.path={stdlib_data}", f"run.dir={tmp_path}",
                     f"checkpoint.init_from={trained_run}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    [start] = read_metrics(tmp_path / "tiny-stage", "start")
    assert (start["init_step"], start["init_optimizer"]) == (6, True)
    steps = read_metrics(tmp_path / "tiny-stage", "train")
    assert [r["tokens"] for r in steps][-1] == 10 * 1024
    assert steps[0]["lr"] == pytest.approx(2.7e-3) and steps[-1]["lr"] == 0.0


def test_data_stats_prints_the_summary_and_writes_a_histogram(stdlib_data, tmp_path):
    plot = tmp_path / "lengths.png"
    result = run_cli("data", "stats", str(stdlib_data), "--top", "5", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    for words in ["train: documents / tokens", "p50", "documents read by prepare", "duplicate rate", "top 5 tokens"]:
        assert words in result.stdout, words
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_data_stats_of_an_empty_training_split_prints_the_summary_and_no_histogram(tmp_path, capsys):
    from scaletrain.cli import main
    from scaletrain.data import prepare

    # Two files sharing 30 lines: one held out, the other then dropped for its overlap with it.
    library = Path(sysconfig.get_paths()["stdlib"])
    bisect = (library / "bisect.py").read_text()
    (tmp_path / "a.py").write_text(bisect)
    (tmp_path / "b.py").write_text((library / "colorsys.py").read_text() + "\n".join(bisect.splitlines()[:30]))
    result = prepare([str(tmp_path / "a.py"), str(tmp_path / "b.py")], tmp_path / "data", 300, val_fraction=0.99,
                     workers=1, keep_rejects=True)
    assert result.stats["documents"]["train"] == 0 and result.stats["documents"]["dropped"]["val_overlap"] == 1
    [rejected] = [json.loads(line) for f in (tmp_path / "data" / "rejects" / "val_overlap").glob("*.jsonl")
                  for line in f.read_text().splitlines()]
    assert rejected["source"] in ("a.py", "b.py")  # (the file it came from, as every reject says)
    assert main(["data", "stats", str(tmp_path / "data")]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "train: documents / tokens │ 0 / 0" in printed
    assert "histogram: none, the training split holds no documents" in printed
    assert not (tmp_path / "data" / "lengths.png").exists()


def test_a_time_limit_counts_from_the_start_of_the_torchrun_that_started_the_worker(monkeypatch):
    """launch's workers (no --deadline) count train --time-limit from their torchrun's start,
    which a restarted worker inherits (scaletrain/torchrun.py sets it), not from their own."""
    import argparse

    from scaletrain.cli import _deadline, _duration_text, _wall_seconds
    from scaletrain.torchrun import LAUNCHED
    from scaletrain.train.metrics import process_started

    # scaletrain.torchrun hands its workers its own start (a restarted one the same: it is in the
    # environment torchrun starts each with), keeping one it was itself given.
    import torch.distributed.run as torch_run

    from scaletrain import torchrun
    seen = []
    monkeypatch.setattr(torch_run, "main", lambda argv: seen.append(os.environ.get(LAUNCHED)))
    monkeypatch.delenv(LAUNCHED, raising=False)
    before = time.time()
    assert torchrun.run(["--nproc-per-node=1", "worker.py"]) == (0, None)
    monkeypatch.setenv(LAUNCHED, "7.5")
    torchrun.run(["--nproc-per-node=1", "worker.py"])
    assert before <= float(seen[0]) <= time.time() and seen[1] == "7.5"
    args = argparse.Namespace(deadline=None, time_limit=60.0)
    monkeypatch.setenv(LAUNCHED, "1000.5")
    assert _deadline(args) == 1060.5
    assert _deadline(argparse.Namespace(deadline=5.0, time_limit=60.0)) == 5.0  # (train --nproc's, given)
    monkeypatch.delenv(LAUNCHED)
    assert _deadline(args) == pytest.approx(process_started() + 60)  # (this process's own start)
    assert _deadline(argparse.Namespace(deadline=None, time_limit=None)) is None
    for limit in ("300h", "0.25s", "3h50m"):  # (what launch writes, train reads back: never 1.08e+06s)
        assert _wall_seconds(_duration_text(_wall_seconds(limit))) == _wall_seconds(limit)


def test_launch_writes_a_slurm_script_and_a_k8s_manifest_that_run_the_train_command(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    result = run_cli("launch", "slurm", "configs/llama-1b.toml", "train.lr=1e-4", "--nodes", "4",
                     "--gpus-per-node", "8", "--out", str(script), "--time-limit", "3h50m")
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    for words in ["#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "srun python3 -m scaletrain.torchrun --nnodes=4 --nproc-per-node=8 --max-restarts=3",
                  # a refusal on one node ends the step on every node: the others would wait on it
                  "export SCALETRAIN_END_STEP_ON_REFUSAL=1",
                  # (train's --time-limit: each node's workers count it from their torchrun's start)
                  "--rdzv-backend=c10d", "-m scaletrain.cli train --time-limit=13800s configs/llama-1b.toml train.lr=1e-4",
                  # SIGTERM 180 s before the time limit; torchrun lets the workers save; preempted jobs requeue
                  "#SBATCH --signal=TERM@180", "#SBATCH --requeue", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=170"]:
        assert words in text, words
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0  # valid shell
    # Slurm opens its log before the script runs, so not in the run directory the script makes.
    assert "#SBATCH --output=slurm-llama-1b-%j.out" in text
    # In the directory launch ran in, wherever the script is submitted from (the config's paths
    # are relative to it), with a rendezvous port of the job's own (another job may share a node).
    assert f"#SBATCH --chdir={ROOT}" in text
    assert "port=$((20000 + SLURM_JOB_ID % 20000))" in text and '--rdzv-endpoint="$head":"$port"' in text

    result = run_cli("launch", "k8s", "configs/llama-1b.toml", "--nodes", "2", "--gpus-per-node", "8",
                     "--image", "registry.example/scaletrain:1", "--grace", "600")
    assert result.returncode == 0, result.stderr
    service, job = json.loads(result.stdout)["items"]
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["completions"] == 2 and job["spec"]["completionMode"] == "Indexed"
    assert service["metadata"]["name"] == "llama-1b"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["command"][:6] == ["python3", "-m", "scaletrain.torchrun", "--nnodes=2", "--nproc-per-node=8",
                                        "--max-restarts=3"]
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 600
    assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "590"} in container["env"]
    # /dev/shm in memory (NCCL's shared-memory transport outgrows a container's 64 MiB)
    shm = {"name": "shm", "emptyDir": {"medium": "Memory"}}
    assert job["spec"]["template"]["spec"]["volumes"] == [shm]
    assert container["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}] and "workingDir" not in container
    assert "are lost with it" in " ".join(result.stderr.split())
    assert job["spec"]["backoffLimit"] == 0  # (a replaced pod would have none of the run's checkpoints)
    # A shared claim: every pod works in it, so the config's data and runs/ outlive the pods.
    result = run_cli("launch", "k8s", "configs/llama-1b.toml", "--nodes", "2", "--gpus-per-node", "8",
                     "--volume", "train-work:/mnt/work")
    assert result.returncode == 0 and "are lost with it" not in result.stderr, result.stderr
    job = json.loads(result.stdout)["items"][1]
    # failed pods replaced, each index up to --max-restarts times: they resume from the claim
    assert (job["spec"]["backoffLimitPerIndex"], job["spec"]["maxFailedIndexes"]) == (3, 0)
    assert "backoffLimit" not in job["spec"]
    # but not after a refusal of the run's input (scaletrain.torchrun's status 2), which would be met again
    assert {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "In", "values": [2]}} \
        in job["spec"]["podFailurePolicy"]["rules"]
    pod = job["spec"]["template"]["spec"]
    assert pod["volumes"] == [shm, {"name": "work", "persistentVolumeClaim": {"claimName": "train-work"}}]
    assert pod["containers"][0]["workingDir"] == "/mnt/work"
    assert pod["containers"][0]["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"},
                                                    {"name": "work", "mountPath": "/mnt/work"}]
    from scaletrain.cli import main

    for bad in ("", ":/mnt", "claim:relative", "Bad_Claim:/w", "c:/w:/x"):  # (what Kubernetes would refuse)
        assert main(["launch", "k8s", str(ROOT / "configs" / "llama-1b.toml"), "--nodes", "2", "--gpus-per-node", "8",
                     "--volume", bad]) == 2, bad
        assert "give a PersistentVolumeClaim's name" in " ".join(capsys.readouterr().err.split()), bad
    assert main(["launch", "k8s", str(ROOT / "configs" / "llama-1b.toml"), "--nodes", "2", "--gpus-per-node", "8",
                 "--image", ""]) == 2
    assert "--image is empty; give the container image" in capsys.readouterr().err
    assert main(["launch", "k8s", str(ROOT / "configs" / "llama-1b.toml"), "--nodes", "2", "--gpus-per-node", "8",
                 "--image", "my image"]) == 2
    assert "--image 'my image' holds a space, which no image name does; give the" in capsys.readouterr().err


def test_k8s_names_are_dns_labels_whatever_the_run_name():
    from scaletrain.config import load_config
    from scaletrain.launch import k8s_manifest

    for run_name, expected in [("1b", "run-1b"), ("My_Run.v2", "my-run-v2"), ("x" * 80, "x" * 56),
                               ("Weird Name_ü", "weird-name")]:
        cfg = load_config(ROOT / "configs" / "llama-1b.toml", [f"run.name={run_name}"])
        service, job = json.loads(k8s_manifest(cfg, "configs/llama-1b.toml", [], 2, 8, "image:1"))["items"]
        assert service["metadata"]["name"] == job["metadata"]["name"] == expected


def test_a_run_directory_another_run_trains_in_is_refused_and_left_as_it_was(stdlib_data, trained_run, tmp_path):
    """Launched twice (or requeued while the first still runs), a run would resume from the
    other's checkpoints and both would write them: the second is refused while the first holds
    the directory (its lock, here held as a running run holds it), and goes on once it is free."""
    from scaletrain.train import checkpoint

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    args = ["train", "configs/tiny.toml", f"data.path={stdlib_data}", f"run.dir={tmp_path}", "run.name=run",
            "eval.interval=0", "train.steps=7"]
    lock, held = checkpoint.hold_run_dir(run_dir)
    assert lock is not None and held is None
    (run_dir / ".lock").write_text("")  # (what the fixture's run wrote there: not this test's holder)
    checkpoint.sign_run_dir(lock)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    try:
        assert_one_line_error(run_cli(*args), f"run directory '{run_dir}' is in use by another run (process "
                                              f"{os.getpid()} on ", "wait for it to end, or choose another run.name")
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    finally:
        checkpoint.release_run_dir(lock)
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    # Under a scheduler or a restart (the process it replaces may not have ended yet) it waits, and
    # is refused then as what may pass (torchrun starts it again, to wait again), not for good.
    from scaletrain.config import ConfigError
    from scaletrain.train import trainer

    lock, _ = checkpoint.hold_run_dir(run_dir)
    with pytest.MonkeyPatch.context() as patched:
        patched.setenv("SLURM_JOB_ID", "7")
        patched.setattr(trainer, "RUN_DIR_WAIT_S", 0.5)
        started = time.monotonic()
        with pytest.raises(ConfigError, match="is in use by another run") as refused:
            trainer.Trainer(tiny_config(stdlib_data, run_dir, "eval.interval=0", "train.steps=8")).fit()
        assert isinstance(refused.value.__cause__, TimeoutError) and time.monotonic() - started >= 0.5
    with pytest.raises(ConfigError, match="is in use by another run") as refused:  # (no scheduler: at once, for good)
        trainer.Trainer(tiny_config(stdlib_data, run_dir, "eval.interval=0", "train.steps=8")).fit()
    assert refused.value.__cause__ is None
    assert checkpoint.hold_run_dir(run_dir, wait_s=0.5)[0] is None
    threading.Timer(1.0, checkpoint.release_run_dir, [lock]).start()
    waited, held = checkpoint.hold_run_dir(run_dir, wait_s=60)
    assert waited is not None and held is None
    checkpoint.release_run_dir(waited)


def test_launch_refuses_a_batch_that_does_not_split_over_its_ranks():
    from scaletrain.config import ConfigError, load_config
    from scaletrain.launch import slurm_script

    cfg = load_config(ROOT / "configs" / "llama-1b.toml", ["train.micro_batch=1"])
    small = cfg.model_copy(update={"train": cfg.train.model_copy(update={"global_batch_tokens": 8 * cfg.data.seq_len})})
    with pytest.raises(ConfigError, match="do not split into 16 data-parallel ranks"):
        slurm_script(small, "configs/llama-1b.toml", [], 2, 8)
    # Where the ranks take whole sequences, a smaller micro-batch is the change that keeps the batch.
    wider = cfg.model_copy(update={"train": cfg.train.model_copy(update={"global_batch_tokens": 96 * cfg.data.seq_len,
                                                                          "micro_batch": 4})})
    with pytest.raises(ConfigError, match=r"96 sequences, which do not split into 16 data-parallel ranks x "
                                          r"train.micro_batch = 4; use a multiple of \d+ tokens, or train.micro_batch = 3 "
                                          r"\(the same batch, each rank's 6 sequences in micro-batches of 3\)"):
        slurm_script(wider, "configs/llama-1b.toml", [], 2, 8)
    # (and none where the ranks cannot take whole sequences: no micro-batch keeps that batch)
    uneven = cfg.model_copy(update={"train": cfg.train.model_copy(update={"global_batch_tokens": 24 * cfg.data.seq_len,
                                                                           "micro_batch": 4})})
    with pytest.raises(ConfigError, match=r"24 sequences, .* use a multiple of \d+ tokens$"):
        slurm_script(uneven, "configs/llama-1b.toml", [], 2, 8)
    assert "srun python3 -m scaletrain.torchrun" in slurm_script(cfg, "configs/llama-1b.toml", [], 2, 8)


def test_launch_refuses_a_layout_the_processes_do_not_fit(tmp_path):
    result = run_cli("launch", "slurm", "configs/llama-1b.toml", "parallel.dp_replicate=3", "--nodes", "2",
                     "--gpus-per-node", "8")
    assert_one_line_error(result, "dp_replicate x cp x tp = 1 x 3 x 1 x 1 = 3 does not divide the 16 processes")


def test_launch_refuses_a_grace_too_short_to_save_and_negative_restarts():
    from scaletrain.config import ConfigError, load_config
    from scaletrain.launch import k8s_manifest, slurm_script

    cfg = load_config(ROOT / "configs" / "llama-1b.toml")
    with pytest.raises(ConfigError, match="--grace 5 s leaves no time to save; give at least 20 seconds"):
        slurm_script(cfg, "configs/llama-1b.toml", [], 2, 8, grace_s=5)
    with pytest.raises(ConfigError, match="--grace 0 s"):
        k8s_manifest(cfg, "configs/llama-1b.toml", [], 2, 8, "image:1", grace_s=0)
    with pytest.raises(ConfigError, match="--max-restarts -1 must be ≥ 0"):
        k8s_manifest(cfg, "configs/llama-1b.toml", [], 2, 8, "image:1", max_restarts=-1)


def test_bad_paths_names_and_values_are_said_in_one_sentence(stdlib_data, tmp_path, capsys):
    """An output path that is a file (or a directory where a file is written), a run name that
    would leave run.dir, a value in a CSV that is not a number, records without the text field: a
    sentence naming what is wrong, no traceback; brackets in a value are printed as given (not
    taken for markup); tune refuses its --write-config before training, not after."""
    from scaletrain.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "bad.csv").write_text("n,c,loss\n1e6,1e12,3.0\n2e6,abc,3.1\n")
    (tmp_path / "nofield.jsonl").write_text('{"body": "some text"}\n')
    tiny = str(ROOT / "configs" / "tiny.toml")
    (tmp_path / "utf16.toml").write_bytes("[train]\n".encode("utf-16"))
    for damaged, file, text in (("tokenizer", "tokenizer.json", "garbage"), ("stats", "stats.json", '{"documents": 5}')):
        shutil.copytree(stdlib_data, tmp_path / damaged, ignore=shutil.ignore_patterns("shards"))
        (tmp_path / damaged / "shards").symlink_to(stdlib_data / "shards")
        (tmp_path / damaged / file).write_text(text)
    cases = [
        (["sweep", "--data", str(stdlib_data), "--budgets", "1e12", "--out", str(afile)],
         f"--out {str(afile)!r} is a file; give a directory for the sweep"),
        (["train", tiny, f"data.path={stdlib_data}", f"run.dir={afile}", "train.steps=1"], "is a file, or lies under one"),
        (["train", tiny, f"data.path={stdlib_data}[bold]v2"], f"{stdlib_data}[bold]v2' does not exist"),
        (["train", tiny, f"data.path={stdlib_data}", "run.name=../escape"], "must name one folder inside run.dir"),
        (["fit", "--points", str(tmp_path / "bad.csv")], "bad.csv' line 3, column c: 'abc' is not a number"),
        (["data", "prepare", str(tmp_path / "nofield.jsonl"), "--out", str(tmp_path / "o"), "--vocab-size", "300"],
         "name the field that holds the text with --text-field"),
        (["tune", tiny, f"data.path={stdlib_data}", "model.mup_base_dim=32", "--out", str(tmp_path / "tune"),
          "--write-config", str(tmp_path)], f"--write-config {str(tmp_path)!r} is a directory"),
        (["demo", "--out", str(tmp_path / "demo"), "--minutes", "-1"],
         "--minutes -1: give the minutes the demo may take"),
        (["train", str(tmp_path / "utf16.toml")], "utf16.toml' is not UTF-8 text, as TOML is (invalid start byte at byte 0)"),
        (["data", "stats", str(tmp_path / "tokenizer")], "tokenizer.json is not a Hugging Face tokenizer.json"),
        (["data", "stats", str(tmp_path / "stats")], "stats.json is not the stats.json `data prepare` writes"),
    ]
    import torch

    if not torch.cuda.is_available():  # (refused before its 400 MB of data are prepared)
        cases.append((["demo", "--device", "cuda", "--out", str(tmp_path / "demo")], "no CUDA device is visible here"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "tune").exists() and not (tmp_path / "demo").exists()  # (refused before any work)


def test_a_run_directory_given_as_config_and_a_resume_past_the_runs_steps_are_refused(trained_run, tmp_path,
                                                                                      capsys):
    """A run directory where a config is asked for points to its config.toml; a run whose newest
    checkpoint (step 6) lies past train.steps = 3 is refused, its config left as it was; a run
    directory given as the checkpoint to resume, and a directory as compare's plot, are refused."""
    from scaletrain.cli import main

    assert main(["train", str(trained_run)]) == 2
    assert f"is a directory; pass its config.toml ({str(trained_run / 'config.toml')!r})" in capsys.readouterr().err
    before = (trained_run / "config.toml").read_text()
    assert main(["train", str(trained_run / "config.toml"), "train.steps=3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "step_0000006 is at step 6, past the run's 3 steps" in err and "Traceback" not in err
    assert (trained_run / "config.toml").read_text() == before
    # A directory that is no checkpoint given to resume from; a plot's path that is a directory.
    assert main(["train", str(trained_run / "config.toml"), f"run.dir={tmp_path}",
                 f"checkpoint.resume={trained_run}"]) == 2
    assert "is not a checkpoint directory (a run directory: its newest is resumed with 'auto')" in " ".join(
        capsys.readouterr().err.split())
    assert main(["compare", str(trained_run), str(trained_run), "--out", str(tmp_path)]) == 2
    assert f"--out {str(tmp_path)!r} is a directory" in capsys.readouterr().err


def test_what_other_commands_wrote_is_not_written_over(trained_run, stdlib_data, tmp_path, capsys):
    """An output directory that holds another command's output (a sweep into a run, data into a
    sweep) and an output file that is a directory's own (a sweep's results.csv, a run's
    metrics.jsonl) are refused before any work, and what was there is unchanged; so is an image
    format Matplotlib cannot write, and a refused resume leaves no run directory behind."""
    from scaletrain.cli import main
    from scaletrain.outputs import kind_of

    sweep = tmp_path / "sweep"
    (sweep / "points").mkdir(parents=True)
    (sweep / "grid.json").write_text(json.dumps({"settings": {"budgets": [1e12]}}))
    (sweep / "results.csv").write_text("name,n,c,loss\n")
    search = tmp_path / "search"
    search.mkdir()
    (search / "grid.json").write_text(json.dumps({"settings": {"lr_factors": [1.0]}}))
    other = tmp_path / "other"  # (a grid.json of other contents: not a sweep's, nothing to refuse)
    other.mkdir()
    (other / "grid.json").write_text(json.dumps({"rows": 3}))
    for name in ("notes.toml", "job.sh", "mine.plan.json"):  # a user's files, which no command may replace
        (other / name).write_text("precious\n# written by scaletrain plan\n")
    # (a job script of the user's own, as the README shows: it runs scaletrain's torchrun too)
    (other / "multi.sh").write_text("#!/bin/bash\n#SBATCH --account=mine\nsrun python3 -m scaletrain.torchrun x\n")
    assert [kind_of(p) for p in (trained_run, stdlib_data, sweep, search, other, tmp_path)] == [
        "run directory", "prepared data directory", "sweep", "hyperparameter search", None, None]
    kept = {p: p.read_bytes() for d in (trained_run, sweep, stdlib_data, other) for p in d.iterdir() if p.is_file()}
    tiny = str(ROOT / "configs" / "tiny.toml")
    cases = [
        (["eval", str(sweep), "--out", str(sweep / "results.csv")], "is a file of the sweep"),
        (["eval", str(trained_run), "--out", str(trained_run / "metrics.jsonl")], "is a file of the run directory"),
        (["sweep", "--data", str(stdlib_data), "--budgets", "1e10", "--out", str(trained_run)],
         "is a run directory, not a sweep; give a new directory for the sweep"),
        (["hparams", "--data", str(stdlib_data), "--budgets", "1e10,2e10", "--out", str(sweep)],
         "is a sweep, not a hyperparameter search"),
        (["sweep", "--data", str(stdlib_data), "--budgets", "1e10", "--out", str(search)],
         "is a hyperparameter search, not a sweep"),
        (["tune", tiny, f"data.path={stdlib_data}", "model.mup_base_dim=32", "--out", str(sweep)],
         "is a sweep, not a tuning directory"),
        (["demo", "--out", str(stdlib_data)], "is a prepared data directory, not a demo directory"),
        (["data", "prepare", "builtin:python-stdlib", "--out", str(trained_run), "--max-bytes", "10k"],
         "is a run directory; give a new directory to prepare the data into"),
        (["data", "stats", str(stdlib_data), "--plot", str(tmp_path / "lengths.txt")],
         "a .txt file cannot be written here; give a name ending in one of"),
        (["compare", str(trained_run), str(trained_run), "--out", str(tmp_path / "runs.csv")], "a .csv file cannot"),
        (["compare", str(trained_run), str(sweep), "--out", str(trained_run / "loss.png")],
         "is a file of the run directory"),  # (report's plot)
        (["compare", str(trained_run), str(sweep), "--out", str(sweep / "isoflop.png")], "is a file of the sweep"),
        (["train", tiny, f"data.path={stdlib_data}", f"run.dir={tmp_path}", "run.name=fresh",
          f"checkpoint.resume={tmp_path / 'nowhere'}"], "is not a directory; give a checkpoint directory"),
        # training into another command's directory, a run's own config, the config read, a sweep's
        # law replaced by a fit of other points, a file of another kind
        (["train", tiny, f"data.path={stdlib_data}", f"run.dir={tmp_path}", "run.name=sweep"],
         "(run.dir/run.name) is a sweep, which training would write into; choose another run.name or run.dir"),
        (["train", tiny, f"data.path={stdlib_data}", f"run.dir={stdlib_data.parent}", f"run.name={stdlib_data.name}"],
         "is a prepared data directory, which training would write into"),
        (["plan", "--compute", "1e21", "--write-config", str(trained_run / "config.toml")],
         "is a file of the run directory"),
        (["plan", tiny, "--vocab", "512", "--write-config", tiny], "is the config given, which it would write over"),
        # a file of the user's, where plan, tune or launch would write (their own earlier output they replace)
        (["plan", "--compute", "1e21", "--write-config", str(other / "notes.toml")],
         "exists and was not written by scaletrain plan, which would replace it; give a new file name, or remove it"),
        (["plan", "--compute", "1e21", "--write-config", str(other / "mine.toml")],
         "writes its plan to", "which exists without the config it was planned with"),
        (["launch", "slurm", tiny, "--nodes", "1", "--gpus-per-node", "1", "--out", str(other / "multi.sh")],
         "exists and was not written by scaletrain launch"),
        (["launch", "slurm", tiny, "--nodes", "1", "--gpus-per-node", "1", "--out", str(other / "job.sh")],
         "exists and was not written by scaletrain launch"),
        (["tune", tiny, f"data.path={stdlib_data}", "model.mup_base_dim=32", "--out", str(other / "tune"),
          "--write-config", str(other / "notes.toml")], "exists and was not written by scaletrain tune"),
        (["fit", "--points", str(sweep / "results.csv")], "is a sweep, whose own law.json a fit of these points"),
        (["fit", str(sweep), "--out", str(trained_run)], "is a run directory; give --out a directory of its own"),
        (["eval", str(trained_run), "--out", str(tmp_path / "evals.toml")], "a .toml file cannot be written here"),
        (["launch", "slurm", tiny, "--nodes", "1", "--gpus-per-node", "1", "--out", str(tmp_path / "job.toml")],
         "a .toml file cannot be written here; give a name ending in one of .sh, .sbatch, .slurm"),
        # a run resumed with another shape on two processes: one line before torchrun, not one a rank
        (["train", str(trained_run / "config.toml"), "model.dim=128", "--nproc", "2"],
         "holds checkpoints of a different run (model.dim 64 then, 128 now"),
        # another batch would count steps the run did not train (its schedule, its end)
        (["train", str(trained_run / "config.toml"), "train.global_batch_tokens=1024"],
         "tokens in its 6 steps, which this config's batch (train.global_batch_tokens, train.batch_ramp) counts as"),
    ]
    for argv, *messages in cases:
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert all(message in err for message in messages) and "Traceback" not in err, (argv, err)
    assert {p: p.read_bytes() for p in kept} == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "search", "sweep"]
    # plan and launch replace their own earlier output (plan its plan beside it too), not once changed
    planned, job = other / "planned.toml", other / "planned.sh"
    for _ in range(2):
        assert main(["plan", "--compute", "1e21", "--write-config", str(planned)]) == 0
        assert main(["launch", "slurm", tiny, "--nodes", "1", "--gpus-per-node", "1", "--out", str(job)]) == 0
    assert planned.read_text().startswith("# written by scaletrain plan") and (other / "planned.plan.json").is_file()
    planned.write_text(planned.read_text().replace("[train]", "[train]\n# mine"))
    assert main(["plan", "--compute", "1e21", "--write-config", str(planned)]) == 2
    assert "was written by scaletrain plan and changed since" in " ".join(capsys.readouterr().err.split())
    assert "# mine" in planned.read_text()


def test_argument_errors_name_what_is_wrong_alone(capsys):
    """A command without its config says the config is missing (its overrides are optional); an
    unknown option among overrides is named alone, by the command's own usage."""
    from scaletrain.cli import main

    tiny = str(ROOT / "configs" / "tiny.toml")
    for argv, missing in ((["train"], "config"), (["eval"], "RUN_OR_MODEL_DIR"),
                          (["cooldown"], "run_dir, --step, --steps"), (["tune"], "config"),
                          (["launch", "slurm"], "config, --nodes, --gpus-per-node")):
        with pytest.raises(SystemExit):
            main(argv)
        err = " ".join(capsys.readouterr().err.split())
        assert err.endswith(f"the following arguments are required: {missing}"), err
    with pytest.raises(SystemExit):
        main(["train", tiny, "train.steps=2", "--bogus", "train.lr=1e-3"])
    err = " ".join(capsys.readouterr().err.split())
    assert err.endswith("scaletrain train: error: unrecognized arguments: --bogus"), err
    with pytest.raises(SystemExit):  # (a command of a group: by its own parser too)
        main(["data", "prepare", "builtin:python-stdlib", "--out", "nowhere", "--bogus"])
    err = " ".join(capsys.readouterr().err.split())
    assert err.endswith("scaletrain data prepare: error: unrecognized arguments: --bogus"), err


def test_values_out_of_range_are_refused_before_any_work(trained_run, stdlib_data, tmp_path, capsys):
    """Numbers no command can use (negative ones written any way argparse reads, a temperature
    that is not a number, a vocabulary beyond a tokenizer's ids, true for a number, a plan with
    no time for a model, more workers than the cores feed), options that contradict each other
    and a data path that is a file: each one sentence, nothing written."""
    from scaletrain.cli import main

    tiny = str(ROOT / "configs" / "tiny.toml")
    cases = [
        (["demo", "--out", str(tmp_path / "demo"), "--minutes", "-1e3"], "--minutes -1000: give the minutes"),
        (["fit", str(tmp_path), "--drop-highest", "-1"], "argument --drop-highest: '-1' must be 0 or more"),
        (["train", tiny, "--time-limit", "-5m"], "argument --time-limit: '-5m' is not a length of time"),  # (a unit)
        (["tune", tiny, "model.mup_base_dim=32", "--lrs", "0.001,0.01,0.001"],
         "argument --lrs: 0.001 is given twice in --lrs; give each once"),
        (["generate", str(trained_run), "--prompt", "def", "--temperature", "nan"],
         "argument --temperature: 'nan' must be 0 (greedy) or more, and finite"),
        (["generate", str(trained_run), "--seed", "99999999999999999999"],
         "argument --seed: '99999999999999999999' must be from 0 to 2^63 - 1"),
        (["data", "prepare", "builtin:python-stdlib", "--out", str(tmp_path / "d"), "--vocab-size", "10000000000"],
         "vocab_size 10,000,000,000 is beyond what a tokenizer is trained to"),
        (["data", "prepare", "builtin:python-stdlib", "--out", str(tmp_path / "d"), "--vocab-size", "600",
          "--tokenizer", str(stdlib_data)], "with --tokenizer the given one's vocabulary is used: drop one of them"),
        (["train", tiny, f"data.path={stdlib_data}", "model.dim=true"],
         "model.dim = true: this key takes a whole number, not true or false"),
        (["train", tiny, f"data.path={stdlib_data / 'index.json'}"],
         f"is a file, not a prepared data directory; give its folder {str(stdlib_data)!r}"),
        (["train", tiny, f"data.path={stdlib_data}", f"run.dir={tmp_path}", "model.dim=1048576", "model.n_heads=4"],
         "parameters take"),
        (["plan", "--hours", "1e-7"], "no model the law sizes finishes in 1e-07 hours"),
        (["plan", "--compute", "1e20", "--unique-tokens", "1e5"], "--unique-tokens 1e+05 are too few for --compute 1e+20"),
        (["plan", "--compute", "1e20", "--unique-tokens", "1"], "1 unique tokens are too few for 1e+20 FLOPs: repeated"),
        (["sweep", "--data", str(stdlib_data), "--budgets", "1e10", "--concurrency", str(4 * (os.cpu_count() or 1) + 1),
          "--out", str(tmp_path / "s")], "each worker process needs a share of this machine's"),
        (["sweep", "--data", str(stdlib_data), "--budgets", "1e25", "--predict-time"],
         "days even at the 4e+10 FLOP/s peak of cpu" if os.cpu_count() == 2 else "days even at the"),
        (["mixture", "--data", str(tmp_path), "--budget", "1e10", "--runs", "0"], "--runs 0: give the number of"),
        (["hparams", "--data", str(stdlib_data), "--budgets", "1e10,2e10", "--check", "1e9", "--out", str(tmp_path / "h")],
         "--check 1e+09: check the law beyond the budgets it is measured at"),
        (["launch", "slurm", tiny, "--nodes", "1", "--gpus-per-node", "1", "--image", "my:image"],
         "--image and --volume describe the containers of a Kubernetes job"),
        # A value given twice, or empty where empty would be taken for none given (the default
        # directory, or the current one, written into): refused, not silently collapsed.
        (["sweep", "--data", str(stdlib_data), "--budgets", "1e12,1e12"],
         "argument --budgets: 1e+12 is given twice in --budgets; give each once"),
        (["sweep", "--data", str(stdlib_data), "--budgets", "1e12", "--mix", "a=1,a=2"],
         "argument --mix: a is given twice in the weights; give each once"),
        (["data", "prepare", "builtin:python-stdlib", "--out", ""],
         "argument --out: is empty; give the path of a directory"),
        (["export", str(trained_run), "--out", " "], "argument --out: is empty; give the path of a directory"),
        (["cooldown", str(trained_run), "--step", "3", "--steps", "2", "--name", ""],
         "argument --name: is empty; give a run name"),
        (["tune", tiny, "model.mup_base_dim=32", "--lrs", "0.01"],
         "argument --lrs: gives one; give two or more learning rates to choose between"),
        (["demo", "--out", str(tmp_path / "demo"), "--minutes", "0.001"],
         "--minutes 0.001 leaves nothing beyond the 30 s kept for the fit and the report"),
        # A run, data or a file given where a sweep's directory is asked for: named as what it is.
        (["fit", str(trained_run)], f"{str(trained_run)!r} is a run directory, not a sweep directory; give a sweep's"),
        (["fit", str(stdlib_data / "index.json")], "is a file, not a sweep directory; give a sweep's directory, or a "
                                                   "CSV of points as --points"),
    ]
    (tmp_path / "binary.csv").write_bytes(b"\xff\xfen,c,loss\n")
    cases.append((["fit", "--points", str(tmp_path / "binary.csv")], "binary.csv' is not UTF-8 text; give a CSV"))
    for argv, message in cases:
        with pytest.raises(SystemExit) if "argument" in message or "worker process" in message else nullcontext():
            assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert message in err and "Traceback" not in err, (argv, err)
    assert [p.name for p in tmp_path.iterdir()] == ["binary.csv"]


def test_what_the_probe_found_is_named_in_one_sentence(trained_run, mixture_root, stdlib_data, tmp_path, capsys):
    """A points row shorter than its header, an export onto a file or of a run without its
    tokenizer, a missing target domain and --stop-at-step past a run's end: each said as what it is."""
    from scaletrain.cli import main

    (tmp_path / "short.csv").write_text("n,c,loss\n1e6,1e15\n2e6,2e15,3\n")
    (tmp_path / "few.csv").write_text("n,c,loss\n1e6,1e15,3\n2e6,2e15,2.9\n3e6,3e15,2.8\n")
    (tmp_path / "afile").write_text("mine")
    untokenized = tmp_path / "run"
    shutil.copytree(trained_run, untokenized)
    (untokenized / "tokenizer.json").unlink()
    edited = tmp_path / "edited"  # (config.toml's model no longer the checkpoints')
    shutil.copytree(trained_run, edited)
    config = (edited / "config.toml").read_text()
    assert config.count("dim = 64\n") == 1
    (edited / "config.toml").write_text(config.replace("dim = 64\n", "dim = 128\n"))
    cases = [
        (["generate", str(edited)], f"the newest checkpoint of {str(edited)!r} holds another model: its "
                                    "tok_embeddings.weight is 512x64, this model's 512x128"),
        (["export", str(edited), "--out", str(tmp_path / "hf"), "--step", "6"],
         "must be the one its checkpoints hold"),
        (["eval", str(edited)], f"checkpoint {str(edited / 'checkpoints' / 'step_0000006')!r} holds another model: "
                                "its tok_embeddings.weight is 512x64, this model's 512x128"),
        (["export", str(untokenized), "--out", str(tmp_path / "hf")], "has no tokenizer.json (training copies it "
                                                                      "there from its data, "),
        (["compare", str(trained_run), "--out", ""], "--out is empty; give the path of a file to write"),
        (["compare", str(trained_run), str(trained_run) + "/", "--out", str(tmp_path / "c.png")],
         f"{trained_run} is given twice in the run directories; give each once"),
        (["data", "stats", str(stdlib_data), "--plot", " "], "--plot is empty; give the path of a file to write"),
        (["eval", str(trained_run), "--out", str(tmp_path / "results")],
         "a file whose name has no suffix cannot be written here; give a name ending in one of .jsonl, .json"),
        (["fit", "--points", str(tmp_path / "short.csv")], "line 2 has fewer values than the header's 3 columns "
                                                          "(none for loss)"),
        (["export", str(trained_run), "--out", str(tmp_path / "afile")], "is a file; give the path of a new directory"),
        (["fit", "--points", str(tmp_path / "few.csv"), "--drop-highest", "3", "--out", str(tmp_path / "law")],
         "--drop-highest 3 leaves none of the 3 points"),
        (["generate", str(untokenized)], f"the run {str(untokenized)!r} has no tokenizer.json; copy its data "
                                         "directory's tokenizer.json into it"),
        (["report", str(trained_run), "--plan", str(tmp_path / "nope.plan.json")],
         "does not exist; give the .plan.json that `scaletrain plan --write-config` wrote beside the config"),
        (["plan", "--compute", "1e21", "--law", str(stdlib_data / "index.json")],
         "is not a law.json written by `scaletrain fit` (it has no 'approach3')"),
        (["mixture", "--data", str(mixture_root), "--budget", "1e10", "--target-data", str(tmp_path / "nope"),
          "--out", str(tmp_path / "m")], f"--target-data {str(tmp_path / 'nope')!r}: data directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert message in err and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "edited", "few.csv", "run", "short.csv"]
    assert (tmp_path / "afile").read_text() == "mine"
    # (said before the config's data is even looked at: here there is none, and nothing trains)
    assert main(["train", str(ROOT / "configs" / "tiny.toml"), f"data.path={tmp_path / 'none'}", f"run.dir={tmp_path}",
                 "--stop-at-step", "1000"]) == 2
    assert "--stop-at-step 1000 is not before the run's last step (20): it trains to its end" in " ".join(
        capsys.readouterr().err.split())


def test_a_search_directory_damaged_since_is_refused_in_one_line(stdlib_data, tmp_path, capsys):
    """A sweep's grid.json, a tuning's tune.json or a results.csv row edited or cut short since
    the command wrote them: one line naming the file (and line), and the files left as they are."""
    from scaletrain.cli import main

    sweep, tuning, rows = tmp_path / "sweep", tmp_path / "tune", tmp_path / "rows"
    for directory, name, text in ((sweep, "grid.json", '{"settings": {"budgets": [1e10, 3e10'), (tuning, "tune.json", "{")):
        directory.mkdir()
        (directory / name).write_text(text)
    tiny = str(ROOT / "configs" / "tiny.toml")
    sweep_args = ["--data", str(stdlib_data), "--budgets", "1e10,3e10", "--seq-len", "64", "--min-steps", "20"]
    cases = [
        (["sweep", *sweep_args, "--out", str(sweep)], f"{str(sweep / 'grid.json')!r} is damaged (not the JSON"),
        (["tune", tiny, f"data.path={stdlib_data}", "model.mup_base_dim=32", "--out", str(tuning)],
         f"{str(tuning / 'tune.json')!r} is damaged (not the JSON scaletrain wrote there); give another --out"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert message in err and "Traceback" not in err, (argv, err)
    assert (tuning / "tune.json").read_text() == "{" and sorted(p.name for p in sweep.iterdir()) == ["grid.json"]
    from scaletrain.outputs import read_rows

    rows.mkdir()
    (rows / "results.csv").write_text("name,lr,val_loss\na,0.01,3.5\nb,0.02,\n")
    with pytest.raises(UserError, match="results.csv' line 3 is damaged"):
        read_rows(rows / "results.csv", ("name",))
    assert read_rows(rows / "results.csv", ("name", "val_loss"))[1] == {"name": "b", "lr": 0.02, "val_loss": ""}


def test_overrides_may_follow_an_option_of_several_values():
    """`eval RUN --tasks A.jsonl eval.tokens=512`: the override is an override, not a task file."""
    from scaletrain.cli import parse_args

    args = parse_args(["eval", "runs/a", "train.device=cpu", "--tasks", "a.jsonl", "dir/b=c.jsonl", "eval.tokens=512",
                       "--step", "4", "data.seq_len=32"])
    assert args.tasks == ["a.jsonl", "dir/b=c.jsonl"] and args.step == [4]
    assert args.overrides == ["train.device=cpu", "eval.tokens=512", "data.seq_len=32"]
    assert parse_args(["eval", "runs/a", "--tasks"]).tasks == []


def test_version_names_scaletrain_and_what_it_runs_on(capsys):
    from importlib.metadata import version

    import torch

    from scaletrain.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"scaletrain {version('scaletrain')} (torch {torch.__version__}, Python ")


def test_a_worker_hands_a_lasting_refusal_to_the_command_that_started_torchrun(tmp_path, monkeypatch, capsys):
    """Under `train --nproc` (scaletrain.torchrun.run sets the file): a refusal the same input would
    meet again goes to the file and the worker waits to be stopped, without failing (no restart);
    one that may not happen again (an error raised from another, an errno trying again may mend)
    fails the worker as before, for torchrun to restart; with the file's folder gone, it is said
    here. A command line argparse refuses is handed over too."""
    import errno

    from scaletrain.cli import _refused, main
    from scaletrain.torchrun import REFUSAL_FILE

    refusal = tmp_path / "refusal"
    monkeypatch.setenv(REFUSAL_FILE, str(refusal))
    monkeypatch.setattr("scaletrain.torchrun.REFUSAL_WAIT_S", 0.3)  # (nothing here stops this process)
    assert _refused("a passing trouble", lasting=False) == 2 and not refusal.exists()
    assert "a passing trouble" in capsys.readouterr().err
    started = time.monotonic()
    assert _refused("the input is bad") == 0 and refusal.read_text() == "the input is bad"
    assert time.monotonic() - started >= 0.3  # it waited to be stopped
    assert capsys.readouterr().err == "" and sorted(p.name for p in tmp_path.iterdir()) == ["refusal"]
    monkeypatch.setenv(REFUSAL_FILE, str(tmp_path / "gone" / "refusal"))
    assert _refused("said here") == 2 and "said here" in capsys.readouterr().err
    # Through main: a data directory that is not there lasts; a full disk may not.
    monkeypatch.setenv(REFUSAL_FILE, str(refusal))
    refusal.unlink()
    assert main(["data", "stats", str(tmp_path / "nowhere")]) == 0 and "does not exist" in refusal.read_text()
    refusal.unlink()
    assert main(["data", "stats", "--no-such-option"]) == 0 and "command line was refused" in refusal.read_text()
    assert "the following arguments are required: data_dir" in capsys.readouterr().err
    refusal.unlink()

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    monkeypatch.setattr("scaletrain.cli.cmd_data_stats", full)
    assert main(["data", "stats", str(tmp_path / "nowhere")]) == 2 and not refusal.exists()
    assert "No space left on device" in capsys.readouterr().err


def test_eval_out_is_replaced_only_by_an_eval_that_measured_something(trained_run, tmp_path, capsys):
    """`eval --out FILE`: a refusal leaves FILE as it was (it was emptied first) and makes no folder;
    a task file read, or a file that is not an eval's output, is not written over."""
    from scaletrain.cli import main

    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(json.dumps({"step": 4, "checkpoint": "x", "loss": 5.0}) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a document"}\n')
    cases = [
        (["--step", "999", "--out", str(earlier)], "no complete checkpoint of step 999"),
        (["--step", "999", "--out", str(tmp_path / "new" / "sub" / "x.jsonl")], "no complete checkpoint of step 999"),
        (["--tasks", str(corpus), "--out", str(corpus)], "is one of the --tasks files; give the results another name"),
        (["--out", str(corpus)], "exists and is not the output of an eval (a JSON line per checkpoint)"),
    ]
    for argv, message in cases:
        assert main(["eval", str(trained_run), *argv]) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert message in err and "Traceback" not in err, (argv, err)
    assert json.loads(earlier.read_text())["loss"] == 5.0 and corpus.read_text() == '{"text": "a document"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "earlier.jsonl"]
    # (an earlier eval's: replaced; a step given twice evaluated once)
    assert main(["eval", str(trained_run), "--step", "6", "--step", "6", "--out", str(earlier)]) == 0
    [record] = [json.loads(line) for line in earlier.read_text().splitlines()]
    assert record["checkpoint"] != "x" and record["loss"] > 0
