"""Fitting scaling laws to (N, D, C, loss) points, three ways (Hoffmann et al. 2022, section 3),
each with bootstrap confidence intervals.

- Approach 1: for each compute budget the point of lowest loss (the lower envelope of loss
  against compute); N_opt ∝ C^a and D_opt ∝ C^b fitted to those minima in log space.
- Approach 2: for each budget a parabola of loss in log N (an IsoFLOP profile); its minimum is
  that budget's N_opt; then the same power laws.
- Approach 3: L(N, D) = E + A/N^α + B/D^β, fitted as Besiroglu et al. 2024 (Epoch AI) refit
  Hoffmann et al.: log L̂ = LSE(a − α log N, b − β log D, e) with A = eᵃ, B = eᵇ, E = eᵉ, a sum
  of Huber terms (δ = 1e-3) on log-loss residuals, minimised by L-BFGS from a grid of starts.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from scaletrain.scaling.laws import ChinchillaLaw

log = logging.getLogger("scaletrain")

HUBER_DELTA = 1e-3
# a, b, e free; the exponents kept positive, so every fit has a finite compute-optimal allocation
# (unbounded, a few noisy points can fit a negative exponent).
BOUNDS = [(None, None), (None, None), (None, None), (1e-3, 5.0), (1e-3, 5.0)]
# Epoch AI's grid of initialisations: α, β ∈ {0, 0.5, …, 2}, e ∈ {−1, −0.5, …, 1}, a, b ∈ {0, 5, …, 25}.
GRID = {"a": np.arange(0, 30, 5.0), "b": np.arange(0, 30, 5.0), "e": np.arange(-1, 1.5, 0.5),
        "alpha": np.arange(0, 2.5, 0.5), "beta": np.arange(0, 2.5, 0.5)}


@dataclass
class Points:
    """Training runs: parameters N, tokens D, compute C (FLOPs), final loss, the budget
    (IsoFLOP group) each belongs to, and (when known) the optimizer steps each took."""

    n: np.ndarray
    d: np.ndarray
    c: np.ndarray
    loss: np.ndarray
    budget: np.ndarray = field(default=None)  # type: ignore[assignment]
    steps: np.ndarray | None = None

    def __post_init__(self):
        self.n, self.d, self.c, self.loss = (np.asarray(v, dtype=float) for v in (self.n, self.d, self.c, self.loss))
        if self.budget is None:
            self.budget = group_budgets(self.c)
        self.budget = np.asarray(self.budget, dtype=float)
        if self.steps is not None:
            self.steps = np.asarray(self.steps, dtype=float)
        bad = ~(np.isfinite(self.n) & np.isfinite(self.d) & np.isfinite(self.loss) & (self.n > 0) & (self.d > 0)
                & (self.loss > 0))
        if bad.any():
            raise ValueError(f"{int(bad.sum())} of {len(self.n)} points have a non-positive or non-finite N, D or "
                             "loss; every point needs N > 0, D > 0 and a finite loss > 0")

    @classmethod
    def from_rows(cls, rows: list[dict]) -> Points:
        """Points from a sweep's result rows (dicts with n, d, c, loss, budget and steps)."""
        steps = [row.get("steps") for row in rows]
        return cls(*([row[key] for row in rows] for key in ("n", "d", "c", "loss", "budget")),
                   steps=None if None in steps else steps)

    def __len__(self) -> int:
        return len(self.n)

    def take(self, index: np.ndarray) -> Points:
        return Points(self.n[index], self.d[index], self.c[index], self.loss[index], self.budget[index],
                      None if self.steps is None else self.steps[index])

    def trained_at_least(self, steps: int) -> Points:
        """The points that took at least `steps` optimizer steps (all of them for steps <= 0)."""
        if steps <= 0:
            return self
        if self.steps is None:
            raise ValueError(f"leaving out points shorter than {steps} steps needs each point's steps; these points "
                             "have none (a sweep's results.csv has a steps column)")
        return self.take(np.flatnonzero(self.steps >= steps))


