"""Scaling laws: fitters recover known laws, reproduce Epoch AI's refit of the Chinchilla points,
and the optima they imply match hand-solved cases."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import ROOT, run_cli
from scaletrain.scaling.fit import (LAW_PARAMETERS, Points, backtest, bootstrap_laws, bootstrap_parametric,
                                   budget_minima, envelope_minima, fit_all, fit_allocation, fit_parametric, interval,
                                   law_of, read_points)
from scaletrain.scaling.laws import ChinchillaLaw, KaplanLaw, preset
from scaletrain.scaling.optimal import (R_STAR_D, compute_optimal, data_constrained_loss, data_constrained_optimal,
                                        effective_data, inference_optimal, predict)

CHINCHILLA = ROOT.parent / "shared" / "data" / "chinchilla_fig4_points.csv"
TRUTH = ChinchillaLaw(E=1.7, A=400.0, B=1500.0, alpha=0.34, beta=0.37)


def isoflop_points(law: ChinchillaLaw, budgets=(1e18, 1e19, 1e20, 1e21), shapes: int = 7, noise: float = 0.002,
                   seed: int = 0) -> Points:
    """Each budget's shapes spaced evenly in log N over 10x around the law's optimum; loss with
    multiplicative noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in budgets:
        n_opt, _ = law.optimum(c)
        for n in np.geomspace(n_opt / math.sqrt(10), n_opt * math.sqrt(10), shapes):
            d = c / (6 * n)
            rows.append((n, d, c, law.loss(n, d) * math.exp(rng.normal(0, noise)), c))
    return Points(*map(np.array, zip(*rows)))


def test_approach_3_recovers_a_known_law_from_noisy_isoflop_points():
    points = isoflop_points(TRUTH)
    law = fit_parametric(points)
    assert law.E == pytest.approx(TRUTH.E, abs=0.05)
    assert law.alpha == pytest.approx(TRUTH.alpha, abs=0.03)
    assert law.beta == pytest.approx(TRUTH.beta, abs=0.03)
    assert law.exponents[0] == pytest.approx(TRUTH.exponents[0], abs=0.02)
    boot = bootstrap_parametric(points, law, samples=20)
    low, high = interval([sample.exponents[0] for sample in boot])
    assert low < high and low - 0.01 <= TRUTH.exponents[0] <= high + 0.01


