"""`scaletrain report`: a run's losses, speed and events, and the law's prediction beside them."""

from __future__ import annotations

import json
import re
import time


from conftest import run_cli, tiny_config
from scaletrain.config import load_config
from scaletrain.model.flops import param_counts
from scaletrain.report.goodput import account, wall_line, working_clock
from scaletrain.report.run import run_report
from scaletrain.scaling.fit import interval
from scaletrain.scaling.laws import ChinchillaLaw
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

LAW = ChinchillaLaw(E=2.0, A=60.0, B=400.0, alpha=0.3, beta=0.3)
BOOTSTRAP = [[2.0, 60.0, 400.0, 0.3, 0.3], [1.9, 60.0, 400.0, 0.3, 0.3], [2.1, 60.0, 400.0, 0.3, 0.3]]


def test_report_writes_plots_and_html_and_compares_the_final_loss_with_the_law(stdlib_data, next_line_task, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(stdlib_data, run_dir, "train.steps=6", "eval.interval=3", "checkpoint.interval=3",
                      f"eval.tasks=['{next_line_task}']", "eval.task_examples=8", "log.norms=true")
    train(cfg, stop_at_step=3)
    with open(run_dir / "metrics.jsonl", "a") as f:  # an attempt that got to step 5 and hung there: both ranks saw it
        for rank, seconds in ((1, 900.0), (0, 905.5)):
            f.write(json.dumps({"kind": "hang", "step": 5, "tokens": 2560, "time": time.time(), "seconds": seconds,
                                "rank": rank}) + "\n")
    train(cfg)  # resumes from step 3: the hang's step is gone over again, the hang stays an event
    law = tmp_path / "law.json"
    law.write_text(json.dumps({"approach3": {k: {"value": v} for k, v in LAW.to_dict().items() if k != "source"},
                               "bootstrap": BOOTSTRAP}))
    result = run_cli("report", str(run_dir), "--law", str(law))
    assert result.returncode == 0, result.stderr

    n = param_counts(load_config(run_dir / "config.toml").model)["total"]  # the vocabulary resolved
    tokens = 6 * cfg.train.global_batch_tokens
    predicted = LAW.loss(n, tokens)
    low, high = interval([ChinchillaLaw(*row).loss(n, tokens) for row in BOOTSTRAP])
    val_loss = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if '"kind": "eval"' in line][-1]["loss"]
    assert f"{predicted:.4f} [{low:.4f}, {high:.4f}]" in result.stdout
    assert f"{(val_loss - predicted) / predicted:+.2%}" in result.stdout
    assert re.search(r"resume events\W+1\b", result.stdout) and re.search(r"hang events\W+1\b", result.stdout)
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"kind": "eval"' in line][-1]
    assert f"{last['task_accuracy']['next_line']:.1%} ({last['task_accuracy_norm']['next_line']:.1%}; " \
           f"{last['task_nll']['next_line']:.4f})" in result.stdout
    # The gradient noise scale of the last step against its batch (tiny.toml accumulates 2 micro-batches).
    scale = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line][-1]["noise_scale"]
    assert f"{scale:,.0f} at step 6, batch 512: {1 + scale / 512:.2f}x the fewest steps, " \
           f"{1 + 512 / scale:.2f}x the fewest tokens" in result.stdout
    # Where the wall-clock of the two invocations went (report/goodput.py; the arithmetic is tested below).
    summary = run_report(run_dir)
    assert summary["time"]["invocations"] == 2 and wall_line(summary["time"]) in result.stdout
    assert "goodput over 2 invocations" in result.stdout
    for name in ("loss.png", "speed.png", "tasks.png", "batch.png", "progress.png", "norms.png"):
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (run_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 6  # self-contained
    assert "goodput: the share of the wall-clock that trained kept steps (2 invocations, 0 rewinds)" in page
    assert "<td>resume</td>" in page and "<td>end</td>" in page and "[model]" in page
    assert page.count("<td>hang</td><td>seconds 905.5, ranks [0, 1]</td>") == 1


def test_the_hangs_every_rank_recorded_are_one_event_an_invocation():
    """Each rank whose watchdog fired records the hang: one event of the ranks, the longest
    silence; the same step hung again after a restart is another event; older records name no rank."""
    from scaletrain.report.run import _events

    def record(kind, step, **values):
        return {"kind": kind, "step": step, "tokens": 0, "time": 0.0, **values}

    every = [record("start", 0), record("hang", 5, seconds=900.0, rank=1), record("hang", 5, seconds=905.5, rank=0),
             record("resume", 4), record("hang", 5, seconds=901.0, rank=0), record("resume", 4),
             record("hang", 5, seconds=3.0)]
    assert [e for e in _events(every) if e["kind"] == "hang"] == [
        {"kind": "hang", "step": 5, "seconds": 905.5, "ranks": [0, 1]},
        {"kind": "hang", "step": 5, "seconds": 901.0, "ranks": [0]},
        {"kind": "hang", "step": 5, "seconds": 3.0, "ranks": None}]


def test_report_refuses_what_is_not_a_run_or_a_law_in_one_line(stdlib_data, tmp_path):
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2 and "is not a run directory that has trained" in result.stderr
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=2", "eval.interval=0"))
    (tmp_path / "law.json").write_text("{}")
    result = run_cli("report", str(run_dir), "--law", str(tmp_path / "law.json"))
    assert result.returncode == 2 and "is not a law.json written by `scaletrain fit`" in result.stderr
    assert "Traceback" not in result.stderr


def accounted(run_dir, records: list[tuple]) -> dict | None:
    """account() of a run directory whose metrics.jsonl holds (kind, step, time, extra) records."""
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": kind, "step": step, "tokens": 512 * step, "time": t, **extra}) + "\n"
        for kind, step, t, extra in records))
    return account(read_metrics(run_dir, superseded=True), read_metrics(run_dir))