def group_budgets(compute: np.ndarray, gap_dex: float = 0.05) -> np.ndarray:
    """Each point's budget: points whose log10 C lie within gap_dex of a neighbour form one
    IsoFLOP group, labelled by the group's median C."""
    log_c = np.log10(compute)
    order = np.argsort(log_c)
    labels = np.empty(len(compute))
    start = 0
    for i in range(1, len(order) + 1):
        if i == len(order) or log_c[order[i]] - log_c[order[i - 1]] > gap_dex:
            members = order[start:i]
            labels[members] = np.median(compute[members])
            start = i
    return labels


# -- approach 3 ---------------------------------------------------------------------------------


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray):
    """Sum of Huber terms of log-loss residuals, and its gradient in (a, b, e, α, β)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, points)
    # log-sum-exp and softmax by hand: SciPy's checks cost more than the arithmetic here, and
    # L-BFGS calls this thousands of times a fit.
    top = terms.max(axis=0)
    exp = np.exp(terms - top)
    total = exp.sum(axis=0)
    residual = top + np.log(total) - log_loss
    small = np.abs(residual) <= HUBER_DELTA
    value = np.where(small, 0.5 * residual ** 2, HUBER_DELTA * (np.abs(residual) - 0.5 * HUBER_DELTA)).sum()
    slope = np.clip(residual, -HUBER_DELTA, HUBER_DELTA)  # d huber / d residual
    w = exp / total * slope  # d residual / d term (the softmax of the terms), times the slope
    grad = np.array([w[0].sum(), w[1].sum(), w[2].sum(), -(w[0] * log_n).sum(), -(w[1] * log_d).sum()])
    return value, grad


def _law(theta: np.ndarray, source: str) -> ChinchillaLaw:
    a, b, e, alpha, beta = theta
    return ChinchillaLaw(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=float(alpha),
                         beta=float(beta), source=source)


# L-BFGS-B's default tolerances (a gradient of 1e-5, a relative decrease of 2e-9) stop it early
# on this objective, whose Huber terms are at most δ·|residual| ~ 1e-5 a point: from the grid's
# best 32 starts, points drawn exactly from a law were fitted with E 2.25 and α 0.86 for 1.7 and
# 0.34. Run to convergence, every start reaches the law (tests/test_scaling.py).
TOLERANCES = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 15000}


def _minimise(points: Points, starts: np.ndarray) -> np.ndarray:
    log_n, log_d, log_loss = np.log(points.n), np.log(points.d), np.log(points.loss)
    best, best_value = None, np.inf
    for start in starts:
        result = minimize(_objective, start, args=(log_n, log_d, log_loss), jac=True, method="L-BFGS-B",
                          bounds=BOUNDS, options=TOLERANCES)
        if result.fun < best_value:
            best, best_value = result.x, result.fun
    if best is None:
        raise ValueError(f"approach 3 reached no finite objective from {len(starts)} starts on {len(points)} points")
    return best


_STARTS = np.array(list(itertools.product(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"])))


def _objectives(starts: np.ndarray, points: Points) -> np.ndarray:
    """The objective at each of `starts` (rows of a, b, e, α, β) at once."""
    log_n, log_d, log_loss = np.log(points.n), np.log(points.d), np.log(points.loss)
    a, b, e, alpha, beta = (starts[:, i:i + 1] for i in range(5))  # each (starts, 1)
    predicted = np.logaddexp(np.logaddexp(a - alpha * log_n, b - beta * log_d), e)  # (starts, points)
    residual = np.abs(predicted - log_loss)
    return np.where(residual <= HUBER_DELTA, 0.5 * residual ** 2,
                    HUBER_DELTA * (residual - 0.5 * HUBER_DELTA)).sum(axis=1)


PROJECTED_EXPONENTS = np.arange(0.05, 2.001, 0.05)


def _projected_starts(points: Points, count: int) -> np.ndarray:
    """Starts from variable projection: for fixed α and β the law is linear in E, A and B, so
    on a 40 x 40 grid of (α, β) they come from one least-squares solve each (of relative
    residuals, close to the log residuals fitted); the `count` of lowest objective with E, A,
    B all positive are returned. They sit in the right valley far more often than the fixed
    grid's best, which leaves less for L-BFGS to do."""
    log_n, log_d = np.log(points.n), np.log(points.d)
    weight = 1.0 / points.loss
    exps = PROJECTED_EXPONENTS
    columns = np.broadcast_arrays(weight[None, None, :],  # (alpha, beta, points) each
                                  (np.exp(-exps[:, None] * log_n[None, :]) * weight)[:, None, :],
                                  (np.exp(-exps[:, None] * log_d[None, :]) * weight)[None, :, :])
    design = np.stack(columns, axis=-1)  # (alpha, beta, points, 3): E, A, B
    normal = np.einsum("ijpk,ijpl->ijkl", design, design) + 1e-12 * np.eye(3)
    try:
        coefficients = np.linalg.solve(normal, design.sum(axis=2)[..., None])[..., 0]  # (alpha, beta, 3)
    except np.linalg.LinAlgError:  # e.g. a single model size: the grid's starts will do
        return np.empty((0, 5))
    alpha, beta = np.meshgrid(exps, exps, indexing="ij")
    feasible = (coefficients > 0).all(axis=-1)
    if not feasible.any():
        return np.empty((0, 5))
    e, a, b = (np.log(coefficients[..., k][feasible]) for k in range(3))
    starts = np.stack([a, b, e, alpha[feasible], beta[feasible]], axis=1)
    return starts[np.argsort(_objectives(starts, points))[:count]]


