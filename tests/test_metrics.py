"""metrics.jsonl reads as one history across resumes, restarts and torn writes."""

import json
import math

import pytest

from scaletrain.train.metrics import MetricsLog, read_metrics


def test_a_resume_supersedes_records_past_the_resumed_step(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write("start", 0, 0)
    for step in (1, 2, 3):
        log.write("train", step, step * 10, loss=float(step))
    log.close()
    log = MetricsLog(tmp_path / "metrics.jsonl")  # crashed after step 3, resumed from the checkpoint of step 2
    log.write("resume", 2, 20)
    log.write("train", 3, 30, loss=3.5)
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path, "train")] == [(1, 1.0), (2, 2.0), (3, 3.5)]


def test_a_fresh_start_begins_a_new_history(tmp_path):
    for loss in (1.0, 2.0):
        log = MetricsLog(tmp_path / "metrics.jsonl")
        log.write("start", 0, 0)
        log.write("train", 1, 10, loss=loss)
        log.close()
    assert [r["loss"] for r in read_metrics(tmp_path, "train")] == [2.0]


def test_a_line_torn_by_a_crash_is_skipped_and_does_not_swallow_the_next(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write("train", 1, 10, loss=1.0)
    log.close()
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 2, "lo')  # the process died mid-write
    log = MetricsLog(path)
    log.write("resume", 1, 10)
    log.write("train", 2, 20, loss=2.0)
    log.close()
    assert [r["loss"] for r in read_metrics(tmp_path, "train")] == [1.0, 2.0]


def test_superseded_records_are_kept_on_request_but_an_earlier_run_is_not(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write("start", 0, 0)
    log.write("end", 4, 40, complete=True)  # an earlier run in this directory
    log.write("start", 0, 0)
    log.write("train", 5, 50, loss=5.0)
    log.write("hang", 5, 50, seconds=900.0)  # an attempt that hung after step 5 ...
    log.write("resume", 4, 40)  # ... resumed from step 4's checkpoint
    log.write("rewind", 2, 20)  # a divergence sent it back further
    log.close()
    assert [r["kind"] for r in read_metrics(tmp_path)] == ["start", "rewind"]  # the rewind went back past it all
    assert [r["kind"] for r in read_metrics(tmp_path, superseded=True)] == [
        "start", "train", "hang", "resume", "rewind"]


def test_a_record_of_the_wrong_shape_is_left_out_with_a_warning(tmp_path, caplog):
    """A line edited by hand (or written by something else) that is not a record as MetricsLog
    writes them is left out, once said, instead of failing report and compare; a record torn by a
    crash is left out without a word."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write("start", 0, 0)
    for step in (1, 2, 3):
        log.write("train", step, step * 10, loss=float(step))
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "plan_check", "step": 3, "tokens": 30,  # (sound: its numbers are dicts)
                            "mfu": {"planned": 0.5, "measured": 0.4, "ratio": 0.8}}) + "\n")
        for bad in ({"kind": "train", "step": "4", "tokens": 40, "loss": 4.0}, {"step": 5, "tokens": 50},
                    {"kind": "train", "step": 6, "tokens": 60, "loss": [6.0]}, {"kind": "train", "step": 7, "tokens": None},
                    {"kind": "train", "step": 8, "tokens": 80, "step_s": "1s"}, [1, 2]):
            f.write(json.dumps(bad) + "\n")
        f.write('{"kind": "train", "step": 9, "tok\n')  # a record torn by a crash: not said
        f.write("ok 3 steps done\n")  # (not JSON, nor a torn record)
    with caplog.at_level("WARNING", logger="scaletrain"):
        assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3]
        assert [r["kind"] for r in read_metrics(tmp_path)][-1] == "plan_check"
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "7 line(s) are not records this project writes (not JSON, a field missing or of another type); they were "
        "left out"]


def test_values_that_are_not_finite_are_strict_json_and_read_back(tmp_path):
    """A diverged step's loss (NaN) and an infinite gradient norm are written as null, named under
    "nonfinite", so that strict readers (jq, JavaScript, Go) take every line; read_metrics gives
    the floats back, nested ones too. A file of an earlier version, with bare NaN, still reads."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write("start", 0, 0)
    log.write("train", 1, 10, loss=float("nan"), grad_norm=float("inf"), lr=1e-3)
    log.write("eval", 1, 10, loss=2.0, loss_by_source={"code": float("-inf"), "web": 2.5})
    log.close()
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not strict JSON: {line}"))
    train = json.loads(path.read_text().splitlines()[1])
    assert train["loss"] is None and train["grad_norm"] is None and train["lr"] == 1e-3
    assert sorted(train["nonfinite"]) == [["grad_norm", "Infinity"], ["loss", "NaN"]]
    (record,) = read_metrics(tmp_path, "train")
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf and "nonfinite" not in record
    (evaluation,) = read_metrics(tmp_path, "eval")
    assert evaluation["loss_by_source"] == {"code": -math.inf, "web": 2.5} and evaluation["loss"] == 2.0
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 2, "tokens": 20, "time": 1.0, "loss": NaN}\n')
    assert math.isnan(read_metrics(tmp_path, "train")[-1]["loss"])
