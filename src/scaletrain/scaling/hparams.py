"""Hyperparameter laws: the best peak learning rate and batch size as power laws of the compute
budget, measured on small runs — numpy, no torch.

DeepSeek LLM (DeepSeek-AI 2024, section 3.1) trained a grid of learning rates and batch sizes at
each of several small budgets, found the near-optimal region of each, and fitted

    η_opt(C) = a · C^b        B_opt(C) = c · C^d   (tokens per step)

(a, b, c, d = 0.3118, −0.125, 0.2920, 0.3271 on their data and recipe, which need not be the
user's). The sweep, the mixture search and the planner take such a rule; this module fits one to
the user's own runs (benchmarks/hparams.py: on this project's CPU corpus the batch law carried
to 10× its budgets and the learning-rate law, fitted over one decade, did not; BENCHMARKS.md).

Each budget's optimum: a quadratic surface in (log η, log B) — a paraboloid with a cross term,
since the best rate grows with the batch — fitted by least squares to the runs within `band` of
that budget's lowest loss (at least its six lowest), minimised; when the grid has fewer than
three levels of either, the surface is not convex, or its minimum lies more than one grid step
beyond the grid, the optimum is instead the centre (in log) of the near-optimal runs, those
within `near` of the lowest loss (DeepSeek's 0.25%, widened by default for small runs' noise)
and joined to the best run on the grid through such runs: a near-optimal run beyond a worse one
is noise, and the centre of the two would be the worse run's rate.
The law is then a least-squares line through the budgets' optima in log-log — leaving out of
each line the budgets whose best run sits on the grid's edge in that hyperparameter, where the
optimum is only a bound, as long as two budgets remain — and its intervals come from refitting to
each budget's runs resampled with replacement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

BAND = 0.03  # the surface is fitted to the runs within 3% of the budget's lowest loss (at least six)
NEAR = 0.005  # near-optimal: within 0.5% of the lowest loss (DeepSeek LLM: 0.25%, on larger runs)
# A law used this many times beyond the budgets it was measured at is said (to the user) to be extrapolated.
EXTRAPOLATION_WARNING = 100.0


@dataclass(frozen=True)
class HyperparameterLaw:
    """η_opt(C) = lr_coefficient · C^lr_exponent and B_opt(C) = batch_coefficient · C^batch_exponent
    tokens. Called as a sweep's rule, (compute, width) -> (learning rate, tokens per step): the
    width is taken and not used (a measured law is of the compute alone, as DeepSeek's)."""

    lr_coefficient: float
    lr_exponent: float
    batch_coefficient: float
    batch_exponent: float
    source: str = ""
    budgets: tuple[float, float] | None = None  # the least and largest budgets it was measured at, if known

    def __call__(self, compute: float, dim: int | None = None) -> tuple[float, float]:
        return self.lr(compute), self.batch_tokens(compute)

    def lr(self, compute: float) -> float:
        return self.lr_coefficient * compute ** self.lr_exponent

    def batch_tokens(self, compute: float) -> float:
        return self.batch_coefficient * compute ** self.batch_exponent

    def extrapolation(self, compute: float) -> float | None:
        """How many times beyond the measured budgets `compute` lies (1 within them; None if unknown)."""
        if self.budgets is None:
            return None
        low, high = self.budgets
        return max(1.0, compute / high, low / compute)

    def to_dict(self) -> dict:
        return {"form": "lr = a * C^b, batch_tokens = c * C^d", "lr_coefficient": self.lr_coefficient,
                "lr_exponent": self.lr_exponent, "batch_coefficient": self.batch_coefficient,
                "batch_exponent": self.batch_exponent, "source": self.source,
                "measured_budgets": list(self.budgets) if self.budgets else None}

    @classmethod
    def from_dict(cls, doc: dict) -> HyperparameterLaw:
        """The law a to_dict wrote; ValueError naming what is missing or not a finite number."""
        keys = ("lr_coefficient", "lr_exponent", "batch_coefficient", "batch_exponent")
        missing = [key for key in keys if key not in doc]
        if missing:
            raise ValueError(f"a hyperparameter law needs {', '.join(keys)}; missing {', '.join(missing)}")
        values = {}
        for key in keys:
            try:
                values[key] = float(doc[key])
            except (TypeError, ValueError):
                values[key] = math.nan
            if not math.isfinite(values[key]) or (key.endswith("coefficient") and values[key] <= 0):
                raise ValueError(f"{key} = {doc[key]!r} is not a {'positive ' if key.endswith('coefficient') else ''}"
                                 "finite number")
        budgets = doc.get("measured_budgets")
        return cls(**values, source=str(doc.get("source", "")),
                   budgets=(float(budgets[0]), float(budgets[1])) if budgets else None)


# DeepSeek LLM 2024, section 3.1 (fitted on their corpus; the range of budgets is not kept here).
DEEPSEEK = HyperparameterLaw(0.3118, -0.125, 0.2920, 0.3271, source="DeepSeek LLM (DeepSeek-AI 2024)")


@dataclass
class BudgetOptimum:
    """The best (learning rate, batch) of one budget's runs. method: "surface" or "near-optimal"
    (see the module's docstring); edges: the grid's ends the lowest measured loss lies on
    ("lr low", "lr high", "batch low", "batch high"), each a hint that the grid is too narrow."""

    budget: float
    lr: float
    batch_tokens: float
    loss: float  # the surface's value at its minimum, or the lowest measured loss
    method: str
    best: int  # the index of the lowest measured loss among the runs given
    near: list[int] = field(default_factory=list)  # indices of the near-optimal runs
    edges: list[str] = field(default_factory=list)
    used: list[str] = field(default_factory=list)  # the laws ("lr", "batch") fitted through it


    def to_dict(self) -> dict:
        return {"budget": self.budget, "lr": self.lr, "batch_tokens": self.batch_tokens, "loss": self.loss,
                "method": self.method, "near": self.near, "edges": self.edges, "used": self.used}


def _surface(x: np.ndarray, y: np.ndarray, loss: np.ndarray) -> tuple[float, float, float] | None:
    """The minimum (x, y, value) of a quadratic surface fitted to loss(x, y), or None where it has
    none (a saddle, a ridge or too few points to fit one)."""
    design = np.stack([np.ones_like(x), x, y, x * x, x * y, y * y], axis=1)
    coef, _, rank, _ = np.linalg.lstsq(design, loss, rcond=None)
    if rank < 6:
        return None
    _, bx, by, axx, axy, ayy = coef
    hessian = np.array([[2 * axx, axy], [axy, 2 * ayy]])
    if np.any(np.linalg.eigvalsh(hessian) <= 0):
        return None
    xm, ym = np.linalg.solve(hessian, [-bx, -by])
    return float(xm), float(ym), float(coef @ [1, xm, ym, xm * xm, xm * ym, ym * ym])


def budget_optimum(budget: float, lrs, batch_tokens, losses, band: float = BAND, near: float = NEAR) -> BudgetOptimum:
    """The optimum of one budget's runs (learning rates, batch sizes in tokens, final validation
    losses; a diverged run's loss is nan and counts as the worst)."""
    lrs, batch_tokens, losses = (np.asarray(v, dtype=float) for v in (lrs, batch_tokens, losses))
    finite = np.isfinite(losses)
    if not finite.any():
        raise ValueError(f"every run at budget {budget:.3g} diverged; lower the learning rates")
    x, y = np.log(lrs), np.log(batch_tokens)
    best = int(np.nanargmin(np.where(finite, losses, np.nan)))
    lowest = losses[best]
    edges = [f"{what} {end}" for what, values in (("lr", x), ("batch", y))
             for end, bound in (("low", values.min()), ("high", values.max()))
             if len(np.unique(values)) > 1 and np.isclose(values[best], bound)]
    close = _joined(best, x, y, finite & (losses <= lowest * (1 + near)))
    found = None
    levels = min(len(np.unique(x[finite])), len(np.unique(y[finite])))
    if levels >= 3 and finite.sum() >= 6:
        order = np.argsort(np.where(finite, losses, np.inf))
        chosen = np.flatnonzero(finite & (losses <= lowest * (1 + band)))
        if len(chosen) < 6:
            chosen = order[:6]
        found = _surface(x[chosen], y[chosen], losses[chosen])
        if found is not None:
            # Beyond the grid by more than one of its steps, the surface extrapolates: not trusted.
            def step(values):
                return np.max(np.diff(np.unique(values)))

            xm, ym, _ = found
            if not (x.min() - step(x) <= xm <= x.max() + step(x) and y.min() - step(y) <= ym <= y.max() + step(y)):
                found = None
    if found is not None:
        xm, ym, value = found
        return BudgetOptimum(budget, math.exp(xm), math.exp(ym), value, "surface", best, close.tolist(), edges)
    return BudgetOptimum(budget, float(np.exp(x[close].mean())), float(np.exp(y[close].mean())), float(lowest),
                         "near-optimal", best, close.tolist(), edges)


def _joined(best: int, x: np.ndarray, y: np.ndarray, near: np.ndarray) -> np.ndarray:
    """The indices of the runs in `near` joined to run `best` through neighbours on the grid (the
    next level of either hyperparameter or both) that are all in `near`."""
    levels = [np.searchsorted(np.unique(v), v) for v in (x, y)]
    found, frontier = {best}, [best]
    while frontier:
        i = frontier.pop()
        for j in np.flatnonzero(near):
            steps = [abs(int(level[j]) - int(level[i])) for level in levels]
            if j not in found and max(steps) == 1:  # (diagonally too: the best rate grows with the batch)
                found.add(int(j))
                frontier.append(int(j))
    return np.array(sorted(found))


def _line(log_c: np.ndarray, log_v: np.ndarray) -> tuple[float, float]:
    """(coefficient, exponent) of the least-squares line log v = log a + b log C."""
    b, log_a = np.polyfit(log_c, log_v, 1)
    return float(math.exp(log_a)), float(b)


def fit_hyperparameter_law(optima: list[BudgetOptimum], source: str = "") -> HyperparameterLaw:
    """The power laws through the budgets' optima; ValueError with fewer than two budgets.

    A budget whose best run lies on the grid's edge in the learning rate (or the batch) has an
    optimum that is only a bound there: it is left out of that law while two budgets or more
    remain without (each optimum's `used` says which laws it entered)."""
    budgets = sorted({o.budget for o in optima})
    if len(budgets) < 2:
        raise ValueError(f"a law of the compute needs optima at two budgets or more, got {len(budgets)}")
    lines = {}
    for what, value in (("lr", lambda o: o.lr), ("batch", lambda o: o.batch_tokens)):
        inside = [o for o in optima if not any(edge.startswith(what) for edge in o.edges)]
        chosen = inside if len({o.budget for o in inside}) >= 2 else optima
        for o in optima:
            o.used = [u for u in o.used if u != what] + ([what] if any(o is c for c in chosen) else [])
        lines[what] = _line(np.log([o.budget for o in chosen]), np.log([value(o) for o in chosen]))
    used = [o.budget for o in optima if o.used]
    return HyperparameterLaw(*lines["lr"], *lines["batch"], source=source, budgets=(min(used), max(used)))


def fit_runs(budget, lrs, batch_tokens, losses, band: float = BAND, near: float = NEAR,
             source: str = "") -> tuple[HyperparameterLaw, list[BudgetOptimum]]:
    """The law and the budgets' optima of runs given as four arrays (one entry per run)."""
    budget, lrs, batch_tokens, losses = (np.asarray(v, dtype=float) for v in (budget, lrs, batch_tokens, losses))
    optima = []
    for value in np.unique(budget):
        at = budget == value
        optima.append(budget_optimum(float(value), lrs[at], batch_tokens[at], losses[at], band, near))
    return fit_hyperparameter_law(optima, source), optima


def bootstrap_hyperparameter_laws(budget, lrs, batch_tokens, losses, samples: int = 200, seed: int = 0,
                                  band: float = BAND, near: float = NEAR) -> list[HyperparameterLaw]:
    """Laws refitted to each budget's runs resampled with replacement (a resample every run of
    which diverged is drawn again)."""
    budget, lrs, batch_tokens, losses = (np.asarray(v, dtype=float) for v in (budget, lrs, batch_tokens, losses))
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(budget == value) for value in np.unique(budget)]
    laws = []
    for _ in range(samples):
        picked = []
        for group in groups:
            for _ in range(100):
                draw = rng.choice(group, size=len(group), replace=True)
                if np.isfinite(losses[draw]).any():
                    break
            picked.append(draw)
        picked = np.concatenate(picked)
        laws.append(fit_runs(budget[picked], lrs[picked], batch_tokens[picked], losses[picked], band, near)[0])
    return laws
