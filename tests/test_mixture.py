"""Data mixing laws and the mixture search: the fit predicts a known law, the optimum is the
hand-solved one and keeps to its epoch caps, and a search on two real sources, interrupted
between runs and inside one, resumes to the results of one that was not."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import run_cli
from scaletrain.config import ConfigError
from scaletrain.mixture import MIN_SHARE, MixtureSearch, MixtureSettings, default_runs, sources_under
from scaletrain.report.scaling import plot_mixture
from scaletrain.scaling.mixing import (MixingLaw, best_mixture, bootstrap_mixing_laws, fit_mixing_law, leave_one_out,
                                       share_bounds)
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

NAMES = ["code", "math", "prose"]
KNOWN = MixingLaw(NAMES, NAMES, e=np.array([1.5, 2.0, 1.0]),
                  c=np.array([[2.0, 0.5, 0.3], [0.4, 1.5, 0.2], [0.3, 0.3, 3.0]]),
                  gamma=np.array([[0.6, 0.5, 0.4], [0.5, 0.7, 0.3], [0.4, 0.4, 0.8]]))


def noisy_runs(law: MixingLaw, runs: int, noise: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.ones(len(law.sources)), runs)
    return shares, law.losses(shares) + rng.normal(0, noise, (runs, len(law.validation)))


def test_the_fit_predicts_a_known_law_from_noisy_losses():
    shares, losses = noisy_runs(KNOWN, runs=24, noise=0.002)
    law = fit_mixing_law(NAMES, NAMES, shares, losses)
    # between the runs it predicts what the known law gives, to well under a percent
    probe = np.random.default_rng(1).dirichlet(np.ones(3), 50)
    assert np.abs(law.losses(probe) / KNOWN.losses(probe) - 1).max() < 0.005
    # the mixture it chooses is the known law's, and a law survives the round trip through JSON
    weights, (lower, upper) = np.full(3, 1 / 3), share_bounds(np.ones(3), None, 4, MIN_SHARE)
    assert np.abs(best_mixture(law, weights, lower, upper) - best_mixture(KNOWN, weights, lower, upper)).max() < 0.02
    again = MixingLaw.from_dict(json.loads(json.dumps(law.to_dict())))
    assert all(np.array_equal(getattr(again, k), getattr(law, k)) for k in ("e", "c", "gamma"))
    # the gradient the optimizer follows is the target's
    r, step = np.array([0.3, 0.3, 0.4]), 1e-6
    numeric = [(law.target(r + step * d, weights) - law.target(r - step * d, weights)) / (2 * step) for d in np.eye(3)]
    assert law.gradient(r, weights) == pytest.approx(numeric, rel=1e-5)


def test_leave_one_out_and_the_bootstrap_measure_the_noise():
    shares, exact = noisy_runs(KNOWN, runs=12, noise=0.0)
    law = fit_mixing_law(NAMES, NAMES, shares, exact)
    assert np.abs(leave_one_out(law, shares, exact) - exact).max() < 1e-3
    _, noisy = noisy_runs(KNOWN, runs=12, noise=0.02)
    noisy_law = fit_mixing_law(NAMES, NAMES, shares, noisy)
    errors = np.abs(leave_one_out(noisy_law, shares, noisy) - noisy)
    assert 0.005 < np.nanmean(errors) < 0.1
    boot = bootstrap_mixing_laws(noisy_law, shares, noisy, samples=40)
    assert len(boot) == 40
    spread = np.std([b.target(np.full(3, 1 / 3), np.full(3, 1 / 3)) for b in boot])
    assert 0.001 < spread < 0.05
    # a law needs 2n + 1 distinct mixtures
    with pytest.raises(ValueError, match="needs at least 7 runs on distinct mixtures, got 6"):
        fit_mixing_law(NAMES, NAMES, shares[:6], noisy[:6])


def test_the_best_mixture_of_two_sources_is_the_hand_solved_one():
    # L_1 = E + 1 / (C r_1^γ), L_2 = E + 1 / (C r_2^γ): w_1 γ r^(-γ-1) = w_2 γ (1 - r)^(-γ-1) at the
    # optimum, so r_1 = 1 / (1 + (w_2 / w_1)^(1 / (γ + 1))).
    gamma = 0.5
    law = MixingLaw(["x", "y"], ["x", "y"], np.array([1.0, 1.0]), np.array([[2.0, 0.0], [0.0, 2.0]]),
                    np.full((2, 2), gamma))
    lower, upper = share_bounds(np.array([1.0, 1.0]), None, 4, 0.01)
    for w1 in (0.5, 0.7, 0.2):
        r = best_mixture(law, np.array([w1, 1 - w1]), lower, upper)
        assert r[0] == pytest.approx(1 / (1 + ((1 - w1) / w1) ** (1 / (gamma + 1))), abs=1e-5)
        assert r.sum() == pytest.approx(1.0)


def test_the_best_mixture_keeps_to_the_epoch_caps_and_says_when_none_can():
    law = MixingLaw(["small", "big"], ["small", "big"], np.array([1.0, 1.0]), np.array([[1.0, 0.0], [0.0, 1.0]]),
                    np.full((2, 2), 0.5))
    free = best_mixture(law, np.array([0.5, 0.5]), *share_bounds(np.array([1e6, 1e9]), None, 4, 0.02))
    assert free[0] == pytest.approx(0.5, abs=1e-5)
    # 1e6 unique tokens of "small" in a run of 2e7: at most 4 epochs is a share of 0.2
    lower, upper = share_bounds(np.array([1e6, 1e9]), 2e7, 4, 0.02)
    assert upper.tolist() == [pytest.approx(0.2), 1.0]
    capped = best_mixture(law, np.array([0.5, 0.5]), lower, upper)
    assert capped[0] == pytest.approx(0.2, abs=1e-6)
    with pytest.raises(ValueError, match="would repeat every source past the epoch limit"):
        best_mixture(law, np.array([0.5, 0.5]), *share_bounds(np.array([1e6, 1e6]), 1e7, 4, 0.02))


def settings(root, runs=6) -> MixtureSettings:
    # min_steps 20 and a tiny budget keep these runs to seconds (a real search's proxies train more)
    return MixtureSettings(data=str(root), sources=["project", "stdlib"], budget=1e10, runs=runs, seq_len=64,
                           eval_tokens=2048, min_steps=20, device="cpu")


@pytest.fixture(scope="module")
def searched(mixture_root, tmp_path_factory):
    search = MixtureSearch(tmp_path_factory.mktemp("mixture") / "whole", settings(mixture_root))
    return search, search.run()


def test_a_search_plans_natural_uniform_and_corner_mixtures_and_trains_a_proxy_on_each(searched, mixture_root):
    search, rows = searched
    assert default_runs(2) == 8 and default_runs(3) == 12 and default_runs(5) == 20
    tokens = search.unique_tokens
    natural = tokens["project"] / (tokens["project"] + tokens["stdlib"])
    low, high = MIN_SHARE, 1 - MIN_SHARE
    expected = [MIN_SHARE + (1 - 2 * MIN_SHARE) * natural, 0.5, high, low]
    assert [m["project"] for m in search.mixtures[:4]] == pytest.approx(expected, abs=1e-4)
    assert all(low <= m["project"] <= high and m["project"] + m["stdlib"] == pytest.approx(1, abs=1e-3)
               for m in search.mixtures[4:])
    assert [row["name"] for row in rows] == [f"mix-{i:02d}" for i in range(6)]
    for row, shares in zip(rows, search.mixtures):
        cfg = search.run_config(int(row["name"][-2:]))
        assert cfg.data.mix == shares and cfg.train.schedule == "cosine"
        last = read_metrics(cfg.run_dir, "eval")[-1]
        assert row["loss_project"] == last["loss_by_source"]["project"]
        assert row["loss_stdlib"] == last["loss_by_source"]["stdlib"]
        assert row["c"] == pytest.approx(search.settings.budget, rel=0.01)
    # more project code lowers the loss on project's validation split, more stdlib on stdlib's
    by_share = sorted(rows, key=lambda row: row["share_project"])
    assert by_share[-1]["loss_project"] < by_share[0]["loss_project"]
    assert by_share[-1]["loss_stdlib"] > by_share[0]["loss_stdlib"]


def test_the_search_chooses_writes_and_checks_a_mixture(searched, tmp_path):
    search, rows = searched
    law, choice = search.choose(rows, samples=20)
    assert sum(choice.shares.values()) == pytest.approx(1.0, abs=1e-3)
    assert all(MIN_SHARE - 1e-4 <= share <= 1 - MIN_SHARE + 1e-4 for share in choice.shares.values())
    measured = [0.5 * row["loss_project"] + 0.5 * row["loss_stdlib"] for row in rows]
    assert choice.best_run["loss"] == min(measured)
    assert choice.interval[0] <= choice.predicted <= choice.interval[1]
    assert 0 < choice.loo_error < 0.2
    # as many proxies as the law has numbers: no resample but of all of them fits, and those refit the
    # law itself, so no interval (it was one of zero width; of five sources, a crash after training)
    few_law, few = search.choose(rows[:5], samples=20)
    assert few.interval is None and few.shares_interval is None and few.loo_error is None
    few_shares, few_losses = search.arrays(rows[:5])
    assert plot_mixture(few_law, few, few_shares, few_losses, tmp_path / "few.png").stat().st_size > 0
    # the law is at its lowest at the choice: no proxy's mixture is predicted lower
    shares, _ = search.arrays(rows)
    assert choice.predicted <= law.target(shares, np.array([0.5, 0.5])).min() + 1e-9
    assert choice.mix.startswith("{project = ") and choice.mix.endswith("}")
    # a target of one source only moves the choice towards it
    _, stdlib_only = search.choose(rows, target={"stdlib": 1}, samples=20)
    assert stdlib_only.shares["stdlib"] > choice.shares["stdlib"] - 1e-6
    # a run so long that stdlib's few tokens would be repeated past 4 epochs caps its share (at 0.3,
    # or more where the caps of both would not reach 1: project's training tokens are this project's
    # own sources less those its validation split took, which moves with every edit of a large file)
    unique = search.unique_tokens
    cap = max(0.3, 1.1 * unique["stdlib"] / (unique["stdlib"] + unique["project"]))
    tokens = 4 * unique["stdlib"] / cap
    _, capped = search.choose(rows, target={"stdlib": 1}, tokens=tokens, samples=20)
    caps = {n: 4 * u / tokens for n, u in unique.items() if 4 * u / tokens < 1}
    assert capped.shares["stdlib"] <= cap + 1e-4 and capped.caps == pytest.approx(caps)
    assert caps["stdlib"] == pytest.approx(cap) and cap < 0.5
    with pytest.raises(ConfigError, match="give non-negative weights, not all zero, of the validation losses of "
                                          "project, stdlib"):
        search.choose(rows, target={"prose": 1})
    # the check trains a proxy on the chosen mixture and sets it against the prediction
    check = search.check(choice)
    assert check["run"] == "chosen-" + "-".join(f"{v:.3f}" for v in choice.shares.values())
    assert check["measured"] == pytest.approx(0.5 * check["loss_by_source"]["project"]
                                              + 0.5 * check["loss_by_source"]["stdlib"])
    assert check["error"] == pytest.approx(check["measured"] / choice.predicted - 1)
    assert abs(check["error"]) < 0.1


def test_a_search_interrupted_between_and_inside_runs_resumes_to_the_same_results(searched, mixture_root, tmp_path):
    _, whole = searched
    search = MixtureSearch(tmp_path / "resumed", settings(mixture_root))

    def stop_after_two(progress):
        if progress["done"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search.run(progress=stop_after_two)
    assert [row["name"] for row in search.results()] == ["mix-00", "mix-01"]
    # the third stopped half-way, at its checkpoint
    half = search.run_config(2)
    train(half, stop_at_step=half.train.steps // 2)
    kept = (search.out / "runs" / "mix-00" / "metrics.jsonl").read_text()
    rows = MixtureSearch(tmp_path / "resumed", settings(mixture_root)).run()
    assert [{k: v for k, v in row.items()} for row in rows] == whole
    assert (search.out / "runs" / "mix-00" / "metrics.jsonl").read_text() == kept  # not trained again
    assert read_metrics(half.run_dir, "resume"), "the half-trained proxy should have resumed from its checkpoint"
    with pytest.raises(ConfigError, match="was started with other settings \\(runs: 6 then, 7 now\\)"):
        MixtureSearch(tmp_path / "resumed", settings(mixture_root, runs=7))


def test_the_command_fits_a_finished_search_and_bad_input_is_refused(searched, mixture_root, tmp_path):
    search, _ = searched
    args = ["mixture", "--data", str(mixture_root), "--budget", "1e10", "--runs", "6", "--seq-len", "64",
            "--eval-tokens", "2048", "--min-steps", "20", "--device", "cpu", "--out", str(search.out)]
    result = run_cli(*args, "--target", "stdlib=3,project=1")
    assert result.returncode == 0, result.stderr
    assert "target loss 0.25·project + 0.75·stdlib" in result.stdout
    assert "scaletrain train CONFIG 'data.mix={project = " in result.stdout
    doc = json.loads((search.out / "mixture.json").read_text())
    assert doc["choice"]["target"] == {"project": 0.25, "stdlib": 0.75} and doc["check"] is None
    assert set(doc["law"]["validation"]) == {"project", "stdlib"} and (search.out / "mixture.png").is_file()
    # --predict-time: of the runs left (none here); of all, timed on a mixture, without writing --out
    result = run_cli(*args, "--predict-time")
    assert result.returncode == 0 and "has trained every run; nothing left to time" in result.stdout, result.stderr
    result = run_cli(*args[:-1], str(tmp_path / "new"), "--predict-time")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "for the 6 runs left of 6, 6e+10 FLOPs, 1 at once" in text and not (tmp_path / "new").exists()
    result = run_cli(*args, "--target", "stdlib")
    assert result.returncode != 0 and "'stdlib' is not NAME=WEIGHT (e.g. code=1,prose=3)" in result.stderr
    # A target naming no validation source is refused before any proxy trains (a new directory stays empty).
    result = run_cli(*args[:-1], str(tmp_path / "new"), "--target", "zzz=1")
    assert result.returncode == 2 and "(zzz is not one)" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "new" / "runs").exists()


@pytest.mark.parametrize("change, message", [
    ({"sources": ["stdlib", "nothing"]}, "--sources stdlib,nothing: data directory .* does not exist; .* "
                                         "\\(data directories under .*: project, stdlib\\)"),
    ({"sources": ["stdlib"]}, "a mixture search needs at least two sources"),
    ({"runs": 4}, "--runs 4: a law of 2 sources needs at least 5 runs"),
    ({"budget": 1e8}, "trains the proxy \\(d16-l1\\) for only \\d+ steps?, fewer than 20"),
    ({"data": "/nonexistent"}, "--data '/nonexistent' is not a directory"),
    ({"data": "STDLIB"}, "is itself a prepared data directory; give the directory that holds one"),
])
def test_bad_settings_are_refused_before_anything_trains(mixture_root, tmp_path, change, message):
    from dataclasses import replace

    if change.get("data") == "STDLIB":
        change = {"data": str(mixture_root / "stdlib")}
    with pytest.raises(ConfigError, match=message):
        MixtureSearch(tmp_path / "bad", replace(settings(mixture_root), **change))
    assert not (tmp_path / "bad").exists()


def test_a_sweep_measures_the_law_of_a_mixture(mixture_root, tmp_path):
    from scaletrain.config import load_config
    from scaletrain.sweep import Sweep, SweepSettings

    mix = {"project": 0.4, "stdlib": 0.6}

    def on(mixture):
        return SweepSettings(data=str(mixture_root), budgets=[2e10], shapes=2, seq_len=64, eval_tokens=2048,
                             min_steps=20, mix=mixture)

    sweep = Sweep(tmp_path / "sweep", on(mix))
    rows = sweep.run()
    assert len(rows) == 2
    for row in rows:
        for run_dir in (sweep.out / "points" / row["name"], sweep.out / "trunks" / row["shape"]):
            assert load_config(run_dir / "config.toml").data.mix == mix
        by_source = read_metrics(sweep.out / "points" / row["name"], "eval")[-1]["loss_by_source"]
        assert row["loss"] == pytest.approx(0.4 * by_source["project"] + 0.6 * by_source["stdlib"])
    with pytest.raises(ConfigError, match="was started with other settings \\(mix: "):
        Sweep(tmp_path / "sweep", on({"project": 0.5, "stdlib": 0.5}))
    with pytest.raises(ConfigError, match="with --mix: data directory .*nothing' does not exist"):
        Sweep(tmp_path / "other", on({"nothing": 1.0}))


def test_runs_on_other_mixtures_are_reported_and_compared_by_source(searched, tmp_path):
    from scaletrain.report.run import run_report

    search, rows = searched
    natural, corner = (search.out / "runs" / name for name in ("mix-00", "mix-02"))
    summary = run_report(natural)
    assert summary["val_loss_by_source"] == {"project": rows[0]["loss_project"], "stdlib": rows[0]["loss_stdlib"]}
    assert f"project {rows[0]['loss_project']:.4f}, stdlib {rows[0]['loss_stdlib']:.4f}" in (natural / "report.html").read_text()
    result = run_cli("compare", str(natural), str(corner), "--out", str(tmp_path / "compare.png"))
    assert result.returncode == 0, result.stderr
    assert "val project" in result.stdout and "val stdlib" in result.stdout
    assert "runs on other mixtures compare by source" in result.stdout
    # each source's column marks the run lower on that source's validation data
    lines = [line.split("│") for line in result.stdout.splitlines() if "mix-0" in line]
    for column, source in ((9, "project"), (10, "stdlib")):
        cells = [line[column].strip() for line in lines]
        values = [rows[0][f"loss_{source}"], rows[2][f"loss_{source}"]]
        assert [float(cell.rstrip(" *")) for cell in cells] == pytest.approx(values, abs=1e-4)
        assert [cell.endswith("*") for cell in cells] == [v == min(values) for v in values]


def test_a_target_domain_no_proxy_trains_on_sets_the_mixture(mixture_root, short_documents, tmp_path):
    from dataclasses import replace

    # short_documents: the standard library's Python cut into short documents, prepared apart
    search = MixtureSearch(tmp_path / "target", replace(settings(mixture_root, runs=5),
                                                        target_data=str(short_documents)))
    assert search.validation == ["project", "stdlib", "documents"]
    rows = search.run()
    for row in rows:
        cfg = search.run_config(int(row["name"][-2:]))
        assert set(cfg.data.mix) == {"project", "stdlib"}  # never trained on the target
        assert math.isfinite(row["loss_documents"])
    law, choice = search.choose(rows, samples=20)
    assert choice.target == {"project": 0.0, "stdlib": 0.0, "documents": 1.0}
    assert choice.loo_error is None  # 5 proxies, 5 numbers per source: none to spare
    assert law.validation == ["project", "stdlib", "documents"] and law.sources == ["project", "stdlib"]
    # the target is the standard library's code: more of it in training lowers its loss
    corners = {row["name"]: row["loss_documents"] for row in rows if row["name"] in ("mix-02", "mix-03")}
    assert corners["mix-03"] < corners["mix-02"]  # stdlib 0.98 against project 0.98
    assert choice.shares["stdlib"] > 0.5
    # a target prepared beside the sources is not a default source
    (tmp_path / "root").mkdir()
    for name, path in (("project", mixture_root / "project"), ("stdlib", mixture_root / "stdlib"),
                       ("documents", short_documents)):
        (tmp_path / "root" / name).symlink_to(path)
    assert sources_under(tmp_path / "root") == ["documents", "project", "stdlib"]
    assert sources_under(tmp_path / "root", str(tmp_path / "root" / "documents")) == ["project", "stdlib"]
    with pytest.raises(ConfigError, match="--target-data .* has the name of a source"):
        MixtureSearch(tmp_path / "clash", replace(settings(mixture_root), target_data=str(mixture_root / "stdlib")))


def test_a_source_prepared_without_training_text_is_said_and_refused_before_the_search_is_written(stdlib_data,
                                                                                                 tmp_path):
    """Three files sharing a long header: one goes to validation and the others, sharing 13-grams
    with it, are dropped; `data prepare` says the training split is empty, and a mixture search
    refuses the source before it writes anything."""
    from scaletrain.data import prepare

    header = "".join("# " + " ".join(f"word{10 * line + i}" for i in range(10)) + "\n" for line in range(4))
    (tmp_path / "text").mkdir()
    for i in range(3):
        (tmp_path / "text" / f"m{i}.py").write_text(header + f"def f{i}(x):\n    return x * {i} + {i}\n")
    root = tmp_path / "root"
    result = prepare([str(tmp_path / "text")], root / "empty", vocab_size=0, tokenizer=stdlib_data / "tokenizer.json",
                     workers=1)
    assert result.stats["tokens"]["train"] == 0
    assert any(w.startswith("the training split is empty: the 1 document(s) kept went to validation")
               for w in result.warnings)
    (root / "stdlib").symlink_to(stdlib_data)
    with pytest.raises(ConfigError, match="--sources: the training split of 'empty' holds 0 tokens, fewer than one "
                                          "sequence of --seq-len 64 . 1"):
        MixtureSearch(tmp_path / "search", MixtureSettings(data=str(root), sources=["empty", "stdlib"], budget=1e10,
                                                           seq_len=64, min_steps=20, device="cpu"))
    assert not (tmp_path / "search").exists()
