"""Plots of a scaling-law fit (PNG, Matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from scaletrain.scaling.fit import Points, bootstrap_laws, budget_minima, envelope_minima, law_of  # noqa: E402


def plot_fit(points: Points, doc: dict, out: Path) -> list[Path]:
    """isoflop.png, optimal.png, contours.png and residuals.png in out; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    law, boot = law_of(doc), bootstrap_laws(doc)
    budgets = np.unique(points.budget)
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))
    paths = []

    # IsoFLOP profiles: loss against N per budget, the approach-2 parabola and its minimum.
    fig, ax = plt.subplots(figsize=(7, 5))
    for budget, colour in zip(budgets, colours):
        group = points.budget == budget
        n, loss = points.n[group], points.loss[group]
        ax.scatter(n, loss, color=colour, s=14, label=f"C = {budget:.2g}")
        if len(np.unique(n)) >= 3:
            curvature, slope, intercept = np.polyfit(np.log(n), loss, 2)
            grid = np.linspace(np.log(n.min()), np.log(n.max()), 50)
            ax.plot(np.exp(grid), np.polyval([curvature, slope, intercept], grid), color=colour, lw=1)
            if curvature > 0:
                vertex = -slope / (2 * curvature)
                ax.plot(np.exp(vertex), np.polyval([curvature, slope, intercept], vertex), "x", color=colour)
    ax.set(xscale="log", xlabel="parameters N", ylabel="final loss", title="IsoFLOP profiles (approach 2)")
    if len(budgets) <= 12:
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "isoflop.png"))

    # N_opt and D_opt against C: each approach, approach 3's bootstrap band. The axis is the
    # points' exact FLOPs, so approach 3's optimum is taken at C = k·N·D with the points' own k
    # (6 for C = 6ND), as approaches 1 and 2 are.
    compute = np.geomspace(points.c.min() / 3, points.c.max() * 30, 60)
    k = float(np.median(points.c / (points.n * points.d)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for index, (ax, name) in enumerate(zip(axes, ("N_opt", "D_opt"))):
        best = np.array([law.optimum(c, k)[index] for c in compute])
        ax.plot(compute, best, color="C0", label=f"approach 3 (exponent {law.exponents[index]:.3f}; C = {k:.2f} ND)")
        shown = [best]  # what the axis must hold; a degenerate resample's optimum may be 1e300 or inf
        if boot:
            band = np.array([[sample.optimum(c, k)[index] for c in compute] for sample in boot])
            with np.errstate(invalid="ignore"):  # between two infinite optima: nan, not drawn
                low, high = np.percentile(band, [2.5, 97.5], axis=0)
            ax.fill_between(compute, low, high, where=np.isfinite(low) & np.isfinite(high), color="C0", alpha=0.2,
                            label="95% bootstrap")
        for approach, parabola, colour in (("approach1", False, "C1"), ("approach2", True, "C2")):
            fit = doc.get(approach, {})
            if "a" not in fit:
                continue
            c, n, d = budget_minima(points, parabola) if parabola else envelope_minima(points)
            exponent = fit["a" if index == 0 else "b"]["value"]
            coefficient = fit["n_coefficient" if index == 0 else "d_coefficient"]
            ax.scatter(c, n if index == 0 else d, color=colour, s=16)
            ax.plot(compute, coefficient * compute ** exponent, color=colour, ls="--",
                    label=f"{approach.replace('approach', 'approach ')} (exponent {exponent:.3f})")
            shown.append(n if index == 0 else d)
        shown = np.concatenate(shown)
        shown = shown[(shown > 0) & (shown < 1e100)]
        ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=name)
        if len(shown):  # the fits and the points, with a decade either side; a wider band is cut off
            ax.set_ylim(shown.min() / 10, shown.max() * 10)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "optimal.png"))

    # Approach 3's loss surface over (N, D) with the points and the compute-optimal frontier.
    n_grid = np.geomspace(points.n.min() / 2, points.n.max() * 2, 120)
    d_grid = np.geomspace(points.d.min() / 2, points.d.max() * 2, 120)
    surface = np.array([[law.loss(n, d) for n in n_grid] for d in d_grid])
    fig, ax = plt.subplots(figsize=(7, 5))
    contours = ax.contour(n_grid, d_grid, surface, levels=15, cmap="viridis")
    ax.clabel(contours, fontsize=6)
    fitted = _fitted(points, doc)
    ax.scatter(points.n[fitted], points.d[fitted], c=points.loss[fitted], cmap="viridis", s=14, edgecolors="k",
               linewidths=0.3, label="fitted")
    if not fitted.all():
        ax.scatter(points.n[~fitted], points.d[~fitted], s=14, facecolors="none", edgecolors="0.5", linewidths=0.6,
                   label=f"left out (< {doc['approach3']['min_steps']} steps)")
    frontier = np.array([law.optimum(c) for c in compute])
    ax.plot(frontier[:, 0], frontier[:, 1], color="C3", label="compute-optimal")
    ax.set(xscale="log", yscale="log", xlim=(n_grid[0], n_grid[-1]), ylim=(d_grid[0], d_grid[-1]),
           xlabel="parameters N", ylabel="tokens D", title="approach 3: loss contours")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "contours.png"))

    # Residuals of approach 3 in log loss.
    predicted = np.array([law.loss(n, d) for n, d in zip(points.n, points.d)])
    fig, ax = plt.subplots(figsize=(7, 4))
    residual = np.log(points.loss) - np.log(predicted)
    ax.scatter(points.c[fitted], residual[fitted], s=12, label="fitted")
    if not fitted.all():
        ax.scatter(points.c[~fitted], residual[~fitted], s=12, facecolors="none", edgecolors="0.5",
                   label=f"left out (< {doc['approach3']['min_steps']} steps)")
        ax.legend(fontsize=7)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="training FLOPs C", ylabel="log loss − log fit", title="approach 3 residuals")
    paths.append(_save(fig, out / "residuals.png"))
    return paths


