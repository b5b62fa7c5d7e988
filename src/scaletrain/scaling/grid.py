"""IsoFLOP grids: which model shapes to train at each compute budget, for how many tokens, with
which learning rate and batch — all arithmetic, no torch.

For each budget C the grid takes `shapes` models whose parameter counts N are spaced evenly in
log over a 10x range centred on the expected optimum N_opt(C) (from a prior law, or from a fit
of budgets already run), each trained for D = C / F(N) tokens, F being the exact training
FLOPs per token of model/flops.py. N counts every parameter (embeddings and output head too).

Shapes come from one family — widths from 16 to 1024 spaced about 1.15-1.5x, heads of width
32 (16, or one head, below that), depth about width / 64 (GPT-2 small's aspect ratio, 768 /
12) — so that N is the one thing varying along a profile, smoothly. (A family mixing depths at
one width gave profiles whose loss jumped between neighbouring N. One with only 16, 32, 48,
64, 96 below width 128 left tiny budgets' minima on its smallest shapes, with nothing below
them; widths 24 and 40 fixed that. A minimum depth of 2 instead of 1 made the narrow end
worse. Depth width / 32 put the step from one layer to two at width 48, between the CPU
demo's swept optimum and its extrapolated one: a law fitted on 1-layer models then predicted
2-layer ones, and missed by 5.3% on average over three seeds, against 4.0% at width / 64;
BENCHMARKS.md. Kaplan et al. 2020, figure 5: at fixed N, loss changes little over a wide
range of aspect ratios.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from scaletrain.config import ModelConfig
from scaletrain.scaling.hparams import DEEPSEEK
from scaletrain.model.flops import param_counts, train_flops_per_token

HEAD_DIM = 32


@dataclass(frozen=True)
class Shape:
    dim: int
    n_layers: int

    @property
    def name(self) -> str:
        return f"d{self.dim}-l{self.n_layers}"

    def model(self, vocab_size: int, max_seq_len: int) -> ModelConfig:
        if self.dim % HEAD_DIM == 0:
            heads = self.dim // HEAD_DIM
        else:  # narrow widths: heads of 16 (width 48: 3), else one head (width 24, 40)
            heads = self.dim // 16 if self.dim % 16 == 0 else 1
        return ModelConfig(vocab_size=vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=heads,
                           max_seq_len=max_seq_len)


WIDTHS = (16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def family(vocab_size: int) -> list[tuple[int, Shape]]:
    """(N, shape) of every shape in the family, by increasing N: one depth per width (about
    width / 64 layers), so that N grows smoothly along a profile."""
    shapes = [Shape(dim, max(1, round(dim / 64))) for dim in WIDTHS]
    return sorted(((param_counts(s.model(vocab_size, 64))["total"], s) for s in shapes), key=lambda pair: pair[0])


def shapes_around(n_opt: float, count: int, vocab_size: int, span: float = 10.0,
                  allowed: Callable[[Shape], bool] | None = None) -> list[Shape]:
    """`count` distinct shapes (fewer when fewer are `allowed`) whose N are nearest to `count`
    targets spaced evenly in log N over `span`x centred on n_opt."""
    candidates = [(n, s) for n, s in family(vocab_size) if allowed is None or allowed(s)]
    count = min(count, len(candidates))
    if count == 1:
        targets = [n_opt]
    else:
        low = math.log(n_opt / math.sqrt(span))
        targets = [math.exp(low + i * math.log(span) / (count - 1)) for i in range(count)]
    chosen: list[Shape] = []
    for target in targets:
        free = [(abs(math.log(n / target)), s) for n, s in candidates if s not in chosen]
        chosen.append(min(free, key=lambda pair: pair[0])[1])
    return sorted(chosen, key=lambda s: param_counts(s.model(vocab_size, 64))["total"])


# -- hyperparameters ------------------------------------------------------------------------------


def deepseek_hyperparameters(compute: float, dim: int) -> tuple[float, float]:
    """(peak learning rate, batch size in tokens) for a run of `compute` FLOPs: DeepSeek LLM
    (DeepSeek-AI 2024, "DeepSeek LLM: Scaling Open-Source Language Models with Longtermism",
    section 3.1) fitted η_opt = 0.3118 · C^−0.125 and B_opt = 0.2920 · C^0.3271 (tokens).

    The rule is a function of the width too, so that a rule with a width correction can be
    swapped in (`Sweep(..., hyperparameters=...)`, or a law measured on the user's data by
    `scaletrain hparams`: scaling/hparams.py); this one applies none, as measured: on the
    built-in corpus at 4e11 FLOPs, widths 24 to 80 (1 and 2 layers) all trained best at 0.01
    of {0.005, 0.01, 0.02}, and η_opt(4e11) = 0.011. (A μP-style (1024 / width)^0.5 correction,
    capped at 0.02, doubled the rate of every narrow shape and made the 2-layer ones unstable:
    +0.25 to +0.6 nats at 1e12 FLOPs; BENCHMARKS.md.)

    `compute` is this project's count (model/flops.py: the output head and attention's whole score
    matrix included). DeepSeek's C is M·D with M = 72 L d² + 12 L d T, the FLOPs per token without
    the output head: for the CPU demo's narrow models (vocabulary 512, sequences of 128) ours is
    1.6x (width 64) to 1.9x (width 24) theirs, which gives a rate 5-8% lower and a batch 16-24%
    larger than their rule would for the same run; 1.01x at width 1024. The
    measurements above were taken with this count."""
    return DEEPSEEK(compute, dim)


def warmup_steps(n: int, batch_tokens: int, longest: int) -> int:
    """Warmup of a model of n parameters: as many tokens as parameters (Porian et al. 2024,
    "Resolving Discrepancies in Compute-Optimal Scaling of Language Models", section 3: a
    warmup of N tokens, shorter than the fixed ones Kaplan et al. used for small models), in
    steps of batch_tokens, at most `longest` steps."""
    return max(1, min(round(n / batch_tokens), longest))


Hyperparameters = Callable[[float, int], tuple[float, float]]


@dataclass
class Point:
    """One (shape, budget) of the grid."""

    shape: Shape
    budget: float
    n: int  # all parameters
    flops_per_token: int
    seq_len: int
    batch_seqs: int  # sequences per optimizer step
    steps: int
    lr: float

    @property
    def name(self) -> str:
        return f"C{self.budget:.4g}-{self.shape.name}".replace("+", "")

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_seqs * self.seq_len

    @property
    def step_flops(self) -> int:
        """Training FLOPs of one optimizer step."""
        return self.batch_seqs * self.seq_len * self.flops_per_token

    @property
    def compute(self) -> float:
        """Exact training FLOPs of the point as run (whole steps)."""
        return float(self.tokens * self.flops_per_token)

    @property
    def compute_6nd(self) -> float:
        return 6.0 * self.n * self.tokens


def steps_for(budget: float, flops_per_token: int, batch_seqs: int, seq_len: int) -> float:
    """Optimizer steps (unrounded) that spend `budget` FLOPs at this batch."""
    return budget / flops_per_token / (batch_seqs * seq_len)


def plan_points(budget: float, shapes: list[Shape], vocab_size: int, seq_len: int,
                hyperparameters: Hyperparameters = deepseek_hyperparameters, min_steps: int = 20,
                micro_batch: int = 8) -> list[Point]:
    """The points of one budget: tokens D = C / F(N) in whole steps of the rule's batch (made
    smaller, down to one micro-batch, when that would leave fewer than min_steps steps)."""
    points = []
    for shape in shapes:
        model = shape.model(vocab_size, seq_len)
        n = param_counts(model)["total"]
        per_token = train_flops_per_token(model, seq_len)
        lr, batch_tokens = hyperparameters(budget, shape.dim)
        batch_seqs = max(micro_batch, round(batch_tokens / seq_len / micro_batch) * micro_batch)
        while batch_seqs > micro_batch and steps_for(budget, per_token, batch_seqs, seq_len) < min_steps:
            batch_seqs -= micro_batch
        steps = max(1, round(steps_for(budget, per_token, batch_seqs, seq_len)))
        points.append(Point(shape, budget, n, per_token, seq_len, batch_seqs, steps, lr))
    return points
