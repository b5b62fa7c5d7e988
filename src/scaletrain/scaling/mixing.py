"""Data mixing laws: the validation loss of each source as a function of the training mixture,
fitted to a few small runs, and the mixture that minimises a target loss — numpy and SciPy, no
torch.

At a fixed model size and training length, the validation loss on source i is fitted as

    L_i(r) = E_i + 1 / Σ_j C_ij r_j^γ_ij        (C_ij ≥ 0, 0 ≤ γ_ij ≤ 1)

in the training shares r (Σ_j r_j = 1): the mixture term of the additive law of Shukor et al.
2025 ("Scaling Laws for Optimal Data Mixtures"), 2n + 1 numbers per validation source for n
training sources. Every source's data may lower every source's loss, with diminishing returns
(γ ≤ 1, which also makes each L_i, and so any target Σ_i w_i L_i with w ≥ 0, convex in r: one
optimum). On this project's CPU benchmark (21 proxies on three real sources, BENCHMARKS.md) it
predicted held-out proxies 3x better than the exponential law of Ye et al. 2024 ("Data Mixing
Laws", L_i = c_i + k_i exp(Σ_j t_ij r_j)), and chose a mixture near the best one measured where
Ye's law, fitted to the same 8 proxies, chose one 0.06 nats worse.

Each source's law is fitted by least squares on the losses (SciPy's least_squares, an analytic
Jacobian, from a few starting points). The mixture minimising Σ_i w_i L_i(r) over the simplex —
with a floor on every share and caps on shares that a run of T tokens would repeat more than a
number of epochs (Muennighoff et al. 2023: past ~4 epochs repeated data is worth much less) —
is found by SLSQP. Intervals come from refitting to the runs resampled with replacement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares, minimize


@dataclass
class MixingLaw:
    """L_i(r) = E_i + 1 / Σ_j C_ij r_j^γ_ij for each validation source i, r over the training sources."""

    sources: list[str]  # training sources: the order of r
    validation: list[str]  # validation sources: the order of e and of c's and gamma's rows
    e: np.ndarray  # (m,)
    c: np.ndarray  # (m, n)
    gamma: np.ndarray  # (m, n)

    def losses(self, r: np.ndarray) -> np.ndarray:
        """Each validation source's loss, (..., m), at mixtures r (..., n)."""
        r = np.asarray(r, dtype=float)[..., None, :]  # (..., 1, n) against (m, n)
        return self.e + 1 / np.sum(self.c * r ** self.gamma, axis=-1)

    def target(self, r: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Σ_i w_i L_i(r) for weights (m,) summing to 1."""
        return self.losses(r) @ weights

    def gradient(self, r: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """d/dr of the target at one mixture r (n,)."""
        terms = self.c * r ** self.gamma  # (m, n)
        sums = terms.sum(axis=1)  # (m,)
        return -(weights / sums ** 2) @ (terms * self.gamma / r)

    def to_dict(self) -> dict:
        return {"form": "L_i(r) = E_i + 1 / sum_j C_ij r_j^gamma_ij  (Shukor et al. 2025)", "sources": self.sources,
                "validation": {name: {"E": float(self.e[i]), "C": dict(zip(self.sources, map(float, self.c[i]))),
                                      "gamma": dict(zip(self.sources, map(float, self.gamma[i])))}
                               for i, name in enumerate(self.validation)}}

    @classmethod
    def from_dict(cls, doc: dict) -> MixingLaw:
        sources, validation = list(doc["sources"]), list(doc["validation"])
        rows = [doc["validation"][v] for v in validation]
        return cls(sources, validation, np.array([row["E"] for row in rows]),
                   np.array([[row["C"][s] for s in sources] for row in rows]),
                   np.array([[row["gamma"][s] for s in sources] for row in rows]))


def _fit_one(r: np.ndarray, loss: np.ndarray, starts: list[np.ndarray] | None = None) -> np.ndarray:
    """[E, log C_1..n, γ_1..n] of one validation source's law, by least squares on the losses,
    from `starts` (default a small grid of them); the best fit."""
    n = r.shape[1]
    log_r = np.log(r)
    floor = float(loss.min())

    def residuals(x):
        return x[0] + 1 / np.sum(np.exp(x[1:n + 1] + x[n + 1:] * log_r), axis=1) - loss

    def jacobian(x):
        terms = np.exp(x[1:n + 1] + x[n + 1:] * log_r)  # (R, n)
        scale = -1 / terms.sum(axis=1, keepdims=True) ** 2
        return np.hstack([np.ones((len(r), 1)), scale * terms, scale * terms * log_r])

    if starts is None:
        starts = []
        for share in (0.5, 0.8, 0.95):
            # E at a share of the lowest loss; C so that the law meets the mean loss at γ.
            gap = max(float(loss.mean()) - share * floor, 1e-3)
            for gamma in (0.3, 0.7):
                starts.append(np.concatenate([[share * floor], np.full(n, np.log(1 / (n * gap))), np.full(n, gamma)]))
    lower = np.concatenate([[0.0], np.full(n, -30.0), np.zeros(n)])
    upper = np.concatenate([[floor], np.full(n, 30.0), np.ones(n)])
    best = None
    for start in starts:
        fitted = least_squares(residuals, np.clip(start, lower, upper), jac=jacobian, bounds=(lower, upper))
        if best is None or fitted.cost < best.cost:
            best = fitted
    return best.x


def _distinct(mixtures: np.ndarray) -> int:
    return len(np.unique(mixtures.round(6), axis=0))


def fit_mixing_law(sources: list[str], validation: list[str], mixtures: np.ndarray, losses: np.ndarray,
                   like: MixingLaw | None = None) -> MixingLaw:
    """Fit the law to runs: mixtures (R, n), each row a run's training shares, and losses (R, m),
    its final validation loss on each validation source. Rows with a non-finite loss are left out.
    `like`: a law fitted to similar runs, whose numbers are the one starting point (the bootstrap's
    refits)."""
    mixtures, losses = np.asarray(mixtures, dtype=float), np.asarray(losses, dtype=float)
    keep = np.all(np.isfinite(losses), axis=1)
    mixtures, losses = mixtures[keep], losses[keep]
    n = len(sources)
    if _distinct(mixtures) < 2 * n + 1:
        raise ValueError(f"a mixing law of {n} sources needs at least {2 * n + 1} runs on distinct mixtures, "
                         f"got {_distinct(mixtures)} that finished")
    if np.any(mixtures <= 0):
        raise ValueError("every run's mixture must give every source a positive share")
    mixtures = mixtures / mixtures.sum(axis=1, keepdims=True)
    fits = []
    for i in range(losses.shape[1]):
        starts = None if like is None else [np.concatenate([[like.e[i]], np.log(np.maximum(like.c[i], 1e-13)),
                                                            like.gamma[i]])]
        fits.append(_fit_one(mixtures, losses[:, i], starts))
    fits = np.array(fits)
    return MixingLaw(list(sources), list(validation), fits[:, 0], np.exp(fits[:, 1:n + 1]), fits[:, n + 1:])


def bootstrap_mixing_laws(law: MixingLaw, mixtures: np.ndarray, losses: np.ndarray, samples: int = 100,
                          seed: int = 0) -> list[MixingLaw]:
    """The law refitted to `samples` resamples (with replacement) of the runs; a resample with too
    few distinct mixtures to fit is drawn again, and so is one of every run once (the runs
    themselves, whose refit is the law: where only those fit, as with 2n + 1 runs, the refits
    would make an interval of zero width)."""
    rng = np.random.default_rng(seed)
    mixtures, losses = np.asarray(mixtures, dtype=float), np.asarray(losses, dtype=float)
    keep = np.all(np.isfinite(losses), axis=1)
    mixtures, losses = mixtures[keep], losses[keep]
    laws: list[MixingLaw] = []
    for _ in range(20 * samples):
        if len(laws) == samples:
            break
        index = rng.integers(0, len(mixtures), len(mixtures))
        if len(np.unique(index)) == len(mixtures):
            continue
        try:
            laws.append(fit_mixing_law(law.sources, law.validation, mixtures[index], losses[index], like=law))
        except ValueError:
            continue
    return laws


def leave_one_out(law: MixingLaw, mixtures: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """Each run's losses (R, m) as predicted by the law fitted to the other runs (nan where the
    others are too few to fit): how well the law predicts a mixture it has not seen."""
    mixtures, losses = np.asarray(mixtures, dtype=float), np.asarray(losses, dtype=float)
    predicted = np.full(losses.shape, np.nan)
    for k in range(len(mixtures)):
        others = np.arange(len(mixtures)) != k
        try:
            fitted = fit_mixing_law(law.sources, law.validation, mixtures[others], losses[others])
        except ValueError:
            continue
        predicted[k] = fitted.losses(mixtures[k] / mixtures[k].sum())
    return predicted


def share_bounds(unique_tokens: np.ndarray, tokens: float | None, max_epochs: float,
                 floor: float) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) bounds of each source's share: at least `floor`; at most what a run of
    `tokens` tokens can take without repeating the source more than `max_epochs` times."""
    unique_tokens = np.asarray(unique_tokens, dtype=float)
    lower = np.full(len(unique_tokens), floor)
    upper = np.ones(len(unique_tokens)) if tokens is None else np.minimum(1.0, max_epochs * unique_tokens / tokens)
    return lower, upper