def plot_mixture(law, choice, shares: np.ndarray, losses: np.ndarray, path: Path) -> Path:
    """mixture.png of a mixture search (scaletrain.mixture): each proxy's measured target loss
    against the law's prediction; beside it, for two sources the target loss along the first
    one's share (law and proxies, the choice marked; the law over the shares measured and
    chosen), for more each chosen share with the interval of the bootstrap refits' optima."""
    names = law.sources
    weights = np.array([choice.target[n] for n in law.validation])
    measured, predicted = losses @ weights, law.target(shares, weights)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.scatter(predicted, measured, s=16)
    finite = np.isfinite(measured)
    low, high = min(predicted[finite].min(), measured[finite].min()), max(predicted[finite].max(), measured[finite].max())
    left.plot([low, high], [low, high], color="k", lw=0.8)
    left.set(xlabel="law's target loss", ylabel="measured target loss",
             title="proxies" + (f" (leave-one-out error {choice.loo_error:.2%})" if choice.loo_error is not None else ""))
    if len(names) == 2:
        # The law drawn where it was fitted (the proxies' shares, and the choice with its interval),
        # not out to shares of 0 and 1, where its extrapolation would set the scale of the plot.
        chosen = choice.shares[names[0]]
        span = [*shares[:, 0], chosen, *(choice.shares_interval or {}).get(names[0], ())]
        pad = 0.05 * (max(span) - min(span) or 1.0)
        grid = np.linspace(max(0.0, min(span) - pad), min(1.0, max(span) + pad), 201)
        curve = law.target(np.stack([grid, 1 - grid], axis=1), weights)
        right.plot(grid, curve, color="C0", label="law")
        right.scatter(shares[:, 0], measured, s=16, color="C0", label="proxies")
        right.axvline(chosen, color="C3", lw=1, label=f"chosen {chosen:.3f}")
        if choice.shares_interval:
            right.axvspan(*choice.shares_interval[names[0]], color="C3", alpha=0.15, lw=0)
        right.set(xlabel=f"share of {names[0]} (the rest {names[1]})", ylabel="target loss",
                  title="target loss by mixture")
        right.legend(fontsize=8)
    else:
        chosen = np.array([choice.shares[n] for n in names])
        bounds = np.array([choice.shares_interval[n] for n in names]) if choice.shares_interval else None
        right.bar(names, chosen, yerr=None if bounds is None else [chosen - bounds[:, 0], bounds[:, 1] - chosen],
                  capsize=4, color="C3")
        right.set(ylabel="share", title="chosen mixture (95% interval of the refits' optima)")
    return _save(fig, path)


def plot_hparams(rows: list[dict], law, optima, boot, prior, path: Path) -> Path:
    """hparams.png of a hyperparameter search (scaletrain.hparams): each budget's final loss
    against the learning rate, a line per batch size, its optimum marked; then the optima's
    learning rates and batches against the budget with the fitted law (and the bootstrap's 95%
    band) beside the prior rule."""
    fig, (losses, rates, batches) = plt.subplots(1, 3, figsize=(15, 4.5))
    budgets = sorted({row["budget"] for row in rows})
    for k, budget in enumerate(budgets):
        at = [row for row in rows if row["budget"] == budget]
        for j, seqs in enumerate(sorted({row["batch_seqs"] for row in at})):
            line = sorted((row["lr"], row["loss"]) for row in at if row["batch_seqs"] == seqs)
            losses.plot(*zip(*line), marker="o", ms=3, color=f"C{k}", ls=("-", "--", ":", "-.")[j % 4],
                        label=f"C={budget:.2g}, {int(seqs)} seqs")
    for k, optimum in enumerate(sorted(optima, key=lambda o: o.budget)):
        losses.scatter([optimum.lr], [optimum.loss], marker="*", s=120, color=f"C{k}", edgecolor="k", zorder=3)
    losses.set(xscale="log", xlabel="peak learning rate", ylabel="final validation loss",
               title="loss by learning rate and batch (* the optimum)")
    losses.legend(fontsize=6)
    span = np.geomspace(min(budgets) / 2, max(budgets) * 10, 50)
    for axis, value, name in ((rates, "lr", "learning rate"), (batches, "batch_tokens", "batch (tokens)")):
        axis.scatter([o.budget for o in optima], [getattr(o, value) for o in optima], color="C0", zorder=3,
                     label="each budget's optimum")
        of = (lambda lw, c: lw.lr(c)) if value == "lr" else (lambda lw, c: lw.batch_tokens(c))
        axis.plot(span, [of(law, c) for c in span], color="C0", label="fitted")
        if boot:
            band = np.percentile([[of(b, c) for c in span] for b in boot], [2.5, 97.5], axis=0)
            axis.fill_between(span, band[0], band[1], color="C0", alpha=0.15, lw=0)
        axis.plot(span, [of(prior, c) for c in span], color="k", ls="--", lw=0.8, label=prior.source or "prior")
        axis.set(xscale="log", yscale="log", xlabel="compute (FLOPs)", ylabel=name, title=f"best {name} by budget")
        axis.legend(fontsize=7)
    return _save(fig, path)


def _fitted(points: Points, doc: dict) -> np.ndarray:
    """Which points approach 3 was fitted to (fit_all's law_min_steps)."""
    min_steps = doc["approach3"].get("min_steps", 0)
    if not min_steps or points.steps is None:
        return np.ones(len(points), dtype=bool)
    return points.steps >= min_steps


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
