"""What a fitted law implies: compute-optimal, inference-aware and data-constrained choices of
model size N and training tokens D.

Training costs 6·N·D FLOPs and inference 2·N FLOPs per token (Kaplan et al. 2020, section 2.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.optimize import minimize_scalar

from scaletrain.scaling.laws import ChinchillaLaw

# Muennighoff et al. 2023, "Scaling Data-Constrained Language Models", eq. 5 and section 3.1:
# the "half-life" of repeated data (in epochs) and of parameters beyond the optimum for the data.
R_STAR_D = 15.3896
R_STAR_N = 5.3097


@dataclass
class Choice:
    n: float
    d: float
    loss: float
    train_flops: float
    inference_flops: float = 0.0

    @property
    def tokens_per_parameter(self) -> float:
        return self.d / self.n

    @property
    def lifetime_flops(self) -> float:
        return self.train_flops + self.inference_flops

    @classmethod
    def at(cls, law: ChinchillaLaw, n: float, d: float, inference_tokens: float = 0.0) -> "Choice":
        """N parameters trained on D tokens (6ND FLOPs) that then serve `inference_tokens` (2N each)."""
        return cls(n, d, law.loss(n, d), 6 * n * d, 2 * n * inference_tokens)


def compute_optimal(law: ChinchillaLaw, compute: float) -> Choice:
    return Choice.at(law, *law.optimum(compute))


def tokens_for_loss(law: ChinchillaLaw, n: float, target: float) -> float:
    """D with L(N, D) = target, or inf when a model of N parameters cannot reach it."""
    room = target - law.E - law.A / n ** law.alpha
    return (law.B / room) ** (1 / law.beta) if room > 0 else math.inf


def inference_optimal(law: ChinchillaLaw, compute: float, inference_tokens: float) -> tuple[Choice, Choice]:
    """Sardana et al. 2023, "Beyond Chinchilla-Optimal": the (N, D) reaching the loss the
    compute-optimal model of this budget reaches, at the least lifetime compute 6·N·D +
    2·N·inference_tokens. Returns (that choice, the compute-optimal one with the same
    inference) — the second's lifetime FLOPs minus the first's is what the sizing saves."""
    reference = compute_optimal(law, compute)
    reference.inference_flops = 2 * reference.n * inference_tokens
    target = reference.loss

    def lifetime(log_n: float) -> float:
        n = math.exp(log_n)
        return Choice.at(law, n, tokens_for_loss(law, n, target), inference_tokens).lifetime_flops

    # The smallest N that can reach the target, and the compute-optimal N: more inference only
    # ever favours a smaller model (Sardana et al. section 3), so the optimum lies between.
    n_floor = (law.A / (target - law.E)) ** (1 / law.alpha)
    result = minimize_scalar(lifetime, bounds=(math.log(n_floor) + 1e-9, math.log(reference.n)), method="bounded",
                             options={"xatol": 1e-10})
    n = math.exp(result.x)
    return Choice.at(law, n, tokens_for_loss(law, n, target), inference_tokens), reference


def effective_data(unique_tokens: float, tokens: float) -> float:
    """Tokens of fresh data worth as much as `tokens` drawn from `unique_tokens` repeated:
    U + U·R*·(1 − exp(−R/R*)), R = tokens/U − 1 repetitions (Muennighoff et al. eq. 5)."""
    if tokens <= unique_tokens:
        return tokens
    repeats = tokens / unique_tokens - 1
    return unique_tokens * (1 + R_STAR_D * (1 - math.exp(-repeats / R_STAR_D)))


def effective_parameters(law: ChinchillaLaw, unique_tokens: float, n: float) -> float:
    """Parameters beyond the compute-optimal size for the unique data decay like repeated data
    (Muennighoff et al. eq. 5 with R*_N): U_N = min(N, N_opt for D = U), N' = U_N + U_N·R*_N·(1 −
    exp(−R_N/R*_N)), R_N = N/U_N − 1."""
    a, b = law.alpha, law.beta
    g = (a * law.A / (b * law.B)) ** (1 / (a + b))
    n_for_data = g * (g * unique_tokens) ** (b / a)  # N_opt whose D_opt is the unique data
    if n <= n_for_data:
        return n
    repeats = n / n_for_data - 1
    return n_for_data * (1 + R_STAR_N * (1 - math.exp(-repeats / R_STAR_N)))


def data_constrained_loss(law: ChinchillaLaw, n: float, d: float, unique_tokens: float) -> float:
    return law.loss(effective_parameters(law, unique_tokens, n), effective_data(unique_tokens, d))


def expected_loss(law: ChinchillaLaw, n: float, d: float, unique_tokens: float | None = None) -> float:
    """`law`'s loss at N, D; with a limit on unique tokens, of D's repeated epochs (data_constrained_loss)."""
    return data_constrained_loss(law, n, d, unique_tokens) if unique_tokens else law.loss(n, d)


def data_constrained_optimal(law: ChinchillaLaw, compute: float, unique_tokens: float) -> Choice:
    """The (N, D = C / 6N) of least data-constrained loss when only unique_tokens exist: D
    above unique_tokens means repeating data for D / unique_tokens epochs."""
    def loss(log_n: float) -> float:
        n = math.exp(log_n)
        return data_constrained_loss(law, n, compute / (6 * n), unique_tokens)

    n_opt, _ = law.optimum(compute)
    low, high = math.log(n_opt) - 8, math.log(n_opt) + 8
    result = minimize_scalar(loss, bounds=(low, high), method="bounded", options={"xatol": 1e-10})
    if result.x > high - 1e-3:  # (the loss still falls at e^8 N_opt: the data is used up, not the compute)
        raise ValueError(f"{unique_tokens:.3g} unique tokens are too few for {compute:.3g} FLOPs: repeated, they stop "
                         "teaching anything long before the budget is spent, and the data-constrained loss keeps "
                         f"falling only as the model grows past {math.exp(high):.3g} parameters (e^8 times the "
                         "compute-optimal size); give more unique tokens or less compute")
    n = math.exp(result.x)
    return Choice(n, compute / (6 * n), float(result.fun), compute)


def predict(law: ChinchillaLaw, compute: float, bootstrap: list[ChinchillaLaw] = ()) -> dict:
    """For a budget: N_opt, D_opt and the loss there, each with the 95% interval over the
    bootstrap refits (the planner's entry point)."""
    from scaletrain.scaling.fit import interval

    choice = compute_optimal(law, compute)
    result = {"compute": compute, "n": choice.n, "d": choice.d, "loss": choice.loss,
              "tokens_per_parameter": choice.tokens_per_parameter}
    if bootstrap:
        choices = [compute_optimal(sample, compute) for sample in bootstrap]
        for key in ("n", "d", "loss"):
            result[f"{key}_interval"] = list(interval([getattr(c, key) for c in choices]))
    return result
