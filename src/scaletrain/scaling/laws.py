"""Law forms and published laws.

N is the model's parameter count and D its training tokens. scaletrain's own laws count N as
*every* parameter — embeddings and the output head included (model/flops.py `param_counts`
"total"), nothing left out silently — and C as the exact training FLOPs of model/flops.py;
the 6ND approximation is recorded beside it. Published laws carry their own conventions,
stated with each preset.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ChinchillaLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, "Training Compute-Optimal
    Large Language Models", eq. 2 / approach 3): an irreducible loss plus one term that falls
    with model size and one that falls with data."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = "fitted"

    def loss(self, n: float, d: float) -> float:
        if n == 0 or d == 0:  # an optimum beyond a float (see optimum): no model, or no data
            return math.inf
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def optimum(self, compute: float, flops_per_param_token: float = 6.0) -> tuple[float, float]:
        """(N_opt, D_opt) minimising L subject to flops_per_param_token · N · D = compute: the
        closed form of Hoffmann et al. appendix D.2, N_opt = G (C/6)^(β/(α+β)), D_opt = G⁻¹
        (C/6)^(α/(α+β)), G = (αA / βB)^(1/(α+β))."""
        a, b = self.alpha, self.beta
        # In logs: exponents near 0 (a resample of few points can fit them) put G beyond a float
        # either way; N_opt or D_opt is then inf (and the other 0) rather than an OverflowError.
        log_g = (math.log(a * self.A) - math.log(b * self.B)) / (a + b)
        log_scaled = math.log(compute / flops_per_param_token)
        log_n = log_g + log_scaled * b / (a + b)
        return _exp(log_n), _exp(log_scaled - log_n)

    @property
    def exponents(self) -> tuple[float, float]:
        """(a, b) of N_opt ∝ C^a and D_opt ∝ C^b."""
        return self.beta / (self.alpha + self.beta), self.alpha / (self.alpha + self.beta)

    def to_dict(self) -> dict:
        return asdict(self)


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf


@dataclass(frozen=True)
class KaplanLaw:
    """L(N, D) = [(N_c / N)^(α_N / α_D) + D_c / D]^α_D (Kaplan et al. 2020, "Scaling Laws for
    Neural Language Models", eq. 1.5) with its joint fit's constants (their table 2; eqs. 1.1 and
    1.2's N_c 8.8e13, D_c 5.4e13, α_D 0.095 are the single-variable laws'), N counting
    non-embedding parameters, losses in nats on WebText2 with GPT-2's tokenizer; compute-optimal
    N ∝ C^0.73 (their section 6)."""

    N_c: float = 6.4e13
    D_c: float = 1.8e13
    alpha_N: float = 0.076
    alpha_D: float = 0.103
    source: str = "Kaplan et al. 2020, eq. 1.5 and table 2 (N: non-embedding parameters)"

    def loss(self, n: float, d: float) -> float:
        return ((self.N_c / n) ** (self.alpha_N / self.alpha_D) + self.D_c / d) ** self.alpha_D

    @property
    def exponents(self) -> tuple[float, float]:
        return 0.73, 0.27

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "hoffmann": ChinchillaLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28,
                              source="Hoffmann et al. 2022, approach 3 as published (eq. 10); N total parameters"),
    "epoch": ChinchillaLaw(E=1.82, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658,
                           source="Besiroglu et al. 2024 (Epoch AI), 'Chinchilla Scaling: A replication attempt', "
                                  "refit of Hoffmann et al.'s figure 4 points, as the paper reports it (E to two "
                                  "places; N total parameters)"),
    "kaplan": KaplanLaw(),
}


def preset(name: str):
    """A published law by name: hoffmann, epoch or kaplan."""
    if name not in PRESETS:
        raise ValueError(f"no published law {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
