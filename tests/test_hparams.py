"""Hyperparameter laws and their search: a budget's optimum is the minimum of the surface through
its runs (or the centre of the near-optimal ones, with the grid's edges named), the law recovers a
known one from noisy runs, and a search on real text, interrupted between and inside runs,
resumes to the results of one that was not; its law then sets the sweep's, mixture search's and
planner's learning rate and batch."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from conftest import run_cli
from scaletrain.config import ConfigError, load_config
from scaletrain.hparams import HparamSearch, HparamSettings, load_law
from scaletrain.scaling.hparams import (DEEPSEEK, NEAR, HyperparameterLaw, bootstrap_hyperparameter_laws, budget_optimum,
                                        fit_runs)
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

KNOWN = HyperparameterLaw(0.5, -0.15, 0.1, 0.4)


def bowl(lrs, batches, lr_best, batch_best, floor=3.0):
    """A loss with its minimum at (lr_best, batch_best): a tilted paraboloid in the logs."""
    x, y = np.log(np.asarray(lrs) / lr_best), np.log(np.asarray(batches) / batch_best)
    return floor + 0.05 * x * x + 0.03 * y * y + 0.02 * x * y


def grid(lr_centre, batch_centre, lr_factors=(0.25, 0.5, 1, 2, 4), batch_factors=(0.5, 1, 2)):
    pairs = [(lr_centre * f, batch_centre * g) for f in lr_factors for g in batch_factors]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def test_a_budget_optimum_is_the_minimum_of_the_surface_through_its_runs():
    lrs, batches = grid(0.01, 1000)
    optimum = budget_optimum(1e10, lrs, batches, bowl(lrs, batches, 0.013, 800))
    assert optimum.method == "surface" and not optimum.edges
    assert optimum.lr == pytest.approx(0.013, rel=1e-6) and optimum.batch_tokens == pytest.approx(800, rel=1e-6)
    assert optimum.loss == pytest.approx(3.0)
    # a diverged run (nan) is the worst, not a failure of the fit
    losses = bowl(lrs, batches, 0.013, 800)
    losses[-1] = math.nan
    assert budget_optimum(1e10, lrs, batches, losses).lr == pytest.approx(0.013, rel=1e-6)


def test_an_optimum_beyond_the_grid_is_not_extrapolated_and_the_edge_is_named():
    lrs, batches = grid(0.01, 1000)
    optimum = budget_optimum(1e10, lrs, batches, bowl(lrs, batches, 0.5, 1000))  # 12x past the highest rate
    # (along the highest rate the tilted bowl is lowest at the largest batch: both edges)
    assert optimum.method == "near-optimal" and optimum.edges == ["lr high", "batch high"]
    assert optimum.lr == pytest.approx(0.04) and optimum.batch_tokens == pytest.approx(2000)
    # two batch sizes cannot place a surface's minimum: the near-optimal runs' centre instead
    lrs, batches = grid(0.01, 1000, batch_factors=(1, 2))
    optimum = budget_optimum(1e10, lrs, batches, bowl(lrs, batches, 0.01, 1000), near=0.001)
    assert optimum.method == "near-optimal" and optimum.edges == ["batch low"]
    assert optimum.lr == pytest.approx(0.01) and optimum.batch_tokens == pytest.approx(1000)
    with pytest.raises(ValueError, match="every run at budget 1e\\+10 diverged; lower the learning rates"):
        budget_optimum(1e10, lrs, batches, np.full(len(lrs), math.nan))
    # Three rates, the middle one worst (noise: a search run of hparams measured 4.0223, 4.0537, 4.0236): the
    # ends are not one near-optimal stretch, whose centre would be the worst rate; the best run's rate it is.
    optimum = budget_optimum(3e10, [0.0076, 0.0153, 0.0306], [4096] * 3, [4.0223, 4.0537, 4.0236])
    assert optimum.method == "near-optimal" and optimum.near == [0] and optimum.lr == pytest.approx(0.0076)
    assert optimum.edges == ["lr low"]
    joined = budget_optimum(3e10, [0.0076, 0.0153, 0.0306], [4096] * 3, [4.0223, 4.0230, 4.0236])
    assert joined.near == [0, 1, 2] and joined.lr == pytest.approx(0.0153, rel=0.01)
    # A diagonal neighbour joins too: the best rate grows with the batch.
    lrs, batches = [0.004, 0.008, 0.016] * 2, [2048] * 3 + [4096] * 3
    diagonal = budget_optimum(3e10, lrs, batches, [3.0, 3.1, 3.1, 3.1, 3.0003, 3.1])
    assert diagonal.near == [0, 4] and diagonal.lr == pytest.approx(math.sqrt(0.004 * 0.008))


def noisy_runs(law, budgets, noise, seed=0):
    rng = np.random.default_rng(seed)
    columns = [[], [], [], []]
    for budget in budgets:
        lr, batch = law(budget)
        lrs, batches = grid(lr * 1.3, batch * 0.8)  # the grid's centre off the optimum, as a prior rule's is
        losses = bowl(lrs, batches, lr, batch) + rng.normal(0, noise, len(lrs))
        for column, values in zip(columns, (np.full(len(lrs), budget), lrs, batches, losses)):
            column.extend(values)
    return [np.array(column) for column in columns]


def test_the_law_recovers_known_power_laws_from_noisy_runs_with_intervals_that_hold_them():
    runs = noisy_runs(KNOWN, [1e10, 3e10, 1e11, 3e11], noise=0.002)
    law, optima = fit_runs(*runs)
    assert [o.method for o in optima] == ["surface"] * 4
    assert law.lr_exponent == pytest.approx(KNOWN.lr_exponent, abs=0.03)
    assert law.batch_exponent == pytest.approx(KNOWN.batch_exponent, abs=0.05)
    assert law.lr(1e12) == pytest.approx(KNOWN.lr(1e12), rel=0.15)
    boot = bootstrap_hyperparameter_laws(*runs, samples=100)
    for key in ("lr_exponent", "batch_exponent"):
        low, high = np.percentile([getattr(b, key) for b in boot], [2.5, 97.5])
        assert low <= getattr(KNOWN, key) <= high, key
    # noise-free, exactly
    exact, _ = fit_runs(*noisy_runs(KNOWN, [1e10, 1e11], noise=0.0))
    assert exact.lr_exponent == pytest.approx(KNOWN.lr_exponent, abs=1e-6)
    assert exact.batch_coefficient == pytest.approx(KNOWN.batch_coefficient, rel=1e-5)
    with pytest.raises(ValueError, match="needs optima at two budgets or more, got 1"):
        fit_runs(*noisy_runs(KNOWN, [1e10], noise=0.0))


def test_a_budget_whose_best_run_is_on_the_grids_edge_is_left_out_of_that_law():
    runs = noisy_runs(KNOWN, [1e10, 1e11, 1e12], noise=0.0)
    budget, lrs, batches, losses = runs
    # the smallest budget's grid of batches lies wholly above its optimum: the best run is at its low edge
    at = budget == 1e10
    batches[at] *= 8
    losses[at] = bowl(lrs[at], batches[at], *KNOWN(1e10))
    law, optima = fit_runs(budget, lrs, batches, losses)
    assert optima[0].edges == ["batch low"] and optima[0].used == ["lr"]
    assert all(o.used == ["lr", "batch"] for o in optima[1:])
    assert law.batch_exponent == pytest.approx(KNOWN.batch_exponent, abs=1e-6)  # from the two others, exactly
    assert law.budgets == (1e10, 1e12)


def test_a_law_survives_json_and_bad_law_files_are_refused(tmp_path):
    assert HyperparameterLaw.from_dict(json.loads(json.dumps(KNOWN.to_dict()))) == KNOWN
    assert DEEPSEEK(1e20) == pytest.approx((0.3118 * 1e20 ** -0.125, 0.2920 * 1e20 ** 0.3271))
    path = tmp_path / "hparams.json"
    path.write_text(json.dumps({"law": KNOWN.to_dict()}))
    assert load_law(path) == KNOWN
    for text, message in [("{", "is not a hyperparameter law \\(Expecting"),
                          (json.dumps({"law": {"lr_exponent": 1}}), "needs lr_coefficient, .*; missing lr_coefficient"),
                          (json.dumps({**KNOWN.to_dict(), "batch_coefficient": -1}),
                           "batch_coefficient = -1 is not a positive finite number")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_law(path)
    with pytest.raises(ConfigError, match="'nowhere.json' is not a file; give the hparams.json"):
        load_law("nowhere.json")


def settings(root, **change) -> HparamSettings:
    # tiny budgets and min_steps 30 keep these runs to about a second each
    return replace(HparamSettings(data=str(root), budgets=[3e9, 1e10], lr_factors=[0.5, 1, 2], batch_factors=[0.5, 1],
                                  seq_len=64, eval_tokens=2048, min_steps=30, device="cpu"), **change)


@pytest.fixture(scope="module")
def searched(stdlib_data, tmp_path_factory):
    search = HparamSearch(tmp_path_factory.mktemp("hparams") / "whole", settings(stdlib_data))
    return search, search.run()


def test_a_search_trains_the_grid_around_the_prior_rule_at_each_budget(searched):
    search, rows = searched
    assert len(rows) == 12 and [row["name"] for row in rows] == list(search.points)
    # a batch is whole sequences, whole half micro-batches (of 8) above one
    assert [search.batch_seqs(64 * k) for k in (0.2, 3, 9, 12.4, 17)] == [1, 3, 8, 12, 16]
    for budget in (3e9, 1e10):
        at = [row for row in rows if row["budget"] == budget]
        lr, batch = DEEPSEEK(budget)
        assert sorted({row["lr"] for row in at}) == pytest.approx([lr / 2, lr, 2 * lr])
        assert sorted({row["batch_seqs"] for row in at}) == sorted({search.batch_seqs(batch * f) for f in (0.5, 1)})
        for row in at:
            assert row["c"] == pytest.approx(budget, rel=0.05) and row["steps"] >= 30
            cfg = search.run_config(row["name"])
            assert cfg.train.schedule == "wsd" and cfg.train.lr == row["lr"]
            assert cfg.train.global_batch_tokens == row["batch_tokens"]
            assert read_metrics(cfg.run_dir, "eval")[-1]["loss"] == row["loss"]


def test_a_search_interrupted_between_and_inside_runs_resumes_to_the_same_results(searched, stdlib_data, tmp_path):
    _, whole = searched
    search = HparamSearch(tmp_path / "resumed", settings(stdlib_data))

    def stop_after_three(progress):
        if progress["done"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search.run(progress=stop_after_three)
    names = list(search.points)
    assert [row["name"] for row in search.results()] == names[:3]
    half = search.run_config(names[3])
    train(half, stop_at_step=half.train.steps // 2)
    kept = (search.out / "runs" / names[0] / "metrics.jsonl").read_text()
    rows = HparamSearch(tmp_path / "resumed", settings(stdlib_data)).run()
    assert rows == whole
    assert (search.out / "runs" / names[0] / "metrics.jsonl").read_text() == kept  # not trained again
    assert read_metrics(half.run_dir, "resume"), "the half-trained run should have resumed from its checkpoint"
    # a wider grid trains only the runs it adds; a narrower one fits the runs it keeps
    wider = HparamSearch(tmp_path / "resumed", settings(stdlib_data, lr_factors=[0.5, 1, 2, 4]))
    rows = wider.run()
    assert len(rows) == 16 and [row for row in rows if row["name"] in set(names)] == whole
    assert (search.out / "runs" / names[0] / "metrics.jsonl").read_text() == kept
    narrower = HparamSearch(tmp_path / "resumed", settings(stdlib_data, lr_factors=[1, 2, 4]))
    assert len(narrower.planned_results()) == 12 and len(narrower.results()) == 16
    law, optima, _ = narrower.fit(rows, samples=5)
    assert all(len(o.near) >= 1 for o in optima) and all(row["lr"] >= min(r["lr"] for r in whole) * 1.9
                                                          for row in narrower.planned_results())
    with pytest.raises(ConfigError, match="was started with other settings \\(seq_len: 64 then, 32 now\\); .* \\(the "
                                          "grid, --budgets, --lrs and --batches, may change\\)"):
        HparamSearch(tmp_path / "resumed", settings(stdlib_data, seq_len=32))


def test_the_eta_weighs_the_runs_left_by_their_flops(stdlib_data, tmp_path, monkeypatch):
    """The grid trains its smallest budget first: the runs left take what those done took per
    FLOP, not per run (which would put a 10x larger budget's runs at the small ones' pace)."""
    import scaletrain.proxies as proxies

    search = HparamSearch(tmp_path / "eta", settings(stdlib_data, budgets=[3e9, 3e10]))
    clock = [0.0]
    monkeypatch.setattr(proxies.time, "perf_counter", lambda: clock[0])

    def run_one(name, train):  # (no training: one second per 1e9 FLOPs on a clock of its own)
        clock[0] += search.points[name].compute / 1e9
        return {"name": name, "c": search.points[name].compute}

    monkeypatch.setattr(search, "_run_one", run_one)
    seen = []
    search.run(progress=seen.append)
    total = sum(point.compute for point in search.points.values()) / 1e9
    assert [shown["name"] for shown in seen] == list(search.points)
    assert seen[-1]["eta_s"] == pytest.approx(0.0, abs=1e-9)
    first = search.points[seen[0]["name"]].compute / 1e9
    assert seen[0]["eta_s"] == pytest.approx(total - first)


def test_the_time_of_the_runs_left_is_predicted_from_their_shapes_timed_here(searched, stdlib_data, tmp_path):
    from scaletrain.sweep import Speed

    search = HparamSearch(tmp_path / "begun", settings(stdlib_data))
    first = search.keys()[0]
    search._record(search._run_one(first, train))  # one run done: the rest are predicted
    predicted = search.predict_seconds(tmp_path / "timing")
    left = [search.points[name] for name in search.keys()[1:]]
    speed = Speed(**predicted["speed"])
    assert predicted["runs"] == len(left) and predicted["flops"] == pytest.approx(sum(p.compute for p in left))
    assert sorted(speed.n) == sorted({p.n for p in left}) and all(rate > 0 for rate in speed.flops_per_s)
    # one run after another here: the sum of each one's time at its shape's speed
    assert predicted["seconds"] == pytest.approx(sum(speed.seconds(p, p.steps) for p in left))
    # runs of several batches: what a micro-batch costs whatever its sequences was timed too
    assert len({p.batch_seqs for p in left}) > 1 and len(speed.timed_seqs) == len(speed.n)
    assert speed.micro_batch == search.settings.micro_batch and min(speed.step_fixed_s, speed.micro_batch_s) >= 0
    assert not (tmp_path / "timing").exists() and [r["name"] for r in search.results()] == [first]
    assert searched[0].predict_seconds(tmp_path / "timing")["runs"] == 0
    # The command trains nothing and writes nothing: not into a directory of its name, nor into a
    # search begun (whose grid, changed here, it would otherwise write over).
    (tmp_path / "new").mkdir()
    args = ["hparams", "--data", str(stdlib_data), "--budgets", "3e9,1e10", "--lrs", "0.5,1,2", "--batches", "0.5,1",
            "--seq-len", "64", "--eval-tokens", "2048", "--min-steps", "30", "--device", "cpu", "--predict-time"]
    result = run_cli(*args, "--out", str(tmp_path / "new"), "--concurrency", "2")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert f"for the {len(search.keys())} runs left of {len(search.keys())}" in text and "2 at once" in text
    assert re.search(r"2 at once \(its \d+\.\d s of starting worker processes included\)", text)
    assert not list((tmp_path / "new").iterdir()) and "step 1/" not in result.stderr  # (timing runs' logs kept quiet)
    grid = (search.out / "grid.json").read_text()
    result = run_cli(*args[:6], "0.5,1,2,4", *args[7:], "--out", str(search.out))
    assert result.returncode == 0, result.stderr
    wider = len(search.keys()) * 4 // 3  # (a fourth rate for each budget and batch; the run done among them)
    assert f"for the {wider - 1} runs left of {wider}" in " ".join(result.stdout.split())
    assert (search.out / "grid.json").read_text() == grid


@pytest.mark.parametrize("change, message", [
    ({"budgets": [1e10]}, "a law of the compute needs at least two budgets"),
    ({"lr_factors": [1, 2]}, "--lrs 1,2: give at least 3 distinct positive factors"),
    ({"lr_factors": [1, 1.00001, 2]}, "--lrs factors whose rates at budget 3e\\+09 round alike make one run, "
                                      "C3e09-b3-lr"),
    ({"batch_factors": [0]}, "--batches 0: give at least 1 distinct positive factors"),
    ({"budgets": [1e8, 1e10]}, "budget 1e\\+08 trains d16-l1 for fewer than 30 steps at every batch"),
    ({"data": "/nonexistent"}, "--data '/nonexistent': "),
])
def test_bad_settings_are_refused_before_anything_trains(stdlib_data, tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        HparamSearch(tmp_path / "bad", settings(stdlib_data, **change))
    assert not (tmp_path / "bad").exists()


def test_the_command_fits_the_search_and_its_law_sets_the_sweep_mixture_and_plan(searched, stdlib_data, mixture_root,
                                                                                  tmp_path):
    from scaletrain.mixture import MixtureSearch, MixtureSettings
    from scaletrain.sweep import Sweep, SweepSettings

    search, rows = searched
    args = ["hparams", "--data", str(stdlib_data), "--budgets", "3e9,1e10", "--lrs", "0.5,1,2", "--batches", "0.5,1",
            "--seq-len", "64", "--eval-tokens", "2048", "--min-steps", "30", "--device", "cpu", "--bootstrap", "20",
            "--predict", "1e12", "--out", str(search.out)]
    result = run_cli(*args, "--check", "3e10", "--concurrency", "2")
    assert result.returncode == 0, result.stderr
    doc = json.loads((search.out / "hparams.json").read_text())
    law = load_law(search.out / "hparams.json")
    # --check: the compute-optimal model at 3e10, trained with the law's rate and batch and with
    # DeepSeek's (two worker processes), their losses set side by side
    [check] = doc["checks"]
    assert check["budget"] == 3e10 and check["extrapolation"] == pytest.approx(3.0)
    for rule, (lr, batch) in (("measured", law(3e10)), ("prior", DEEPSEEK(3e10))):
        run = check["runs"][rule]
        assert run["lr"] == pytest.approx(lr) and abs(run["batch_tokens"] - batch) <= 64 * 4
        cfg = load_config(search.out / "check" / "runs" / run["name"] / "config.toml")
        assert (cfg.train.lr, cfg.train.global_batch_tokens) == (pytest.approx(lr), run["batch_tokens"])
        assert read_metrics(cfg.run_dir, "eval")[-1]["loss"] == run["loss"]
    assert check["loss_difference"] == pytest.approx(check["runs"]["measured"]["loss"] - check["runs"]["prior"]["loss"])
    # A law fitted again to a grid changed since sets another rate: its check trains anew, not the old run's loss.
    from scaletrain.hparams import CheckSettings, HparamCheck
    refitted = {**law.to_dict(), "lr_coefficient": 1.25 * law.lr_coefficient}
    again = HparamCheck(search.out / "check", CheckSettings(search.settings, refitted, 3e10))
    assert again.todo() == ["measured"] and again.name_of("prior") == check["runs"]["prior"]["name"]
    assert "check at 3e+10 FLOPs" in result.stdout and "trained the better model, by" in result.stdout
    within = run_cli(*args, "--check", "1e10")
    assert within.returncode != 0 and "--check 1e+10: check the law beyond the budgets" in within.stderr
    assert [entry["budget"] for entry in doc["budgets"]] == [3e9, 1e10] and (search.out / "hparams.png").is_file()
    for entry in doc["budgets"]:
        best = min((row for row in rows if row["budget"] == entry["budget"]), key=lambda row: row["loss"])
        assert entry["best_run"]["name"] == best["name"] and entry["method"] in ("surface", "near-optimal")
    # The runs hparams.json calls near-optimal are those within `near` of the budget's best, whatever
    # order results.csv holds them in (a widened grid's runs come last): fitted from rows in another order.
    shuffled = list(reversed(search.results()))
    law_, optima, boot = search.fit(shuffled, samples=5)
    for entry in search.summary(law_, optima, boot)["budgets"]:
        at = {row["name"]: row["loss"] for row in rows if row["budget"] == entry["budget"]}
        lowest = min(at.values())
        assert entry["near"] and all(at[name] <= lowest * (1 + NEAR) for name in entry["near"]), entry
    # two budgets: the line passes through both optima
    for entry in doc["budgets"]:
        assert law.lr(entry["budget"]) == pytest.approx(entry["lr"], rel=1e-6)
    prediction = doc["predictions"][0]
    assert prediction["compute"] == 1e12 and prediction["lr"] == pytest.approx(law.lr(1e12))
    assert prediction["lr_interval"][0] <= prediction["lr"] <= prediction["lr_interval"][1]
    assert "at 1e+12 FLOPs: lr " in result.stdout and f"--hparams {search.out / 'hparams.json'}" in result.stdout
    # a sweep started with the law follows it, and reopening the sweep keeps it
    sweep = Sweep(tmp_path / "sweep", SweepSettings(data=str(stdlib_data), budgets=[1e10, 3e10], shapes=2, min_steps=20,
                                                    seq_len=64, hparams=law.to_dict()))
    shape = sweep.points_of(1e10, [])[0].shape
    assert sweep.shape_plan(shape)[0] == pytest.approx(law.lr(3e10))
    assert Sweep.open(tmp_path / "sweep").shape_plan(shape)[0] == pytest.approx(law.lr(3e10))
    # the mixture search's proxies
    mixture = MixtureSearch(tmp_path / "mixture", MixtureSettings(data=str(mixture_root), sources=["project", "stdlib"],
                                                                  budget=1e10, seq_len=64, min_steps=20,
                                                                  hparams=law.to_dict()))
    assert mixture.point.lr == pytest.approx(law.lr(1e10))
    # the planner's learning rate and batch for a run it sizes
    planned = run_cli("plan", "--compute", "1e20", "--hparams", str(search.out / "hparams.json"), "--json")
    assert planned.returncode == 0, planned.stderr
    hyperparameters = json.loads(planned.stdout)["hyperparameters"]
    compute = json.loads(planned.stdout)["compute"]
    assert hyperparameters["lr"] == pytest.approx(law.lr(compute), rel=1e-4)  # (compute: of whole steps)
    assert hyperparameters["rule_batch_tokens"] == pytest.approx(law.batch_tokens(compute), rel=1e-4)
    assert "the rule of scaletrain hparams on " in hyperparameters["source"]
    assert hyperparameters["extrapolation"] == pytest.approx(compute / 1e10, rel=1e-4)  # measured up to 1e10
    shown = run_cli("plan", "--compute", "1e20", "--hparams", str(search.out / "hparams.json"))
    text = " ".join(shown.stdout.replace("│", " ").split())  # (the table wraps the cell)
    assert "x beyond the budgets it was measured at: check the rate on a short run first" in text
    refused = run_cli("plan", "--compute", "1e20", "--hparams", str(tmp_path / "none.json"))
    assert refused.returncode != 0 and "none.json' is not a file; give the hparams.json" in refused.stderr