def fit_parametric(points: Points, starts: int | None = 32, also: ChinchillaLaw | None = None,
                   projected: int = 8) -> ChinchillaLaw:
    """Approach 3. L-BFGS runs from the `starts` grid points of lowest objective (from all
    4,500 when starts is None), from the `projected` best starts of a variable projection
    (_projected_starts), and from `also`'s parameters when given; the lowest minimum wins.
    (Evaluating the grid costs milliseconds, running from every start a minute. On the
    Chinchilla points, on synthetic laws and on the CPU demo's sweeps, the projected starts
    alone reach the minimum that the grid's best 32 reach, in a fifth of the time.)"""
    grid = _STARTS
    if starts is not None and starts < len(grid):
        grid = grid[np.argsort(_objectives(grid, points))[:starts]]
    if projected:
        grid = np.vstack([grid, _projected_starts(points, projected)])
    if also is not None:
        grid = np.vstack([grid, [np.log(also.A), np.log(also.B), np.log(also.E), also.alpha, also.beta]])
    if not len(grid):  # starts=0 and no other start: the grid's best
        grid = _STARTS[[int(np.argmin(_objectives(_STARTS, points)))]]
    return _law(_minimise(points, grid), f"approach 3 on {len(points)} points")


# -- approaches 1 and 2 ---------------------------------------------------------------------------