def best_mixture(law: MixingLaw, weights: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """The shares r minimising Σ_i w_i L_i(r) with Σ r = 1 and lower ≤ r ≤ upper (lower > 0)."""
    weights, lower, upper = (np.asarray(x, dtype=float) for x in (weights, lower, upper))
    if lower.sum() > 1 + 1e-9 or upper.sum() < 1 - 1e-9 or np.any(lower > upper):
        raise ValueError("no mixture satisfies the bounds on its shares: "
                         + ("the run's tokens would repeat every source past the epoch limit; train fewer tokens, "
                            "allow more epochs or add data" if upper.sum() < 1 else "lower the floor on each share"))
    # A feasible start: the floor, then what is left shared in proportion to the room above it.
    room = upper - lower
    start = lower + room * (1 - lower.sum()) / room.sum() if room.sum() > 0 else lower

    def objective(r):
        return float(law.target(r, weights)), law.gradient(r, weights)

    result = minimize(objective, start, jac=True, method="SLSQP", bounds=list(zip(lower, upper)),
                      constraints=[{"type": "eq", "fun": lambda r: r.sum() - 1, "jac": lambda r: np.ones_like(r)}],
                      options={"ftol": 1e-12, "maxiter": 500})
    r = np.clip(result.x, lower, upper)
    return r / r.sum()