def test_the_wall_clock_splits_into_kept_steps_redone_steps_setup_checkpoints_evaluation_and_restarts(tmp_path):
    """A run started (4 s of setup), rewound once (the record of its step 4 superseded, 1 s of
    unlogged steps lost, 0.5 s to go back), crashed after step 6 and was resumed from step 4's
    checkpoint 5 s later (3 s of setup): each second of the 27 falls in one part, and the
    goodput is the 6 s of steps the run kept."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [("start", 0, 10, {"setup_s": 4.0}), ("train", 2, 12, {"step_s": 2.0}),
               ("checkpoint", 2, 13, {"blocking_s": 1.0}), ("train", 4, 15, {"step_s": 2.0}),
               ("rewind", 2, 16.5, {"lost_s": 1.0, "seconds": 0.5}), ("train", 4, 18.5, {"step_s": 2.0}),
               ("eval", 4, 19, {"seconds": 0.5}), ("checkpoint", 4, 20, {"blocking_s": 1.0}),
               ("train", 6, 22, {"step_s": 2.0}),  # then the crash
               ("resume", 4, 30, {"setup_s": 3.0}), ("train", 6, 32, {"step_s": 2.0}), ("end", 6, 33, {})]
    time_ = accounted(run_dir, records)
    assert time_["parts"] == {"steps": 6.0, "steps_redone": 5.0, "setup": 7.5, "checkpoints": 2.0, "evaluation": 0.5,
                              "between": 5.0, "other": 1.0}
    assert (time_["wall_s"], time_["goodput"], time_["invocations"], time_["rewinds"]) == (27.0, 6 / 27, 2, 1)
    assert time_["timeline"] == [[(0, 0), (4, 0), (6, 2), (9, 4), (10.5, 2), (12.5, 4), (16, 6)],
                                 [(21, 4), (24, 4), (26, 6)]]
    assert wall_line(time_) == ("22.2% of 27.0 s (redone 18.5%, setup 27.8%, checkpoints 7.4%, eval 1.9%, "
                                "restarts 18.5%, other 3.7%)")
    # A checkpoint between train records carries the steps since the last one: resumed from it,
    # the run keeps them, and only the steps after it are redone.
    records = [("start", 0, 10, {"setup_s": 0.0}), ("train", 2, 12, {"step_s": 2.0}),
               ("checkpoint", 3, 13.5, {"blocking_s": 0.5, "step_s": 1.0}), ("train", 4, 14.5, {"step_s": 1.0}),
               ("resume", 3, 20, {"setup_s": 1.0}), ("train", 4, 21, {"step_s": 1.0})]
    time_ = accounted(run_dir, records)
    assert (time_["parts"]["steps"], time_["parts"]["steps_redone"], time_["parts"]["between"]) == (4.0, 1.0, 4.5)
    # The crashed invocation went on training 1.5 s past its last record (its heartbeat, which the
    # resume record carries): those seconds were redone too, the rest of the gap was the restart.
    records[4] = ("resume", 3, 20, {"setup_s": 1.0, "last_alive": 16.0})
    time_ = accounted(run_dir, records)
    assert (time_["parts"]["steps"], time_["parts"]["steps_redone"], time_["parts"]["between"]) == (4.0, 2.5, 3.0)
    # A beat from before the last record (or from an earlier invocation) adds nothing.
    records[4] = ("resume", 3, 20, {"setup_s": 1.0, "last_alive": 12.0})
    time_ = accounted(run_dir, records)
    assert (time_["parts"]["steps_redone"], time_["parts"]["between"]) == (1.0, 4.5)
    # An invocation that ended at the step it was told to stop at (a sweep's trunk at a branch) was
    # paused: the 100 s until the next one are no restart, and are left out of the wall-clock.
    records = [("start", 0, 10, {"setup_s": 1.0}), ("train", 2, 12, {"step_s": 2.0}),
               ("end", 2, 12.5, {"complete": False, "stopped_by": None}), ("resume", 2, 113.5, {"setup_s": 1.0}),
               ("train", 4, 115.5, {"step_s": 2.0}), ("end", 4, 116, {"complete": True, "stopped_by": None})]
    time_ = accounted(run_dir, records)
    assert (time_["wall_s"], time_["paused_s"], time_["parts"]["between"], time_["goodput"]) == (7.0, 100.0, 0.0,
                                                                                               4 / 7)
    assert wall_line(time_) == "57.1% of 7.0 s (setup 28.6%, other 14.3%, 1.7 min paused, not counted)"
    # compare --x hours puts each record on the same clock: seconds since the launch, pauses left out.
    clock = working_clock(read_metrics(run_dir, superseded=True))
    assert [clock(t) for t in (12, 12.5, 60, 113.5, 116)] == [3.0, 3.5, 3.5, 4.5, time_["wall_s"]]
    records[2] = ("end", 2, 12.5, {"complete": False, "stopped_by": "SIGTERM"})  # a preemption's: a restart
    time_ = accounted(run_dir, records)
    assert (time_["wall_s"], time_["paused_s"], time_["parts"]["between"]) == (107.0, 0.0, 100.0)
    # A run whose train records do not time their steps (written before they did) has no account.
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "tokens": 512, "time": 1.0}) + "\n")
    assert account(read_metrics(run_dir, superseded=True), read_metrics(run_dir)) is None


def test_the_speed_set_against_the_plan_is_that_of_the_global_batch_past_the_ramp(tmp_path):
    """A plan's step is the global batch's: a run with train.batch_ramp is measured on the steps
    past it (the ramp's smaller steps run slower per token and would pull the median down)."""
    run_dir = tmp_path / "ramped"
    run_dir.mkdir()
    cfg = load_config(None, ["model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
                             "model.max_seq_len=64", "data.seq_len=64", "train.micro_batch=4", "train.steps=8",
                             "train.global_batch_tokens=1024", "train.batch_ramp=[[256, 1536]]"])
    (run_dir / "config.toml").write_text(cfg.to_toml())
    records = [{"kind": "start", "step": 0, "tokens": 0, "time": 0.0}]
    for step in range(1, 9):  # 6 steps of 256 tokens at 1,000 tokens/s, then 2 of 1,024 at 4,000
        ramp = step <= 6
        records.append({"kind": "train", "step": step, "tokens": cfg.tokens_before(step), "time": float(step),
                        "loss": 5.0, "tokens_per_s": 1000.0 if ramp else 4000.0, "mfu": 0.1 if ramp else 0.4})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = run_report(run_dir)
    assert (summary["tokens_per_s"], summary["mfu"]) == (4000.0, 0.4)


def test_compare_sets_runs_side_by_side_at_equal_tokens_or_compute(stdlib_data, tmp_path):
    """Two runs, one with multi-token prediction (more FLOPs per token): the table gives each its
    final and best validation loss, FLOPs and speed, the plot puts them on one axis; a directory
    that is not a run, or a single run, is refused in one line."""
    common = ["train.steps=4", "eval.interval=2", "checkpoint.interval=0"]
    train(tiny_config(stdlib_data, tmp_path / "plain", *common))
    train(tiny_config(stdlib_data, tmp_path / "mtp", *common, "model.mtp_depth=1"))
    result = run_cli("compare", str(tmp_path / "plain"), str(tmp_path / "mtp"), "--x", "flops",
                     "--out", str(tmp_path / "both.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│ ")}
    for name in ("plain", "mtp"):
        evals = read_metrics(tmp_path / name, "eval")
        start = read_metrics(tmp_path / name, "start")[0]
        cells = [cell.strip() for cell in lines[name].split("│")[1:-1]]
        assert cells[4] == f"{start['flops_per_token'] * 4 * 512:.3g}"
        assert cells[6].split()[0] == f"{evals[-1]['loss']:.4f}" and cells[7] == f"{min(r['loss'] for r in evals):.4f}"
    assert read_metrics(tmp_path / "mtp", "start")[0]["flops_per_token"] > read_metrics(
        tmp_path / "plain", "start")[0]["flops_per_token"]
    assert "*" in (lines["plain"] + lines["mtp"])  # the lower final validation loss is marked
    for argv, words in (([str(tmp_path / "plain"), str(tmp_path)], "is not a run directory that has trained"),
                        ([str(tmp_path / "plain")], "give two run directories or more")):
        result = run_cli("compare", *argv, "--out", str(tmp_path / "x.png"))
        assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr
