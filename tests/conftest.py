"""Shared fixtures: a small real corpus (the interpreter's own standard library), prepared once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path

import pytest

from scaletrain.config import load_config
from zygote import run_cli, run_ranks  # noqa: F401 (run_cli: the tests' way to run a command)

ROOT = Path(__file__).resolve().parents[1]

# `make test` runs the test files in worker processes (pytest-xdist, --dist loadfile: a file's
# module fixtures are made once, on one worker). The suite's tiny models gain nothing from a
# second torch thread, and its imports, subprocesses and SciPy fits use one core each: on this
# project's 2-core machine two workers of one thread each ran the suite in 19.6 min where one
# process of two threads took 32.8 (2026-12-05). Each worker's torch, and every process it
# starts, get an equal share of the cores (unless OMP_NUM_THREADS says otherwise).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if WORKERS:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))

# The test files that take longest, longest first (one process, 2026-12-05): the workers are
# handed them first (with `--no-loadscope-reorder`), so that none is left with a long file to
# run alone at the end while the other idles.
SLOWEST_FILES = ["test_distributed.py", "test_sweep.py", "test_mixture.py", "test_hparams.py", "test_train.py",
                 "test_benchmarks.py", "test_hf.py", "test_moe.py", "test_cooldown.py", "test_report.py",
                 "test_cli.py", "test_evaluate.py", "test_scaling.py", "test_tune.py", "test_mup.py", "test_plan.py"]


def pytest_configure(config):
    if WORKERS:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's own order kept


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """~400 kB of real Python source, tokenized with a 512-entry BPE, 5% held out for validation."""
    from scaletrain.data import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(["builtin:python-stdlib"], out, vocab_size=512, max_bytes=400_000, val_fraction=0.05, workers=1)
    return out


@pytest.fixture(scope="session")
def short_documents(stdlib_data, tmp_path_factory) -> Path:
    """Python source cut at blank lines into short documents (about 130 tokens each, so about half
    of the 64-token windows hold a document boundary), tokenized with stdlib_data's tokenizer."""
    import sysconfig

    from scaletrain.data import prepare

    root = tmp_path_factory.mktemp("short")
    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:30]:
        texts += [part for part in path.read_text(errors="replace").split("\n\n") if len(part.strip()) > 40]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[:4000]))
    out = root / "documents"
    prepare([str(root / "docs.jsonl")], out, vocab_size=512, tokenizer=stdlib_data / "tokenizer.json",
            val_fraction=0.05, filters="none", workers=1)
    return out


@pytest.fixture(scope="session")
def mixture_root(stdlib_data, tmp_path_factory) -> Path:
    """data/stdlib (the interpreter's library) and data/project (this project's sources), one tokenizer."""
    from scaletrain.data import prepare

    root = tmp_path_factory.mktemp("mixture")
    (root / "stdlib").symlink_to(stdlib_data)
    prepare([str(ROOT / "src"), str(ROOT / "tests")], root / "project", vocab_size=512, val_fraction=0.1,
            tokenizer=stdlib_data / "tokenizer.json")
    return root


@pytest.fixture(scope="session")
def next_line_task(tmp_path_factory) -> Path:
    """A multiple-choice task of real text (eval.tasks): four lines of the standard library's
    Python, and which of four lines comes next — the right one or three lines from elsewhere."""
    import random
    import sysconfig

    rng = random.Random(0)
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[30:45]:
        lines += [line for line in path.read_text(errors="replace").splitlines() if len(line.strip()) > 20]
    examples = []
    for start in rng.sample(range(len(lines) - 5), 24):
        choices = [lines[start + 4], *rng.sample(lines, 3)]
        rng.shuffle(choices)
        examples.append({"context": "\n".join(lines[start:start + 4]) + "\n", "choices": choices,
                         "label": choices.index(lines[start + 4])})
    out = tmp_path_factory.mktemp("tasks") / "next_line.jsonl"
    out.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return out


def tiny_config(data_dir: Path, run_dir: Path, *overrides: str):
    """configs/tiny.toml pointed at `data_dir`, its run directory at `run_dir`."""
    return load_config(ROOT / "configs" / "tiny.toml",
                       [f"data.path={data_dir}", f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", *overrides])


# Failures of the machinery rather than of the code under test: a port taken between its choice
# (by torchrun or zygote.run_ranks) and rank 0 binding it, a loopback connection dropped on an
# overloaded 2-core machine.
TRANSIENT = ("Address already in use", "EADDRINUSE", "Connection reset by peer", "Connection closed by peer",
             "Broken pipe", "RendezvousConnectionError")
# An exception's line in a rank's traceback ("[rank1] RuntimeError: ...", "ValueError: ...",
# "torch._dynamo.exc.BackendCompilerFailed: ...", "KeyboardInterrupt"), and what a process that
# died without one prints.
RAISED = re.compile(r"^(?:\[rank\d+\]:?\s*)?(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*"
                    r"(?:Error|Exception|Failed|Interrupt|Exit|Warning)\b.*$", re.M)
DIED = ("Fatal Python error", "terminate called", "Segmentation fault", "core dumped")


def transient(stderr: str) -> bool:
    """Whether a failed launch failed for a transient network reason alone: such a reason is in
    its output, no process died without a traceback, and every exception a rank raised names one
    (a rank that died of a real error makes its peers see their connections reset too: that is
    not retried). torchrun's summary of its failed workers (ChildFailedError) is left out."""
    if not any(word in stderr for word in TRANSIENT) or any(word in stderr for word in DIED):
        return False
    raised = [line for line in RAISED.findall(stderr) if "ChildFailedError" not in line]
    return all(any(word in line for word in TRANSIENT) for line in raised)


def run_with_retry(run, describe: str):
    """run() -> CompletedProcess; once more, from the same state, when the launch itself failed
    for a transient network reason (transient). Returns the successful result."""
    result = run()
    if result.returncode != 0 and transient(result.stderr):
        print(f"retrying {describe}, which failed for a transient reason:\n" + result.stderr[-2000:])
        result = run()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def launch_runs(spec_path: Path, nproc: int, spec: list[dict]) -> None:
    """Train each run of `spec` (tests/run_layouts.py says what each entry holds), one after
    another, in one job of nproc processes (tests/zygote.py: torchrun's environment, processes
    forked with torch imported): starting processes costs seconds each on a 2-core machine, so
    tests group the runs of one size into one launch. The spec is written to spec_path."""
    import run_layouts

    spec_path.write_text(json.dumps(spec))
    # 60 s per run is ample (the 8-process 3-D layout takes ~15 s here).
    run_with_retry(lambda: run_ranks(run_layouts.main, (str(spec_path),), nproc, timeout=60 * len(spec) + 60),
                   f"{len(spec)} runs of {nproc} processes")


def lr_boost_once_at(step: int, factor: float):
    """A replacement for the trainer's run_lr under which the update after step `step` takes
    `factor` times its learning rate, once per process: a real loss spike at step `step` + 2
    (the first loss computed with the boosted update's weights)."""
    from scaletrain.train.schedule import run_lr

    fired = []

    def boosted(cfg, at):
        lr = run_lr(cfg, at)
        if at == step and not fired:
            fired.append(True)
            return lr * factor
        return lr
    return boosted


def nan_norm_once_after(step: int):
    """A replacement for Trainer._clip_gradients under which the gradient norm of step `step` + 1
    reads NaN, once per process (a numerical accident: a flipped bit, one kernel's overflow);
    the step's update is then skipped as for any non-finite norm."""
    from scaletrain.train.trainer import Trainer

    clip = Trainer._clip_gradients
    fired = []

    def glitched(self, max_norm, scale=None):
        norm = clip(self, max_norm, scale)
        if self.step == step and not fired:
            fired.append(True)
            return norm.new_full(norm.shape, float("nan"))
        return norm
    return glitched


@contextlib.contextmanager
def glitched(kind: str, step: int):
    """Within it, step `step` + 1 of a run diverges once: its gradient norm reads NaN ("nan"), or
    its loss spikes after the update of step `step` at 100 times its learning rate ("spike")."""
    from scaletrain.train import trainer

    if kind == "nan":
        saved, trainer.Trainer._clip_gradients = trainer.Trainer._clip_gradients, nan_norm_once_after(step)
    else:
        saved, trainer.run_lr = trainer.run_lr, lr_boost_once_at(step - 1, 100)
    try:
        yield
    finally:
        if kind == "nan":
            trainer.Trainer._clip_gradients = saved
        else:
            trainer.run_lr = saved


@contextlib.contextmanager
def flex_on_cpu():
    """Within it, model.attention_kernel = "flex" runs FlexAttention on the CPU too: torch's
    reference implementation, which computes the same attention the CUDA kernel does but which
    the public call refuses to differentiate there (a kernel of that speed exists only for
    inference). The tests check flex_block_mask's attention, forward and backward, against SDPA's
    mask with it."""
    import torch.nn.attention.flex_attention as flex

    from scaletrain.model import llama

    saved = llama.FLEX_DEVICES, flex._validate_device
    llama.FLEX_DEVICES, flex._validate_device = ("cuda", "cpu"), lambda *tensors: None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # (the reference, meant)
            yield
    finally:
        llama.FLEX_DEVICES, flex._validate_device = saved


def bos_tokenizer(trained: Path, out: Path) -> tuple[Path, int]:
    """`trained`'s tokenizer given a beginning-of-sequence token its post-processor puts before
    every text, as a Llama tokenizer's does: the file and the token's id."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.from_file(str(trained / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|begin_of_text|>"])
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = TemplateProcessing(single="<|begin_of_text|> $A",
                                                  special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer.save(str(out))
    return out, bos