def test_an_exponent_the_points_press_to_the_edge_of_its_search_is_said(tmp_path, capsys):
    """Losses that fall as D^-8 (runs of a few hundred tokens): beta goes to the bound of 5, and the
    law it gives (D_opt of a few tokens) is not one to plan with; a law the points set is not flagged."""
    from scaletrain.cli import main

    rows = [(n, c / (6 * n), c, 2.0 + 400 / n ** 0.34 + 1e16 / (c / (6 * n)) ** 8)
            for c in (1e10, 3e10, 1e11) for n in np.geomspace(1e5, 1e7, 5)]
    (tmp_path / "steep.csv").write_text("n,d,c,loss\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    assert main(["fit", "--points", str(tmp_path / "steep.csv"), "--bootstrap", "5", "--out", str(tmp_path)]) == 0
    assert "approach 3's beta = 5 lies at the edge of its search (0.001 to 5): the points do not set it" in " ".join(
        capsys.readouterr().err.split())
    assert json.loads((tmp_path / "law.json").read_text())["approach3"]["at_bounds"] == ["beta"]
    assert fit_all(isoflop_points(TRUTH), samples=5)["approach3"]["at_bounds"] == []


def test_approaches_1_and_2_recover_the_compute_exponents():
    points = isoflop_points(TRUTH, shapes=9, noise=0.0005)
    a_true, b_true = TRUTH.exponents
    for parabola, tolerance in ((False, 0.06), (True, 0.02)):  # the lowest point is a coarser estimate
        allocation = fit_allocation(points, parabola)
        assert allocation.budgets == 4
        assert allocation.a == pytest.approx(a_true, abs=tolerance)
        assert allocation.b == pytest.approx(b_true, abs=tolerance)


def test_the_backtest_measures_how_the_law_extrapolates_on_its_own_points():
    points = isoflop_points(TRUTH, budgets=(1e18, 3e18, 1e19, 3e19, 1e20), shapes=5)
    rows = backtest(points)
    assert [round(row["extrapolation"], 1) for row in rows] == [3.3, 10.0, 33.3]
    assert all(abs(row["error"]) < 0.01 for row in rows)  # the form holds: extrapolation is right
    # A largest budget that reaches 5% below the law fitted on the others: every row says so.
    bent = np.where(points.budget == 1e20, points.loss * 0.95, points.loss)
    rows = backtest(Points(points.n, points.d, points.c, bent, points.budget))
    assert [row["error"] for row in rows] == [pytest.approx(-0.05, abs=0.01)] * 3
    assert rows[0]["loss"] == bent[points.budget == 1e20].min()
    assert backtest(isoflop_points(TRUTH, budgets=(1e18, 1e19))) == []  # nothing left to fit on


def early_bent_points(batch_tokens: float = 2e6) -> tuple[Points, float]:
    """IsoFLOP points from TRUTH with steps = D / batch, the shorter half 4% above the law (the
    steep start of training), and that half's bound in steps."""
    points = isoflop_points(TRUTH, budgets=(1e18, 1e19, 1e20, 1e21), shapes=7)
    steps = np.round(points.d / batch_tokens)
    threshold = float(np.median(steps))
    loss = np.where(steps < threshold, points.loss * 1.04, points.loss)
    return Points(points.n, points.d, points.c, loss, points.budget, steps), threshold


def test_approach_3_can_be_fitted_to_the_longer_runs_only():
    points, threshold = early_bent_points()
    longer = points.steps >= threshold
    doc = fit_all(points, samples=5, law_min_steps=int(threshold))
    assert doc["points"] == len(points) and doc["approach3"]["points"] == longer.sum() < len(points)
    assert doc["approach3"]["min_steps"] == int(threshold)
    assert doc["approach3"]["alpha"]["value"] == pytest.approx(TRUTH.alpha, abs=0.03)
    assert doc["approach2"]["budgets"] == 4  # approaches 1 and 2 keep every point: whole profiles
    # 100x beyond the sweep the law of the longer runs predicts the truth; the bent short runs
    # pull the law of every point off it.
    n, d = TRUTH.optimum(1e23)
    assert law_of(doc).loss(n, d) == pytest.approx(TRUTH.loss(n, d), rel=0.01)
    assert abs(fit_parametric(points).loss(n, d) / TRUTH.loss(n, d) - 1) > 0.015
    with pytest.raises(ValueError, match="approach 3 needs 6 points in 2 budgets"):
        fit_all(points, samples=5, law_min_steps=int(points.steps.max()))
    with pytest.raises(ValueError, match="these points have none"):
        fit_all(Points(points.n, points.d, points.c, points.loss, points.budget), law_min_steps=10)


def test_approach_2_takes_d_opt_at_the_vertexs_own_flops_per_parameter_token():
    """Exact FLOPs per parameter-token differ between shapes (5, 6, 7 here): D_opt at the vertex
    (the largest size) is C / (7 N), not C over the budget's median ratio times N."""
    n = np.array([1e6, 2e6, 4e6])
    ratio = np.array([5.0, 6.0, 7.0])
    c = np.full(3, 1e18)
    loss = 3 + (np.log(n) - math.log(4e6)) ** 2
    budgets, n_opt, d_opt = budget_minima(Points(n, c / (ratio * n), c, loss, budget=c), parabola=True)
    assert n_opt[0] == pytest.approx(4e6) and d_opt[0] == pytest.approx(1e18 / (7 * 4e6))


def test_approach_2_needs_isoflop_profiles():
    points = isoflop_points(TRUTH, budgets=(1e19,))
    with pytest.raises(ValueError, match="at least 2 budgets"):
        fit_allocation(points, parabola=True)


@pytest.mark.skipif(not CHINCHILLA.is_file(), reason=f"reference data {CHINCHILLA} is absent (it lives in the "
                                                     "workplace's shared/ folder, not in the repository)")
def test_the_chinchilla_points_reproduce_epoch_ais_refit():
    points = read_points(CHINCHILLA, drop_highest=5)
    assert len(points) == 240
    law = fit_parametric(points)
    assert law.E == pytest.approx(1.817, abs=0.01)
    assert law.alpha == pytest.approx(0.3473, abs=0.005)
    assert law.beta == pytest.approx(0.3672, abs=0.01)
    assert law.A == pytest.approx(477.8, rel=0.05)
    assert law.B == pytest.approx(2143.9, rel=0.05)


def test_the_closed_form_optimum_is_the_minimum_on_the_compute_frontier():
    law = preset("epoch")
    compute = 1e22
    n_opt, d_opt = law.optimum(compute)
    assert 6 * n_opt * d_opt == pytest.approx(compute)
    for factor in (0.8, 1.25):
        n = n_opt * factor
        assert law.loss(n, compute / (6 * n)) > law.loss(n_opt, d_opt)
    assert law.exponents[0] + law.exponents[1] == pytest.approx(1.0)


def test_inference_aware_sizing_matches_a_hand_solved_case():
    """L = 1/N + 1/D: the compute-optimal model at C = 24 is N = D = 2 (loss 1). With 9
    inference tokens, minimising 6ND + 2N·9 on 1/N + 1/D = 1 gives 6N(N − 2)/(N − 1)² = −18,
    i.e. N = 1.5, D = 3."""
    law = ChinchillaLaw(E=0.0, A=1.0, B=1.0, alpha=1.0, beta=1.0)
    best, reference = inference_optimal(law, 24.0, 9.0)
    assert (reference.n, reference.d, reference.loss) == pytest.approx((2.0, 2.0, 1.0))
    assert (best.n, best.d, best.loss) == pytest.approx((1.5, 3.0, 1.0), rel=1e-6)
    assert best.lifetime_flops == pytest.approx(6 * 1.5 * 3 + 2 * 1.5 * 9)
    assert reference.lifetime_flops == pytest.approx(24 + 36)
    unchanged, _ = inference_optimal(law, 24.0, 0.0)  # without inference: the compute-optimal model
    assert (unchanged.n, unchanged.d) == pytest.approx((2.0, 2.0), rel=1e-6)


def test_data_constrained_sizing():
    unique = 1e9
    assert effective_data(unique, 5e8) == 5e8  # no repetition: every token counts
    four_epochs = effective_data(unique, 4e9)  # R = 3 repetitions
    assert four_epochs == pytest.approx(unique * (1 + R_STAR_D * (1 - math.exp(-3 / R_STAR_D))))
    assert 3.7e9 < four_epochs < 4e9  # up to ~4 epochs repeated data is nearly as good as new
    assert effective_data(unique, 1e15) == pytest.approx(unique * (1 + R_STAR_D), rel=1e-3)  # the limit
    law = preset("epoch")
    compute = 1e22
    free = compute_optimal(law, compute)
    plenty = data_constrained_optimal(law, compute, unique_tokens=1e16)
    assert (plenty.n, plenty.loss) == pytest.approx((free.n, free.loss), rel=1e-4)
    scarce = data_constrained_optimal(law, compute, unique_tokens=free.d / 10)
    assert scarce.d > free.d / 10  # it repeats data ...
    assert scarce.loss > free.loss  # ... and loses something for it
    assert scarce.loss == pytest.approx(data_constrained_loss(law, scarce.n, scarce.d, free.d / 10))
    assert scarce.loss <= data_constrained_loss(law, free.n, free.d, free.d / 10)  # better than ignoring the limit


def test_data_used_up_long_before_the_compute_is_refused_not_answered_with_the_searchs_edge():
    with pytest.raises(ValueError, match="1 unique tokens are too few for 1e.21 FLOPs"):
        data_constrained_optimal(preset("epoch"), 1e21, unique_tokens=1)


def test_points_and_laws_no_fit_writes_are_refused_and_repeated_points_said(tmp_path, caplog):
    rows = "n,c,loss,budget\n1e6,1e12,3.0,1e12\n2e6,1e12,3.1,1e12\n"
    for row, words in [("4e6,inf,3.2,1e12", "line 4, column c: inf is not a positive count"),
                       ("4e6,1e12,3.2,nan", "line 4, column budget: nan is not a positive count"),
                       ("4e6,1e12,3.2,-5", "line 4, column budget: -5 is not a positive count")]:
        (tmp_path / "points.csv").write_text(rows + row + "\n")
        with pytest.raises(ValueError, match=words):
            read_points(tmp_path / "points.csv")
    (tmp_path / "points.csv").write_text(rows + "1e6,1e12,3.0,1e12\n")
    assert len(read_points(tmp_path / "points.csv").n) == 3
    assert "1 of its points repeat another's N, D and loss" in caplog.text
    law = {name: {"value": value} for name, value in zip(LAW_PARAMETERS, (1.7, 400.0, 1500.0, 0.34, 0.37))}
    spans = {"compute": [1e12, 1e15], "n": [1e6, 1e8], "d": [1e6, 1e9]}
    assert law_of({"approach3": {**law, "range": spans}, "data": {"path": "data/x", "mix": None}}).E == 1.7
    for doc, words in [({"approach3": {**law, "range": {**spans, "compute": [1]}}}, r"range.compute is \[1\]"),
                       ({"approach3": {**law, "range": "x"}}, "approach3.range.compute is None"),
                       ({"approach3": {**law, "range": {**spans, "n": [0, 0]}}}, r"range.n is \[0, 0\], not the"),
                       ({"approach3": law, "data": "data/x"}, "data is 'data/x', not the sweep's data directory")]:
        with pytest.raises(ValueError, match=words):
            law_of(doc)


def test_parameters_beyond_the_optimum_for_the_data_decay_like_repeated_data():
    """With A = B and α = β = 1/2 the compute-optimal N for D tokens is D itself, so with U
    unique tokens a model of 3U parameters has R_N = 2 excess "repetitions" of parameters:
    N' = U (1 + R*_N (1 − exp(−2 / R*_N)))."""
    from scaletrain.scaling.optimal import R_STAR_N, effective_parameters

    law = ChinchillaLaw(E=1.0, A=100.0, B=100.0, alpha=0.5, beta=0.5)
    unique = 1e9
    assert effective_parameters(law, unique, 5e8) == 5e8  # below the optimum: every parameter counts
    assert effective_parameters(law, unique, 3e9) == pytest.approx(unique * (1 + R_STAR_N * (1 - math.exp(-2 / R_STAR_N))))
    assert data_constrained_loss(law, 3e9, 5e8, unique) == pytest.approx(
        law.loss(unique * (1 + R_STAR_N * (1 - math.exp(-2 / R_STAR_N))), 5e8))


def test_published_laws_carry_their_provenance_and_predict():
    assert "Hoffmann" in preset("hoffmann").source and "Epoch" in preset("epoch").source
    kaplan = preset("kaplan")
    assert isinstance(kaplan, KaplanLaw) and kaplan.loss(1e9, 1e10) > kaplan.loss(1e10, 1e11) > 0
    # Their table 2's joint fit (α_N 0.076, α_D 0.103, N_c 6.4e13, D_c 1.8e13), worked by hand:
    # (64,000^0.738 + 900)^0.103 = (3,521 + 900)^0.103 = 2.374; and without a limit on N, (D_c / D)^α_D.
    assert kaplan.loss(1e9, 2e10) == pytest.approx(2.374, abs=1e-3)
    assert kaplan.loss(1e30, 1.8e14) == pytest.approx(0.1 ** 0.103, rel=1e-6)
    with pytest.raises(ValueError, match="choose one of hoffmann, epoch, kaplan"):
        preset("gpt")
    boot = [ChinchillaLaw(E=1.7 + 0.01 * i, A=400.0, B=1500.0, alpha=0.34, beta=0.37) for i in range(-5, 6)]
    result = predict(TRUTH, 1e21, boot)
    assert result["loss_interval"][0] < result["loss"] < result["loss_interval"][1]


def test_plots_and_predictions_survive_a_degenerate_bootstrap_resample(tmp_path):
    """A resample of few points can fit exponents near 0, whose optimum is astronomical or
    overflows either way: the plots cut the band off and the prediction's intervals keep to the
    finite samples, instead of failing (as the plots did on a 6-point sweep)."""
    from scaletrain.report.scaling import plot_fit

    points = isoflop_points(TRUTH, budgets=(1e18, 1e19), shapes=3)
    doc = fit_all(points, samples=3)
    doc["bootstrap"] += [[0.0, 7.4, 5.7, 0.0005, 0.0005], [0.0, 400.0, 5.7, 0.0005, 0.0005],
                         [0.0, 5.7, 400.0, 0.0005, 0.0005]]
    laws = bootstrap_laws(doc)
    assert laws[-3].optimum(1e20)[0] > 1e120  # finite, but beyond what a log axis can tick
    assert laws[-2].optimum(1e20) == (math.inf, 0.0)  # beyond a float: no OverflowError
    assert laws[-1].optimum(1e20) == (0.0, math.inf)  # and the other way
    assert laws[-2].loss(math.inf, 0.0) == laws[-1].loss(0.0, math.inf) == math.inf
    paths = plot_fit(points, doc, tmp_path)
    assert [p.name for p in paths] == ["isoflop.png", "optimal.png", "contours.png", "residuals.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    prediction = predict(law_of(doc), 1e20, laws)
    fits = [compute_optimal(law, 1e20) for law in laws[:-2]]  # those with an optimum within a float
    assert prediction["loss_interval"][0] >= min(c.loss for c in fits) - 1e-12
    assert prediction["loss_interval"][1] <= max(c.loss for c in fits) + 1e-12
    assert all(math.isnan(x) for x in interval([math.inf, math.nan]))  # nothing finite: no interval


def test_fit_command_writes_the_law_and_plots_and_predicts(tmp_path):
    points, threshold = early_bent_points()  # approach 3 on the longer runs only (--min-steps)
    lines = ["n,d,c,loss,budget,steps"] + [",".join(map(str, row)) for row in
                                           zip(points.n, points.d, points.c, points.loss, points.budget, points.steps)]
    (tmp_path / "results.csv").write_text("\n".join(lines) + "\n")
    result = run_cli("fit", str(tmp_path), "--bootstrap", "10", "--predict", "1e22", "--inference-tokens", "1e12",
                     "--unique-tokens", "1e10", "--min-steps", str(int(threshold)))
    assert result.returncode == 0, result.stderr
    doc = json.loads((tmp_path / "law.json").read_text())
    assert doc["approach3"]["points"] == (points.steps >= threshold).sum() < len(points)
    assert f">= {int(threshold)} steps" in result.stdout
    assert doc["approach3"]["alpha"]["value"] == pytest.approx(TRUTH.alpha, abs=0.03)
    assert doc["approach2"]["a"]["low"] <= doc["approach2"]["a"]["value"] <= doc["approach2"]["a"]["high"]
    # The backtest, on the fitted points: 2 budgets of the longer half leave too few below 1e20.
    assert [row["fitted_up_to"] for row in doc["backtest"]] == [1e20] and "backtest" in result.stdout
    prediction = doc["predictions"][0]
    assert prediction["compute"] == 1e22 and prediction["inference_aware"]["saved_fraction"] > 0
    assert prediction["data_constrained"]["epochs"] > 1
    for name in ("isoflop", "optimal", "contours", "residuals"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert "N_opt" in result.stdout


def test_fit_says_when_an_approach_used_fewer_budgets_than_the_points_have(tmp_path, capsys):
    from scaletrain.cli import main

    points = isoflop_points(TRUTH, budgets=(1e18, 1e19, 1e20), shapes=5)
    n_opt, _ = TRUTH.optimum(1e21)  # a fourth budget of two sizes: no parabola has a minimum inside
    rows = [*zip(points.n, points.d, points.c, points.loss),
            *((n, 1e21 / (6 * n), 1e21, TRUTH.loss(n, 1e21 / (6 * n))) for n in (n_opt / 2, n_opt * 2))]
    (tmp_path / "points.csv").write_text("n,d,c,loss\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    assert main(["fit", "--points", str(tmp_path / "points.csv"), "--bootstrap", "5", "--out", str(tmp_path)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "approach 2 a (3 of the 4 budgets: the others lack a profile)" in text
    assert json.loads((tmp_path / "law.json").read_text())["approach2"]["budgets"] == 3


@pytest.mark.parametrize("args, words", [
    (["--points", "nope.csv"], "no points file"),
    (["--points", "{bad}"], "has no column for loss"),
    ([], "give a sweep directory or --points CSV"),
    (["--preset", "kaplan", "--predict", "1e21"], "has no E + A/N"),
    (["--preset", "epoch", "--points", "x.csv", "--predict", "1e21"], "not from fitted points"),
    (["--preset", "epoch", "--inference-tokens", "1e12"], "add --predict C"),
    (["--points", "{bad}", "--min-steps", "-1"], "argument --min-steps: '-1' must be 0 or more"),
    (["--preset", "epoch", "--predict", "1e21", "--unique-tokens", "1"], "1 unique tokens are too few for 1e+21 FLOPs"),
])
def test_fit_command_refuses_bad_input_in_one_line(tmp_path, args, words):
    bad = tmp_path / "bad.csv"
    bad.write_text("n,c\n1e6,1e15\n")
    result = run_cli("fit", *[a.replace("{bad}", str(bad)) for a in args])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert words in result.stderr


def test_approach_1_follows_the_lower_envelope_between_budgets():
    """Two sizes whose loss curves cross between budgets 1e10 and 1e11: the envelope switches
    from the small to the large size where the interpolated curves cross, not at a budget."""
    rows = [(1e5, 3.0, 1e10), (1e5, 2.8, 1e11), (1e5, 2.7, 1e12),  # small: better at 1e10 only
            (4e5, 3.2, 1e10), (4e5, 2.75, 1e11), (4e5, 2.5, 1e12),
            (9e5, 2.9, 1e12)]  # a third size at the last budget only
    n, loss, c = map(np.array, zip(*rows))
    points = Points(n, c / (6 * n), c, loss, c)
    where, n_opt, d_opt = envelope_minima(points, grid=19)
    assert where[0] == pytest.approx(1e10) and where[-1] == pytest.approx(1e12)
    # Crossing: log(3.0) + t (log 2.8 - log 3.0) = log(3.2) + t (log 2.75 - log 3.2), t in [0, 1].
    t = (math.log(3.2) - math.log(3.0)) / ((math.log(3.2) - math.log(3.0)) + (math.log(2.8) - math.log(2.75)))
    crossing = 1e10 * 10 ** t
    assert all(n_opt[where < crossing] == 1e5) and all(n_opt[where > crossing] == 4e5)
    assert 1e10 < crossing < 1e11 and (where < crossing).sum() > 1  # strictly between the budgets
    assert d_opt == pytest.approx(where / (6 * n_opt))
    allocation = fit_allocation(points, parabola=False)
    assert allocation.budgets == 3 and allocation.a > 0