def _power_law(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(exponent, coefficient) of y = coefficient · x^exponent, least squares in log space."""
    exponent, log_coefficient = np.polyfit(np.log(x), np.log(y), 1)
    return float(exponent), float(np.exp(log_coefficient))


def envelope_minima(points: Points, grid: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Approach 1 (Hoffmann et al. 2022): (C, N_opt, D_opt) along the lower envelope of loss
    against compute. Each model size's loss is known at the budgets it was trained to (its
    cooldown branches, or separate runs) and interpolated linearly in log C – log L between
    them; at every budget and at `grid` compute values spaced evenly in log between the
    smallest and largest budget, the size of lowest loss among those covering that compute (at
    least 2) is N_opt, and D_opt = C / (its FLOPs per token). (A WSD trunk's loss before its
    cooldown is not that of a finished run, so branches stand in for Chinchilla's training
    curves.) Where no size spans two budgets this is the lowest point of each budget."""
    curves = []
    for n in np.unique(points.n):
        mine = points.n == n
        order = np.argsort(points.budget[mine], kind="stable")
        flops_per_token = float(np.median(points.c[mine] / points.d[mine]))
        curves.append((float(n), np.log(points.budget[mine][order]), np.log(points.loss[mine][order]), flops_per_token))
    budgets = np.log(np.unique(points.budget))
    where = np.union1d(budgets, np.linspace(budgets[0], budgets[-1], grid))
    c_opt, n_opt, d_opt = [], [], []
    for x in where:
        covering = [(float(np.interp(x, xs, ys)), n, per_token) for n, xs, ys, per_token in curves
                    if xs[0] - 1e-9 <= x <= xs[-1] + 1e-9]
        if len(covering) < 2:
            continue
        _, n, per_token = min(covering)
        c_opt.append(math.exp(x))
        n_opt.append(n)
        d_opt.append(math.exp(x) / per_token)
    return np.array(c_opt), np.array(n_opt), np.array(d_opt)


def budget_minima(points: Points, parabola: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(C, N_opt, D_opt) of each budget with at least 3 model sizes: the lowest-loss point
    (parabola=False) or the vertex of a parabola of loss in log N (approach 2, D_opt = C /
    (FLOPs per parameter-token · N_opt), that ratio interpolated between the points' own)."""
    budgets, n_opt, d_opt = [], [], []
    for budget in np.unique(points.budget):
        group = points.budget == budget
        if len(np.unique(points.n[group])) < 3:  # (a bootstrap resample may repeat points)
            continue
        n, d, c, loss = points.n[group], points.d[group], points.c[group], points.loss[group]
        if parabola:
            curvature, slope, _ = np.polyfit(np.log(n), loss, 2)
            if curvature <= 0:  # no minimum inside: this budget's profile says nothing about the optimum
                continue
            best_n = float(np.exp(-slope / (2 * curvature)))
            # FLOPs per parameter-token vary with the shape (attention and the head's share):
            # take them at the vertex, interpolated in log N between the budget's sizes.
            order = np.argsort(n, kind="stable")
            flops_per_param_token = math.exp(float(np.interp(math.log(best_n), np.log(n[order]),
                                                             np.log(c[order] / (n[order] * d[order])))))
            best_d = float(np.median(c)) / (flops_per_param_token * best_n)
        else:
            i = int(np.argmin(loss))
            best_n, best_d = float(n[i]), float(d[i])
        budgets.append(float(np.median(c)))
        n_opt.append(best_n)
        d_opt.append(best_d)
    return np.array(budgets), np.array(n_opt), np.array(d_opt)


@dataclass
class Allocation:
    """N_opt = n_coefficient · C^a, D_opt = d_coefficient · C^b."""

    a: float
    n_coefficient: float
    b: float
    d_coefficient: float
    budgets: int

    def optimum(self, compute: float) -> tuple[float, float]:
        return self.n_coefficient * compute ** self.a, self.d_coefficient * compute ** self.b


def fit_allocation(points: Points, parabola: bool) -> Allocation:
    """Approach 1 (parabola=False: the envelope) or 2 (parabola=True: a parabola per budget),
    then N_opt = n_coefficient · C^a and D_opt = d_coefficient · C^b by least squares in log."""
    if parabola:
        c, n, d = budget_minima(points, parabola=True)
        budgets = len(c)
    else:
        c, n, d = envelope_minima(points)
        budgets = sum(bool(np.isclose(c, budget, rtol=1e-9).any()) for budget in np.unique(points.budget))
    if budgets < 2:
        raise ValueError(f"approach {2 if parabola else 1} needs at least 2 budgets of "
                         f"{'3 or more points each (with a minimum inside)' if parabola else '2 or more sizes each'}; "
                         f"found {budgets}")
    a, n_coefficient = _power_law(c, n)
    b, d_coefficient = _power_law(c, d)
    return Allocation(a, n_coefficient, b, d_coefficient, budgets)


# -- backtest -------------------------------------------------------------------------------------


def backtest(points: Points, holdouts: int = 3) -> list[dict]:
    """How approach 3 extrapolates on these very points, before it is trusted beyond them: for
    k = 1 … holdouts, the law fitted without the k largest budgets predicts the best (lowest-
    loss) point of the largest budget, which is what a compute-optimal run there would reach.
    One row per k: the largest budget fitted, the extrapolation (largest budget / it), that
    point's N, D and loss, the prediction and the error (actual − predicted) / predicted.
    Rows need at least 2 budgets and 6 points left to fit; fewer rows when there are not.

    The bootstrap intervals of fit_all measure how the law moves with the points' noise, not
    whether its form holds beyond them; this does. (On the built-in corpus the CPU demo's law
    predicted its best point at 1.4x / 1.9x / 2.7x beyond the budgets fitted 2-3% / 3-4% / 4-6%
    too high over seven sweeps; 4x beyond the whole sweep the law fitted to every point missed
    by -4.3% on average over six seeds, where the bootstrap intervals had held the reached loss
    in none of five earlier demos: BENCHMARKS.md.)"""
    budgets = np.unique(points.budget)
    top = points.budget == budgets[-1]
    best = np.flatnonzero(top)[np.argmin(points.loss[top])]
    rows = []
    for k in range(1, min(holdouts, len(budgets) - 1) + 1):
        kept = points.budget < budgets[-k]
        if len(np.unique(points.budget[kept])) < 2 or kept.sum() < 6:
            break
        law = fit_parametric(points.take(np.flatnonzero(kept)), starts=8)
        predicted = law.loss(points.n[best], points.d[best])
        rows.append({"fitted_up_to": float(budgets[-k - 1]), "budget": float(budgets[-1]),
                     "extrapolation": float(budgets[-1] / budgets[-k - 1]), "n": float(points.n[best]),
                     "d": float(points.d[best]), "loss": float(points.loss[best]), "predicted": float(predicted),
                     "error": float((points.loss[best] - predicted) / predicted)})
    return rows


# -- bootstrap ------------------------------------------------------------------------------------


def _resample(points: Points, rng: np.random.Generator) -> Points:
    """Points drawn with replacement within each budget (so every budget keeps its size)."""
    index = np.concatenate([rng.choice(np.flatnonzero(points.budget == budget), size=int((points.budget == budget).sum()))
                            for budget in np.unique(points.budget)])
    return points.take(index)


def interval(samples: list[float], level: float = 0.95) -> tuple[float, float]:
    """The central `level` percentile interval of the finite samples; (nan, nan) if none is."""
    samples = [x for x in samples if np.isfinite(x)]
    if not samples:
        return math.nan, math.nan
    tail = 100 * (1 - level) / 2
    return float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail))


def bootstrap_parametric(points: Points, law: ChinchillaLaw | None = None, samples: int = 200,
                         seed: int = 0) -> list[ChinchillaLaw]:
    """Approach 3 refitted on resampled points, each from its own 4 best projected starts and
    from the full fit `law`: a resample may have its minimum in another valley. (With L-BFGS
    run to convergence, adding the grid's best 8 starts changed no percentile of a on the CPU
    demo's sweep, at three times the cost.)"""
    rng = np.random.default_rng(seed)
    return [fit_parametric(_resample(points, rng), starts=0, projected=4, also=law) for _ in range(samples)]


def bootstrap_allocation(points: Points, parabola: bool, samples: int = 200, seed: int = 0) -> list[Allocation]:
    rng = np.random.default_rng(seed)
    fits = []
    for _ in range(samples):
        try:
            fits.append(fit_allocation(_resample(points, rng), parabola))
        except ValueError:  # a resample whose profiles have no minimum: skip it
            continue
    return fits


# -- everything at once: law.json -----------------------------------------------------------------


def _summary(samples: list[float], value: float) -> dict:
    low, high = interval(samples) if samples else (None, None)
    return {"value": value, "low": low, "high": high}


def fit_all(points: Points, samples: int = 200, seed: int = 0, law_min_steps: int = 0) -> dict:
    """The three approaches with 95% bootstrap intervals, as law.json holds them. Approaches 1
    and 2 hold {"skipped": why} when the points do not form at least two IsoFLOP profiles.

    law_min_steps > 0 fits approach 3 (its law, bootstrap and backtest) only to the points that
    trained at least that many optimizer steps; approaches 1 and 2 keep every point, since they
    need whole profiles. Short runs sit in the first, steep part of training, where loss falls
    faster with tokens than a power law with an offset allows: fitted to them, E + A/N^α + B/D^β
    bends early and predicts larger runs too high. (On the built-in corpus the CPU demo's sweep,
    planned at >= 250 steps, missed its 4x extrapolation by -0.7% on average over six seeds
    when fitted at >= 500 (four within 3%), against -4.3% fitted to every point (one within
    3%); BENCHMARKS.md.)"""
    fitted = points.trained_at_least(law_min_steps)
    if len(fitted) < 6 or len(np.unique(fitted.budget)) < 2:
        if law_min_steps > 0:
            raise ValueError(f"{len(fitted)} of {len(points)} points (in {len(np.unique(fitted.budget))} budgets) "
                             f"trained at least {law_min_steps} steps; approach 3 needs 6 points in 2 budgets or "
                             "more: lower the minimum steps of the fit or add larger budgets")
        raise ValueError(f"{len(points)} points in {len(np.unique(points.budget))} budgets; approach 3 needs 6 points "
                         "in 2 budgets or more: add budgets or shapes")
    law = fit_parametric(fitted)
    boot = bootstrap_parametric(fitted, law, samples, seed)
    a, b = law.exponents
    doc = {
        "form": "L(N, D) = E + A / N^alpha + B / D^beta",
        "conventions": "N: all parameters (embeddings and output head included); D: training tokens; "
                       "C: training FLOPs as counted per run (model/flops.py), 6ND beside it",
        "points": len(points),
        "budgets": len(np.unique(points.budget)),
        "approach3": {
            "points": len(fitted),
            "min_steps": law_min_steps,
            **{name: _summary([getattr(s, name) for s in boot], getattr(law, name))
               for name in ("E", "A", "B", "alpha", "beta")},
            "a": _summary([s.exponents[0] for s in boot], a),
            "b": _summary([s.exponents[1] for s in boot], b),
            # (where the law was measured: a prediction far beyond it is said to be extrapolated)
            "range": {name: [float(values.min()), float(values.max())]
                      for name, values in (("compute", fitted.c), ("n", fitted.n), ("d", fitted.d))},
            # exponents the fit pressed against the edge of their search: the points do not set them
            "at_bounds": [name for name, (low, high) in zip(("alpha", "beta"), BOUNDS[3:])
                          if not low * 1.01 < getattr(law, name) < high * 0.99],
        },
        "bootstrap": [[s.E, s.A, s.B, s.alpha, s.beta] for s in boot],
        "backtest": backtest(fitted),
    }
    for approach, parabola in (("approach1", False), ("approach2", True)):
        try:
            allocation = fit_allocation(points, parabola)
        except ValueError as e:
            doc[approach] = {"skipped": str(e)}
            continue
        fits = bootstrap_allocation(points, parabola, samples, seed)
        doc[approach] = {"a": _summary([f.a for f in fits], allocation.a),
                         "b": _summary([f.b for f in fits], allocation.b),
                         "n_coefficient": allocation.n_coefficient, "d_coefficient": allocation.d_coefficient,
                         "budgets": allocation.budgets}
    return doc


LAW_PARAMETERS = ("E", "A", "B", "alpha", "beta")


def _checked(values: dict, where: str) -> dict:
    """The law's parameters, or a ValueError naming the first that no fit writes: E, A and B finite
    numbers of 0 or more (a bootstrap resample's A or B may underflow to 0), alpha and beta finite
    and above 0."""
    for name, value in values.items():
        exponent = name in ("alpha", "beta")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0 or (value == 0 and exponent)):
            bound = "above 0" if exponent else "of 0 or more"
            raise ValueError(f"{where}{name} is {value!r}, not a finite number {bound}")
    return values


def law_of(doc: dict) -> ChinchillaLaw:
    """The approach-3 law of a law.json document (ValueError for numbers no fit writes, in the law
    or in what the plan and report read beside it: the range it was fitted over, its data)."""
    fit = doc["approach3"]
    values = _checked({name: fit[name]["value"] for name in LAW_PARAMETERS}, "approach3.")
    fitted = fit.get("range")
    if fitted is not None:
        for name in ("compute", "n", "d"):
            span = fitted[name] if isinstance(fitted, dict) and name in fitted else None
            if not (isinstance(span, list) and len(span) == 2
                    and all(not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < math.inf for x in span)
                    and span[0] <= span[1]):
                raise ValueError(f"approach3.range.{name} is {span!r}, not the [least, most] positive {name} of the "
                                 "points fitted")
    data = doc.get("data")
    if data is not None and not (isinstance(data, dict) and isinstance(data.get("path"), str)
                                 and isinstance(data.get("mix"), dict | None)):
        raise ValueError(f"data is {data!r}, not the sweep's data directory as {{\"path\": ..., \"mix\": ...}}")
    return ChinchillaLaw(**values, source=doc.get("source", "law.json"))


def bootstrap_laws(doc: dict) -> list[ChinchillaLaw]:
    return [ChinchillaLaw(**_checked(dict(zip(LAW_PARAMETERS, row, strict=True)), f"bootstrap row {i}: "),
                          source="bootstrap") for i, row in enumerate(doc.get("bootstrap", []))]


# Column names accepted for each quantity (ours first; then Epoch AI's Chinchilla extraction).
COLUMNS = {"n": ("n", "params", "Model Size"), "d": ("d", "tokens"), "c": ("c", "flops", "Training FLOP"),
           "loss": ("loss", "val_loss", "final_loss"), "budget": ("budget",), "steps": ("steps",)}


def read_points(path, drop_highest: int = 0) -> Points:
    """Points from a CSV with columns for N, C and loss (and D and budget, optional: D = C / 6N
    when absent), e.g. a sweep's results.csv or `../shared/data/chinchilla_fig4_points.csv`.
    drop_highest leaves out that many points of highest loss (Epoch AI's refit drops 5)."""
    import csv
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no points file {str(path)!r}; give a CSV with columns n, c (or d) and loss")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is not UTF-8 text; give a CSV with columns n, c (or d) and loss") from None
    if not rows:
        raise ValueError(f"{str(path)!r} holds no rows")
    header = rows[0].keys()
    found = {key: next((name for name in names if name in header), None) for key, names in COLUMNS.items()}
    missing = [key for key in ("n", "loss") if found[key] is None] + (["c or d"] if not (found["c"] or found["d"]) else [])
    if missing:
        raise ValueError(f"{str(path)!r} has no column for {', '.join(missing)} (columns: {', '.join(header)}); "
                         f"name them {', '.join(COLUMNS[k][0] if k in COLUMNS else 'c' for k in missing)}")

    def number(row: dict, line: int, name: str) -> float:
        if row[name] is None:  # (csv fills the columns a short row lacks with None)
            raise ValueError(f"{str(path)!r} line {line} has fewer values than the header's {len(header)} columns "
                             f"(none for {name}); give every row a value for each column")
        try:
            return float(row[name])
        except (TypeError, ValueError):
            raise ValueError(f"{str(path)!r} line {line}, column {name}: {row[name]!r} is not a number") from None

    def column(key):
        return None if found[key] is None else np.array([number(row, line, found[key])
                                                         for line, row in enumerate(rows, start=2)])

    n, d, c, loss, budget, steps = (column(key) for key in ("n", "d", "c", "loss", "budget", "steps"))
    for name, values in (("n", n), ("d", d), ("c", c), ("budget", budget)):
        bad = np.flatnonzero(~((values > 0) & np.isfinite(values))) if values is not None else []
        if len(bad):
            raise ValueError(f"{str(path)!r} line {bad[0] + 2}, column {found[name]}: {values[bad[0]]:g} is not a "
                             "positive count; give parameters, tokens, FLOPs and budgets above zero and finite")
    d = c / (6 * n) if d is None else d
    c = 6 * n * d if c is None else c
    kept = np.isfinite(loss)  # a sweep records diverged points with a loss of nan
    if not kept.all():
        log.warning("%s: %d of its %d points have no finite loss (runs that diverged) and are left out of the fit",
                    path, int((~kept).sum()), len(kept))
    points = Points(n[kept], d[kept], c[kept], loss[kept], None if budget is None else budget[kept],
                    None if steps is None else steps[kept])
    rows_seen = np.stack([points.n, points.d, points.loss], axis=1)
    repeated = len(rows_seen) - len(np.unique(rows_seen, axis=0))
    if repeated:  # (the bootstrap would count each copy as another run's evidence)
        log.warning("%s: %d of its points repeat another's N, D and loss; each copy is fitted as a run of its own "
                    "(drop the copies if one run was recorded twice)", path, repeated)
    if drop_highest >= len(points):
        raise ValueError(f"--drop-highest {drop_highest} leaves none of the {len(points)} points of {str(path)!r} to "
                         f"fit; give fewer than {len(points)}")
    if drop_highest:
        points = points.take(np.argsort(points.loss)[:len(points) - drop_highest])
    return points
