"""Run an IsoFLOP sweep: the one place that joins training and scaling laws.

Every shape trains once, as a "trunk" at constant learning rate after warmup; each (shape,
budget) point is a cooldown branch taken from the trunk's checkpoint where that point's
warmup-stable-decay schedule would start decaying, then decayed to the point's length
(Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
Durations"). A branch resumes bit-exactly, so each point's losses are those of a separate
WSD run of its length, at the cost of its cooldown only. The sweep directory holds grid.json,
trunks/ and points/ (run directories), and results.csv (a row per finished point); rerunning the same
command continues where it stopped: finished points are kept, unfinished trunks and branches
resume from their checkpoints.

Budgets run smallest first; once two are done, later budgets are centred on the optimum that
approach 2 fits to them instead of the prior law's. A budget takes only shapes that train at
least `min_steps` optimizer steps there (`Sweep.fits`).
"""

from __future__ import annotations

import csv
import heapq
import itertools
import json
import logging
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy

from scaletrain.config import ConfigError, RunConfig, load_config, mix_toml
from scaletrain.data.shards import read_indexes
from scaletrain.model.flops import param_counts, train_flops_per_token
from scaletrain.outputs import check_output_dir, read_own, read_rows
from scaletrain.scaling.fit import Points, fit_allocation
from scaletrain.scaling.grid import (Point, Shape, deepseek_hyperparameters, family, plan_points, shapes_around,
                                    steps_for, warmup_steps)
from scaletrain.scaling.hparams import EXTRAPOLATION_WARNING, HyperparameterLaw
from scaletrain.scaling.laws import ChinchillaLaw, preset
from scaletrain.train.schedule import wsd_decay_start

log = logging.getLogger("scaletrain")

DIVERGED = "DIVERGED"  # in a trunk's directory: the step where it diverged (JSON)
DECAY_FRACTION = 0.2  # of each point's steps spent in its cooldown (Hägele et al.: 10-20% suffice)
COLUMNS = ["name", "budget", "shape", "dim", "n_layers", "n", "d", "c", "c_6nd", "loss", "train_loss", "steps",
           "batch_seqs", "lr", "branch_step"]


@dataclass
class SweepSettings:
    data: str
    budgets: list[float]
    shapes: int = 5
    seq_len: int = 128
    prior: str = "epoch"
    eval_tokens: int = 16384
    micro_batch: int = 8
    min_steps: int = 250
    seed: int = 0
    device: str = "auto"
    optimizer: str = "adamw"  # train.optimizer of every point (Muon takes AdamW's learning rates: optim.py)
    mix: dict[str, float] | None = None  # data.mix of every point (data then holds the mixed directories)
    # The learning-rate and batch rule, a law `scaletrain hparams` measured (HyperparameterLaw.to_dict);
    # None: the rule the Sweep is given (DeepSeek's by default).
    hparams: dict | None = None


class SweepPlan:
    """A sweep's grid without its directory: which points each budget trains, for how many steps,
    at which learning rate and batch. Arithmetic only, so that a sweep can be planned (and timed,
    `predicted_seconds`) at other budgets before anything is trained. `hyperparameters(budget,
    width)` -> (learning rate, tokens per step) is the rule the runs follow, or the measured law
    in settings.hparams."""

    def __init__(self, settings: SweepSettings, vocab_size: int,
                 hyperparameters: Callable[[float, int], tuple[float, float]] = deepseek_hyperparameters):
        if settings.hparams is not None:
            hyperparameters = HyperparameterLaw.from_dict(settings.hparams)
            far = max(hyperparameters.extrapolation(b) or 1.0 for b in settings.budgets)
            if far > EXTRAPOLATION_WARNING:
                log.warning("the learning-rate and batch rule was measured at %s FLOPs; the sweep's budgets reach "
                            "%.2gx beyond them, where it may not hold", hyperparameters.budgets, far)
        self.settings, self.vocab_size, self.hyperparameters = settings, vocab_size, hyperparameters
        self.prior = preset(settings.prior)
        if not isinstance(self.prior, ChinchillaLaw):
            raise ConfigError(f"--prior {settings.prior!r} has no compute-optimal allocation to centre a grid on; "
                              "use epoch or hoffmann")

    @classmethod
    def on_data(cls, settings: SweepSettings,
                hyperparameters: Callable[[float, int], tuple[float, float]] = deepseek_hyperparameters) -> SweepPlan:
        return cls(settings, vocab_size_of(settings), hyperparameters)

    # -- the grid ------------------------------------------------------------------------------

    def n_of(self, shape: Shape) -> int:
        return param_counts(shape.model(self.vocab_size, self.settings.seq_len))["total"]

    def centre(self, budget: float, done: list[dict]) -> tuple[float, str]:
        """N_opt expected at budget: approach 2 on the finished smaller budgets once there are two,
        else the prior. (Only smaller budgets: a resumed sweep must centre a budget as an
        uninterrupted one did, not on that budget's own points finished before the stop.)"""
        done = [row for row in done if row["budget"] < budget and math.isfinite(row["loss"])]
        if len({row["budget"] for row in done}) >= 2:
            points = Points.from_rows(done)
            try:
                allocation = fit_allocation(points, parabola=True)
                return allocation.n_coefficient * budget ** allocation.a, f"approach 2 on {allocation.budgets} budgets"
            except ValueError:
                pass
        return self.prior.optimum(budget)[0], f"prior law {self.settings.prior}"

    def steps_of(self, shape: Shape, budget: float) -> float:
        """Optimizer steps a point of `shape` takes to spend `budget` at the shape's batch."""
        model = shape.model(self.vocab_size, self.settings.seq_len)
        _, batch_seqs, _ = self.shape_plan(shape)
        return steps_for(budget, train_flops_per_token(model, self.settings.seq_len), batch_seqs, self.settings.seq_len)

    def fits(self, shape: Shape, budget: float) -> bool:
        """Whether `shape` trains at least min_steps steps at `budget`. Shorter runs are not
        planned: their loss is still in the early regime, falling faster with D than the law
        that longer runs follow, and the law fitted to them is pessimistic about longer runs.
        (On the built-in corpus, refitting three seeds' CPU demo sweeps on only their points
        of >= 400 and >= 700 steps moved the mean miss at 4x the largest budget from -4.1% to
        -2.4% and +0.1%. It is their tokens, not their updates: twice the steps at the same
        tokens, with half the batch, changed their loss by 1% or less; BENCHMARKS.md.)"""
        return self.steps_of(shape, budget) >= self.settings.min_steps

    def planned(self) -> dict[float, int]:
        """Points the sweep trains at each budget: `shapes`, or as many as fit."""
        candidates = [shape for _, shape in family(self.vocab_size)]
        return {budget: min(self.settings.shapes, sum(self.fits(s, budget) for s in candidates))
                for budget in self.settings.budgets}

    def points_of(self, budget: float, done: list[dict]) -> list[Point]:
        n_opt, why = self.centre(budget, done)
        log.info("budget %.3g FLOPs: shapes around N_opt %.3g (%s)", budget, n_opt, why)
        return self._around(budget, n_opt)

    def prior_points(self, budget: float) -> list[Point]:
        """The points of `budget` centred on the prior law's optimum (as the first two budgets
        are)."""
        return self._around(budget, self.prior.optimum(budget)[0])

    def _around(self, budget: float, n_opt: float) -> list[Point]:
        shapes = shapes_around(n_opt, self.settings.shapes, self.vocab_size, allowed=lambda s: self.fits(s, budget))
        if not shapes:
            smallest = family(self.vocab_size)[0][1]
            steps = self.steps_of(smallest, budget)
            raise ConfigError(f"budget {budget:.3g} FLOPs is too small for a sweep point of at least "
                              f"{self.settings.min_steps} steps (the narrowest shape, {smallest.name}, would train "
                              f"{steps:.0f}); raise it to at least {budget * self.settings.min_steps / steps:.2g} or "
                              "lower --min-steps")
        return plan_points(budget, shapes, self.vocab_size, self.settings.seq_len, self.hyperparameters,
                           micro_batch=self.settings.micro_batch)

    def best_point(self, law: ChinchillaLaw, budget: float) -> tuple[Point, int]:
        """(point, warmup steps) of the shape a fitted law predicts to reach the lowest loss at
        `budget`, trained as the sweep trains that shape (its learning rate, batch and warmup),
        among the family's shapes that train at least min_steps there.

        The lowest predicted loss, not the shape nearest N_opt in log N: L(N, C/F(N)) need not
        rise alike on both sides of the optimum (with beta > alpha, as the CPU demo fits, it
        rises faster above), and the family's shapes are up to 1.9x apart in N, so the nearest
        one can be the worse; the loss is also taken at the tokens the exact FLOPs per token
        buy, not at 6ND. (On the
        CPU demo, seed 4, N_opt was 259k: the nearest shape, d96-l2 with 320k parameters, was
        predicted 2.533 and reached 2.655; the next below, d80-l1 with 169k, was predicted
        2.532 and reached 2.523; BENCHMARKS.md.)"""
        candidates = []
        for _, shape in family(self.vocab_size):
            if not self.fits(shape, budget):
                continue
            lr, batch_seqs, warmup = self.shape_plan(shape)
            point = plan_points(budget, [shape], self.vocab_size, self.settings.seq_len,
                                lambda c, d: (lr, batch_seqs * self.settings.seq_len),
                                micro_batch=self.settings.micro_batch)[0]
            candidates.append((law.loss(point.n, point.tokens), point, warmup))
        if not candidates:
            raise ConfigError(f"no shape of the family trains {self.settings.min_steps} steps at {budget:.3g} FLOPs; "
                              "raise the budget or lower min_steps")
        _, point, warmup = min(candidates, key=lambda c: c[0])
        return point, warmup

    def best_run(self, law: ChinchillaLaw, budget: float, overrides: list[str] = ()) -> tuple[Point, RunConfig]:
        """best_point's point and the config that trains it as a single warmup-stable-decay run
        (then `overrides`, e.g. run.dir and run.name)."""
        point, warmup = self.best_point(law, budget)
        cfg = load_config(None, [*self.run_overrides(point, point.lr, point.batch_seqs, warmup),
                                 f"train.steps={point.steps}", "train.schedule=wsd",
                                 f"train.decay_fraction={DECAY_FRACTION}", *overrides])
        return point, cfg

    def shape_plan(self, shape: Shape) -> tuple[float, int, int]:
        """(learning rate, sequences per step, warmup steps) of every run of `shape`. One trunk
        serves all its budgets, so these cannot follow each budget's rule: they are the rule's
        at the sweep's largest budget (the trunk's final length). The warmup is the shape's N
        in tokens (Porian et al. 2024), at most min_steps / 2 steps, so that it ends before any
        point's cooldown begins (no point is shorter than min_steps; its cooldown is its last
        fifth)."""
        s = self.settings
        lr, batch_tokens = self.hyperparameters(max(s.budgets), shape.dim)
        largest = plan_points(max(s.budgets), [shape], self.vocab_size, s.seq_len, lambda c, d: (lr, batch_tokens),
                              micro_batch=s.micro_batch)[0]
        warmup = warmup_steps(largest.n, largest.batch_seqs * s.seq_len, max(1, s.min_steps // 2))
        return lr, largest.batch_seqs, warmup

    def run_overrides(self, point: Point, lr: float, batch_seqs: int, warmup: int) -> list[str]:
        return run_overrides(self.settings, self.vocab_size, point.shape, lr, batch_seqs, warmup, self.settings.mix)

    def scheduled(self, point: Point) -> tuple[Point, int]:
        """(point, branch step): the point at its shape's batch (shape_plan), in whole steps, and
        the trunk step its cooldown branch starts from."""
        lr, batch_seqs, warmup = self.shape_plan(point.shape)
        s = self.settings
        steps = max(1, round(steps_for(point.budget, point.flops_per_token, batch_seqs, s.seq_len)))
        point = Point(point.shape, point.budget, point.n, point.flops_per_token, s.seq_len, batch_seqs, steps, lr)
        return point, wsd_decay_start(steps, warmup, DECAY_FRACTION)

    def calls(self) -> dict[float, list[tuple[Point, list[int]]]]:
        """The trainer's calls a whole sweep would make from nothing, by budget: for each point
        (at its shape's batch), the steps of each call — one extending the shape's trunk to the
        branch step where it is not there yet, one training the branch. Every budget is centred
        on the prior law; a running sweep recentres from its third budget on, on approach 2 of
        those before, so these are the calls of a sweep near this one."""
        trunk_at: dict[Shape, int] = {}
        calls = {}
        for budget in sorted(self.settings.budgets):
            calls[budget] = []
            for planned in self.prior_points(budget):
                point, branch_at = self.scheduled(planned)
                extend = branch_at - trunk_at.get(point.shape, 0)
                trunk_at[point.shape] = max(branch_at, trunk_at.get(point.shape, 0))
                calls[budget].append((point, [extend] * (extend > 0) + [point.steps - branch_at]))
        return calls

    def budget_flops(self) -> dict[float, float]:
        """The training FLOPs of each budget's calls (`calls`): trunk extensions and branches."""
        return {budget: sum(sum(steps) * point.step_flops for point, steps in points)
                for budget, points in self.calls().items()}

    def predicted_seconds(self, speed: Speed, workers: int = 1, alone: Speed | None = None) -> float:
        """Wall-clock seconds the calls of a whole sweep (`calls`) would take at `speed`
        (measure_speed's, of `workers` runs at once; `alone`, of one)."""
        return sum(self.budget_seconds(speed, workers, alone).values())

    def budget_seconds(self, speed: Speed, workers: int = 1, alone: Speed | None = None) -> dict[float, float]:
        """predicted_seconds by budget: budget after budget, each budget's points handed in order
        to `workers` processes (makespan: at `speed` while `workers` run, faster towards `alone`
        as a budget's last points run with fewer beside them; at `speed` throughout without
        it). Every call costs what the timed runs cost: a trunk's extension neither evaluates
        nor starts fresh as a timed run does."""
        def lengths(at: Speed, points) -> list[float]:
            return [sum(at.seconds(point, steps) for steps in each) for point, each in points]

        return {budget: makespan(lengths(speed, points), workers, None if alone is None else lengths(alone, points))
                for budget, points in self.calls().items()}


class Sweep(SweepPlan):
    """The sweep in directory `out`. `hyperparameters` is the rule the runs follow (DeepSeek's by
    default, scaling.grid); with concurrency > 1 the workers are spawned processes, which import
    it by name, so it must be a module-level function, not a lambda or a closure. A measured law
    in settings.hparams takes its place (and, unlike a function, is recorded in grid.json and so
    kept on resuming)."""

    def __init__(self, out: Path, settings: SweepSettings,
                 hyperparameters: Callable[[float, int], tuple[float, float]] = deepseek_hyperparameters):
        self.out = Path(out)
        check_output_dir(self.out, "sweep")
        saved = self.out / "grid.json"
        if saved.is_file():
            # (a setting added since the sweep began has its default there)
            before = asdict(SweepSettings(**read_own(saved, "settings")["settings"]))
            if before != asdict(settings):
                changed = {k: (before.get(k), v) for k, v in asdict(settings).items() if before.get(k) != v}
                raise ConfigError(f"sweep directory {str(self.out)!r} was started with other settings "
                                  f"({', '.join(f'{k}: {a} then, {b} now' for k, (a, b) in changed.items())}); "
                                  "rerun it with the same ones or choose a new --out")
        super().__init__(settings, vocab_size_of(settings), hyperparameters)
        for budget in settings.budgets:  # (a budget too small for any point is refused before grid.json is written)
            self.prior_points(budget)
        self.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"settings": asdict(settings), "vocab_size": self.vocab_size}, indent=1) + "\n"
        if not saved.is_file() or saved.read_text() != text:  # workers of a concurrent sweep open it too
            temporary = saved.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(text)
            temporary.replace(saved)

    @classmethod
    def open(cls, out: Path) -> Sweep:
        """The sweep that `out` holds, with the settings it was started with (and the default
        hyperparameter rule unless it was started with a measured one: a swapped-in function is
        code, not recorded in grid.json)."""
        saved = Path(out) / "grid.json"
        if not saved.is_file():
            raise ConfigError(f"{str(out)!r} is not a sweep directory (no grid.json)")
        return cls(out, SweepSettings(**read_own(saved, "settings")["settings"]))

    # -- running -------------------------------------------------------------------------------

    def results(self) -> list[dict]:
        path = self.out / "results.csv"
        if not path.is_file():
            return []
        return read_rows(path, ("name", "shape"))

    def _record(self, row: dict) -> None:
        path = self.out / "results.csv"
        new = not path.is_file()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            if new:
                writer.writeheader()
            writer.writerow(row)

    def run(self, progress: Callable[[dict], None] | None = None, concurrency: int = 1, pool=None,
            speed: Speed | None = None) -> list[dict]:
        """Run every point not yet in results.csv; returns all rows. progress gets a dict of
        points done / total, FLOPs spent on them (their trunks and branches: savings), achieved
        FLOP/s and an ETA after each point: what is
        left, in the seconds `speed` (measure_speed's) predicts for each budget's points or
        else in the points' budgets, at the rate this call has done such units (a branch costs
        less than its budget, so FLOPs spent would overstate what is left by the share saved).

        concurrency > 1 trains that many points of a budget at once in worker processes (the
        points of one budget have distinct shapes, hence distinct trunks): tiny models leave a
        device mostly idle one at a time. With several GPUs, workers take them in turn. Budgets
        still run one after another, since each is centred on the fit of those before it. `pool`:
        worker_pool(concurrency, ...) to run them in, kept open (else one is made and closed)."""
        done = self.results()
        finished = {row["name"] for row in done}
        budgets = sorted(self.settings.budgets)
        planned = self.planned()
        total = sum(planned.values())
        started = time.perf_counter()
        self.spent_here = 0.0
        if speed is not None:
            unit = {b: seconds / max(planned[b], 1) for b, seconds in self.budget_seconds(speed, concurrency).items()}
        else:
            unit = {b: b for b in budgets}
        units_here = 0.0
        own_pool = pool is None and concurrency > 1
        if own_pool:
            pool = worker_pool(concurrency, self.settings.device)
        elif concurrency == 1:
            pool = None
        try:
            for budget in budgets:
                todo = [point for point in self.points_of(budget, done) if point.name not in finished]
                if pool is None:
                    from scaletrain.train.trainer import train
                    results = (self._run_point(point, train) for point in todo)
                else:
                    results = pool.map(_run_in_worker, [(self.out, self.settings, self.hyperparameters, point)
                                                        for point in todo])
                for row, cost in results:
                    self._record(row)
                    done.append(row)
                    finished.add(row["name"])
                    self.spent_here += cost
                    units_here += unit[row["budget"]]
                    if progress:
                        elapsed = time.perf_counter() - started
                        finished_by_budget = Counter(r["budget"] for r in done)
                        left = sum(unit[b] * max(k - finished_by_budget[b], 0) for b, k in planned.items())
                        progress({"done": len(done), "total": total, "flops": self.savings(done)["branched_flops"],
                                  "name": row["name"],
                                  "flops_per_s": self.spent_here / elapsed, "eta_s": elapsed / units_here * left})
        finally:
            if own_pool:
                pool.shutdown(cancel_futures=True)
        self.elapsed_s = time.perf_counter() - started
        return done

    def _run_point(self, point: Point, train) -> tuple[dict, float]:
        """Extend the shape's trunk to the point's branch step, then train the cooldown branch.
        Returns the point's row and the FLOPs this call actually spent. A run that diverges is
        recorded with a loss of nan (left out of fits), not retried: a rerun would diverge the
        same way. A trunk that diverged says so in its directory (DIVERGED), and the shape's
        later points are recorded as diverged without training."""
        from scaletrain.train.trainer import TrainingDiverged

        s = self.settings
        _, _, warmup = self.shape_plan(point.shape)
        point, branch_at = self.scheduled(point)
        lr, batch_seqs, steps = point.lr, point.batch_seqs, point.steps
        if branch_at >= steps:
            raise ConfigError(f"point {point.name} would train {steps} steps, no more than its warmup of {warmup}: "
                              "the budgets are too small for this shape's batch; raise the smallest budget or "
                              "lower --seq-len")
        trunk_dir = self.out / "trunks" / point.shape.name
        overrides = self.run_overrides(point, lr, batch_seqs, warmup)
        spent = 0.0
        loss = train_loss = math.nan
        diverged = _diverged_at(trunk_dir)
        trunk_step = _newest_step(trunk_dir)
        if diverged is None and branch_at > trunk_step:
            # The trunk never decays: constant after warmup, the same warmup as every branch.
            # Its length is that of the shape's longest possible point, so that extending it for a
            # later budget changes nothing in its config (the constant schedule ignores it anyway).
            longest = max(round(steps_for(max(s.budgets), point.flops_per_token, batch_seqs, s.seq_len)), branch_at, 1)
            cfg = load_config(None, [*overrides, f"run.dir={trunk_dir.parent}", f"run.name={trunk_dir.name}",
                                     "train.schedule=constant", f"train.steps={longest}", "checkpoint.interval=0"])
            try:
                train(cfg, stop_at_step=branch_at)
                spent += (branch_at - trunk_step) * point.step_flops
            except TrainingDiverged as e:
                diverged = max(e.step, trunk_step + 1)
                spent += (diverged - trunk_step) * point.step_flops
                (trunk_dir / DIVERGED).write_text(json.dumps({"step": diverged, "error": str(e)}) + "\n")
        if diverged is not None:
            log.warning("the trunk of shape %s diverged at step %d (%s); point %s and the shape's later points "
                        "are recorded with a loss of nan and left out of fits", point.shape.name, diverged,
                        trunk_dir / DIVERGED, point.name)
        else:
            point_dir = self.out / "points" / point.name
            begun = _newest_step(point_dir)  # (a branch stopped part-way resumes from its own checkpoint)
            if begun > 0 or branch_at == 0:
                resume = "auto"
            else:
                resume = str(trunk_dir / "checkpoints" / f"step_{branch_at:07d}")
            cfg = load_config(None, [*overrides, f"run.dir={point_dir.parent}", f"run.name={point_dir.name}",
                                     "train.schedule=wsd", f"train.decay_fraction={DECAY_FRACTION}",
                                     f"train.steps={steps}", f"checkpoint.resume={resume}",
                                     f"checkpoint.interval={max(1, (steps - branch_at) // 2)}"])
            start, end = max(branch_at, begun), steps
            try:
                result = train(cfg)
                loss, train_loss = result.val_loss, result.train_loss
            except TrainingDiverged as e:
                end = min(max(e.step, start), steps)
                log.warning("point %s diverged (%s); it is recorded with a loss of nan and left out of fits",
                            point.name, e)
            spent += (end - start) * point.step_flops
        row = {"name": point.name, "budget": point.budget, "shape": point.shape.name, "dim": point.shape.dim,
               "n_layers": point.shape.n_layers, "n": point.n, "d": point.tokens, "c": point.compute,
               "c_6nd": point.compute_6nd, "loss": loss, "train_loss": train_loss,
               "steps": steps, "batch_seqs": batch_seqs, "lr": lr, "branch_step": branch_at}
        return row, spent

    def savings(self, rows: list[dict] | None = None) -> dict:
        """FLOPs of the branched sweep against one separate run per point."""
        rows = rows if rows is not None else self.results()
        separate = sum(row["c"] for row in rows)
        by_shape: dict[str, list[dict]] = {}
        for row in rows:
            by_shape.setdefault(row["shape"], []).append(row)
        branched = 0.0
        for shape_rows in by_shape.values():
            per_step = [row["c"] / row["steps"] for row in shape_rows]
            trunk = max(row["branch_step"] * f for row, f in zip(shape_rows, per_step))
            branched += trunk + sum((row["steps"] - row["branch_step"]) * f for row, f in zip(shape_rows, per_step))
        return {"separate_flops": separate, "branched_flops": branched,
                "saved_fraction": 1 - branched / separate if separate else 0.0}


def vocab_size_of(settings: SweepSettings) -> int:
    """The sweep's vocabulary: its data's (the largest of a mixture's), rounded up to a multiple
    of 64."""
    root = Path(settings.data)
    sources = {name: root / name for name in settings.mix} if settings.mix else {root.name: root}
    try:
        indexes = read_indexes(sources)
    except Exception as e:
        raise ConfigError(f"--data {settings.data!r}{' with --mix' if settings.mix else ''}: {e}") from None
    if settings.mix is not None and not (settings.mix and all(0 < w < math.inf for w in settings.mix.values())):
        raise ConfigError(f"--mix {settings.mix}: give each data directory's weight, positive (e.g. code=0.3,prose=0.7)")
    return -(-max(index["vocab_size"] for index in indexes.values()) // 64) * 64


def run_overrides(s, vocab_size: int, shape: Shape, lr: float, batch_seqs: int, warmup: int,
                  mix: dict[str, float] | None = None) -> list[str]:
    """The config overrides of one small run of `shape` on settings `s` (a sweep's or a mixture
    search's: data, seq_len, micro_batch, seed, device, eval_tokens, optimizer), on the mixture
    `mix` of the directories under s.data if given: evaluated once, at the end; no periodic
    checkpoints beyond the caller's."""
    model = shape.model(vocab_size, s.seq_len)
    return [f"data.path={s.data}", *([f"data.mix={mix_toml(mix)}"] if mix else []), f"data.seq_len={s.seq_len}",
            f"model.vocab_size={vocab_size}", f"model.dim={model.dim}", f"model.n_layers={model.n_layers}",
            f"model.n_heads={model.n_heads}", f"model.max_seq_len={s.seq_len}",
            f"train.global_batch_tokens={batch_seqs * s.seq_len}", f"train.micro_batch={micro_batch_of(batch_seqs, s)}",
            f"train.lr={lr}", f"train.warmup_steps={warmup}", f"run.seed={s.seed}", f"train.device={s.device}",
            f"eval.tokens={s.eval_tokens}", "eval.interval=0", "log.interval=50", "checkpoint.keep=2",
            f"train.optimizer={s.optimizer}"]


def micro_batch_of(batch_seqs: int, s) -> int:
    """Sequences a micro-batch of a step of batch_seqs: s.micro_batch, or all of a smaller step,
    or the largest that divides the step (12 sequences, micro-batches of at most 8: 4)."""
    return _micro_batch(batch_seqs, s.micro_batch)


def _micro_batch(batch_seqs: int, micro_batch: int) -> int:
    largest = min(micro_batch, batch_seqs)
    return largest if batch_seqs % largest == 0 else math.gcd(batch_seqs, largest)


# -- timing ---------------------------------------------------------------------------------------


@dataclass
class Speed:
    """What training a shape family costs on this machine, measured (measure_speed) at a few
    parameter counts n: the seconds a call of the trainer takes beyond its steps (building the
    model and the loader, the first step's warm-up, the final evaluation and checkpoint), and
    training FLOPs per second over its steps. In between, both are interpolated in log N;
    beyond, FLOP/s follows the nearest segment's slope, taken between 0 (a fixed rate) and 1 (a
    fixed time per step, as where kernel launches bound a tiny model), and the overhead is the
    nearest one's.

    A step of another batch than the one timed (`timed_seqs`, sequences a step at each n, in
    micro-batches of at most `micro_batch`) costs `step_fixed_s` whatever its batch (the
    optimizer's step, the clipping, the loss brought to the host), `micro_batch_s` a micro-batch
    whatever its sequences (its kernels' launches) and the rest of the step timed in proportion
    to its sequences: a step of a quarter of the batch timed takes more than a quarter of its
    time (hparams' batch factors). Measured where asked (time_points `fixed`), 0 otherwise:
    every step is then in proportion to its FLOPs."""

    n: list[float]
    flops_per_s: list[float]
    overhead_s: list[float]
    timed_seqs: list[int] | None = None
    micro_batch: int | None = None
    step_fixed_s: float = 0.0
    micro_batch_s: float = 0.0

    def rate(self, n: float) -> float:
        logs, rates, x = [math.log(m) for m in self.n], [math.log(r) for r in self.flops_per_s], math.log(n)
        if len(logs) == 1:
            return self.flops_per_s[0]
        if x <= logs[0]:
            i, anchor = 1, 0
        elif x >= logs[-1]:
            i = anchor = len(logs) - 1
        else:
            i = next(k for k, m in enumerate(logs) if m >= x)
            anchor = i - 1
        slope = (rates[i] - rates[i - 1]) / (logs[i] - logs[i - 1])
        if anchor != i - 1 or x < logs[0]:
            slope = min(max(slope, 0.0), 1.0)
        return math.exp(rates[anchor] + slope * (x - logs[anchor]))

    def overhead(self, n: float) -> float:
        return float(numpy.interp(math.log(n), [math.log(m) for m in self.n], self.overhead_s))

    def seconds(self, point: Point, steps: int) -> float:
        """A call of the trainer that trains `steps` steps of `point`."""
        step = point.step_flops / self.rate(point.n)
        if (self.step_fixed_s or self.micro_batch_s) and self.timed_seqs and self.micro_batch:
            timed = self.timed_seqs[int(numpy.argmin([abs(math.log(point.n / m)) for m in self.n]))]
            timed_s, micro_batches = step * timed / point.batch_seqs, timed // _micro_batch(timed, self.micro_batch)
            # (of the step timed, at most all)
            scale = min(1.0, timed_s / (self.step_fixed_s + micro_batches * self.micro_batch_s))
            per_step, per_micro_batch = self.step_fixed_s * scale, self.micro_batch_s * scale
            each = (timed_s - per_step - micro_batches * per_micro_batch) / timed
            step = (per_step + point.batch_seqs // _micro_batch(point.batch_seqs, self.micro_batch) * per_micro_batch
                    + point.batch_seqs * each)
        return self.overhead(point.n) + steps * step

    def scaled(self, factor: float, overhead_s: float) -> Speed:
        return Speed(list(self.n), [r * factor for r in self.flops_per_s], [overhead_s] * len(self.n),
                     self.timed_seqs, self.micro_batch, self.step_fixed_s / factor, self.micro_batch_s / factor)

    def to_dict(self) -> dict:
        return asdict(self)


def makespan(seconds: list[float], workers: int, alone: list[float] | None = None) -> float:
    """When the last of these jobs ends, each taken in order by the first of `workers` processes
    to be free (as a process pool's map hands them out). `seconds` are the jobs' lengths with
    `workers` running at once; `alone`, if given, their lengths with none beside them, and with k
    running a job goes at the pace interpolated linearly in k between the two. (On a device the
    runs share, a step's time grows with the runs beside it, from flat where launches bound it
    to in proportion where the device does: convex in k, so the chord errs long.)"""
    if alone is None or workers == 1:
        free = [0.0] * max(1, workers)
        for length in seconds:
            heapq.heapreplace(free, free[0] + length)
        return max(free)
    pending = iter([(a, t) for a, t in zip(alone, seconds) if max(a, t) > 0])
    running: list[list[float]] = []  # [share of the job left, its length alone, with `workers` at once]
    for job in itertools.islice(pending, workers):
        running.append([1.0, *job])
    now = 0.0
    while running:
        k = len(running)
        lengths = [a + (t - a) * (k - 1) / (workers - 1) for _, a, t in running]
        step = min(left * length for (left, _, _), length in zip(running, lengths))
        now += step
        for job, length in zip(running, lengths):
            job[0] -= step / length
        ended = sum(job[0] <= 1e-9 for job in running)
        running = [job for job in running if job[0] > 1e-9]
        running.extend([1.0, *job] for job in itertools.islice(pending, ended))
    return now


# A timing step has at most TIMED_MICRO_BATCHES micro-batches (a large budget's batch of millions
# of tokens would make each step minutes long, and the FLOP/s hardly change past a few dozen),
# fewer where its round would take over TIMED_ROUND_S; a shape whose single micro-batch takes
# over TIMED_ROUND_S / 3 is not timed at all.
TIMED_MICRO_BATCHES, TIMED_ROUND_S = 64, 60.0
# A search of seconds is not spent mostly in measuring how long it takes: each timed round lasts
# at most TIMING_SHARE of the whole search (at the rate measured so far) over its timed rounds,
# and at least MIN_ROUND_S (20 steps at the least: _timed_steps).
TIMING_SHARE, MIN_ROUND_S = 0.05, 0.25


# A sweep that would take longer than this even at its devices' peak is refused before it is timed.
UNTIMEABLE_DAYS = 30.0


def _check_timeable(total: float, device: str, workers: int, what: str = "the sweep") -> None:
    """ConfigError when `total` FLOPs (what a search trains) would take over UNTIMEABLE_DAYS at the
    peak of the devices it runs on (a GPU's listed bf16 peak; 2e10 FLOP/s a CPU core, 5x what this
    project's 2-core test machine trains at in float32): timing its shapes would itself take hours."""
    name, peak = peak_in_use(device, workers)
    if name == "cpu":
        peak = 2e10 * (os.cpu_count() or 1)
    if peak and total / peak > UNTIMEABLE_DAYS * 86400:
        raise ConfigError(f"{what} trains {total:.3g} FLOPs: over {total / peak / 86400:,.0f} days even at the "
                          f"{peak:.3g} FLOP/s peak of {name}{' x ' + str(workers) if name != 'cpu' and workers > 1 else ''}"
                          "; lower --budgets, or plan it for the devices that will train it (`scaletrain plan`)")


def _round_seconds(seconds: float, total: float, rate: float | None, rounds: int) -> float:
    """How long a timed round lasts: `seconds`, or less where the search's `total` FLOPs at `rate`
    would take less than `rounds` of them over TIMING_SHARE (unknown total or rate: `seconds`)."""
    if not total or rate is None:
        return seconds
    return min(seconds, max(MIN_ROUND_S, TIMING_SHARE * total / rate / rounds))


def _timed_steps(point: Point, settings, rate: float | None, seconds: float, stage: str,
                 total: float) -> tuple[Point, int]:
    """The point as timed in a round of `stage` and its steps. "probe": 3 steps of one
    micro-batch, a first rate; "warmup": 10 steps (CUDA, the allocator, threads and the loader
    warmed as the timed rounds run); "timed": about `seconds` at the FLOP/s `rate` measured so
    far, at least 20 steps ("one": as many, of one micro-batch; "half": of one micro-batch of
    half its sequences, at least one). A step has at most
    TIMED_MICRO_BATCHES micro-batches, fewer where its round would pass TIMED_ROUND_S (3 steps
    of one micro-batch at the least); ConfigError for a shape too slow for even that (of a
    search training `total` FLOPs)."""
    micro = micro_batch_of(point.batch_seqs, settings)
    if stage == "probe" or rate is None:
        return replace(point, batch_seqs=micro), 3
    micro_s = micro * point.seq_len * point.flops_per_token / rate
    least = 10 if stage == "warmup" else 20
    count = min(point.batch_seqs // micro, TIMED_MICRO_BATCHES, int(TIMED_ROUND_S / (least * micro_s)))
    if count < 1:
        count, least = 1, 3
        if least * micro_s > TIMED_ROUND_S:
            raise ConfigError(f"a step of {point.shape.name} ({point.n:,} parameters) at this search's largest budget "
                              f"would take about {micro_s * point.batch_seqs / micro:,.0f} s on "
                              f"{peak_in_use(settings.device)[0]} ({rate:.3g} FLOP/s measured on a smaller "
                              f"shape): its {total:.3g} FLOPs would take about {total / rate / 86400:,.3g} days; "
                              "lower --budgets, or time it on the devices that will train it")
    point = replace(point, batch_seqs={"one": micro, "half": max(1, micro // 2)}.get(stage, count * micro))
    if stage == "warmup":
        return point, least
    return point, min(max(round(seconds * rate / point.step_flops), least), 10_000)


def measure_speed(plan: SweepPlan, shapes: list[Shape], out: Path, workers: int = 1, pool=None,
                  seconds: float = 2.0, check: bool = True) -> Speed:
    """Time `shapes` as the sweep trains them (each at its learning rate and batch, on the sweep's
    data and device): time_points of each shape's point at the sweep's largest budget, at the
    batch its trunk trains."""
    total = sum(plan.budget_flops().values())
    if check:  # (off where the sweep's workers were checked already: its final shape timed alone)
        _check_timeable(total, plan.settings.device, workers)
    points = [plan.scheduled(plan_points(max(plan.settings.budgets), [shape], plan.vocab_size, plan.settings.seq_len,
                                         plan.hyperparameters, micro_batch=plan.settings.micro_batch)[0])[0]
              for shape in sorted(set(shapes), key=plan.n_of)]
    return time_points(plan.settings, plan.vocab_size, points, out, workers, pool, seconds, total, plan.settings.mix)


def time_points(settings, vocab_size: int, points: list[Point], out: Path, workers: int = 1, pool=None,
                seconds: float = 2.0, total: float = 0.0, mix: dict[str, float] | None = None,
                fixed: bool = False) -> Speed:
    """Time `points` (of distinct shapes, smallest first) as a search by small runs trains them
    (run_overrides of `settings`: its data, on the mixture `mix` if given, and device): for each,
    `workers` copies at once in `pool`'s processes (one in this process when workers is 1), each
    for about `seconds` of steps, in out/ (removed after). Smallest first, each run's length set
    by the rate of the one before; two first rounds of the smallest shape, a probe of one
    micro-batch and a warm-up (_timed_steps), get a first rate and warm the processes up (CUDA,
    the allocator, the data loader) without risking a step of minutes. The runs train at a
    learning rate too small to diverge: what a step costs does not depend on it. `total`: the
    FLOPs of the whole search, for the refusal of a shape too slow to time, and for shorter
    rounds where the search itself is short (_round_seconds). `fixed`: also time
    the smallest shape at one micro-batch a step and at one of half its sequences, for what a
    step costs whatever its batch and a micro-batch whatever its sequences (Speed.step_fixed_s,
    micro_batch_s; a search whose runs train other batches than those timed)."""
    if workers > 1 and pool is None:
        raise ValueError("measuring several runs at once needs the pool they run in")
    out = Path(out)
    measured: list[tuple[float, float, float, int]] = []
    rate, alone, fixed_s = None, {}, (0.0, 0.0)  # alone: a micro-batch's step time, by sequences
    shutil.rmtree(out, ignore_errors=True)  # (what a measurement killed on the spot left)
    try:
        stages = [("probe", points[0]), ("warmup", points[0]), *([("half", points[0]), ("one", points[0])] if fixed
                                                                 else []),
                  *(("timed", point) for point in points)]
        for round_, (stage, at) in enumerate(stages):
            point, steps = _timed_steps(at, settings, rate, _round_seconds(seconds, total, rate, len(stages) - 2),
                                        stage, total)
            start_at = time.time() + 0.5
            jobs = [([*run_overrides(settings, vocab_size, point.shape, 1e-6, point.batch_seqs, 0, mix),
                      f"run.dir={out}", f"run.name={point.shape.name}-{round_}-{copy}", "train.schedule=constant",
                      f"train.steps={steps}", "checkpoint.interval=0", "checkpoint.resume=never"], start_at)
                    for copy in range(workers)]
            timed = list(pool.map(_timed_run, jobs)) if workers > 1 else [_timed_run(jobs[0])]
            # (tokens_per_s leaves the first step out: its warm-up is part of the overhead)
            step_s = sum(point.batch_seqs * point.seq_len / tokens_per_s for _, tokens_per_s in timed) / len(timed)
            overhead = sum(wall - steps * step_s for wall, _ in timed) / len(timed)
            if stage in ("half", "one"):  # (their rates, of one micro-batch, are not the timed rounds')
                alone[point.batch_seqs] = step_s
                continue
            rate = point.step_flops / step_s
            if stage == "timed":
                if alone and not measured:
                    fixed_s = _fixed_costs(alone, point.batch_seqs, micro_batch_of(point.batch_seqs, settings), step_s)
                measured.append((point.n, rate, max(overhead, 0.0), point.batch_seqs))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    n, rates, overheads, batches = map(list, zip(*measured))
    return Speed(n, rates, overheads, batches if fixed else None, settings.micro_batch if fixed else None, *fixed_s)


def _fixed_costs(alone: dict[int, float], batch: int, micro: int, step_s: float) -> tuple[float, float]:
    """(seconds a step costs whatever its batch, a micro-batch whatever its sequences) from the
    step times of one micro-batch by its sequences (`alone`: micro and half of it) and of the
    timed step (`batch` sequences in micro-batches of `micro`, step_s): a step of k micro-batches
    of m sequences takes per_step + k (per_micro_batch + m x each)."""
    one, micro_batches = alone[micro], batch // micro
    if micro_batches < 2:  # (one micro-batch: what is the step's and what the micro-batch's is not told apart)
        per_micro_batch_and_more, per_step = one, 0.0
    else:
        per_micro_batch_and_more = max((step_s - one) / (micro_batches - 1), 0.0)  # (rounds vary)
        per_step = one - per_micro_batch_and_more
    half = min(alone)
    each = (one - alone[half]) / (micro - half) if half < micro else per_micro_batch_and_more / micro
    each = min(max(each, 0.0), per_micro_batch_and_more / micro)
    return max(per_step, 0.0), max(per_micro_batch_and_more - micro * each, 0.0)


def _timed_run(job: tuple[list[str], float]) -> tuple[float, float]:
    """(seconds, tokens per second over all but the first step) of one run of these overrides,
    started at the wall-clock time given (so that concurrent copies overlap)."""
    from scaletrain.train.trainer import train

    overrides, start_at = job
    cfg = load_config(None, overrides)
    time.sleep(max(0.0, start_at - time.time()))
    started = time.perf_counter()
    result = train(cfg)
    seconds = time.perf_counter() - started
    import torch

    if torch.cuda.is_available():  # (the memory this run cached is not the next one's)
        torch.cuda.empty_cache()
    return seconds, result.tokens_per_s


def peak_in_use(device: str, workers: int = 1) -> tuple[str, float | None]:
    """(name, dense bf16 peak FLOP/s) of the devices `workers` concurrent runs on `device` use:
    the GPUs they take in turn (at most one each), or the CPU, whose peak is not known (None),
    as for a GPU plan/hardware.py does not list."""
    import torch

    from scaletrain.plan.hardware import peak_flops

    if device == "cpu" or not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name()
    peak = peak_flops(name, "bf16")
    return name, None if peak is None else peak * min(workers, torch.cuda.device_count())


def worker_pool(workers: int, device: str):
    """Worker processes that each train on their own device (GPUs in turn) with their share of
    the CPU threads. Not forked from this process (CUDA and torch's thread pools do not survive a
    fork): forked from a forkserver that has only imported the trainer (no CUDA, no thread pool),
    so that no worker imports torch again (7-10 s of CPU each on a small machine); spawned where
    there is no forkserver."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["scaletrain.train.trainer"])
    else:
        context = multiprocessing.get_context("spawn")
    counter = context.Value("i", 0)
    threads = max(1, (os.cpu_count() or 1) // workers)
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                               initargs=(counter, threads, device))


def _worker_init(counter, threads: int, device: str) -> None:
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    if device != "cpu":  # before torch initialises CUDA in this process
        import torch

        if torch.cuda.is_available():
            os.environ["LOCAL_RANK"] = str(index % torch.cuda.device_count())
    import torch

    torch.set_num_threads(threads)
    logging.getLogger("scaletrain").setLevel(logging.WARNING)


def _run_in_worker(job: tuple[Path, SweepSettings, Point]) -> tuple[dict, float]:
    from scaletrain.train.trainer import train

    out, settings, hyperparameters, point = job
    return Sweep(out, settings, hyperparameters)._run_point(point, train)


def _diverged_at(trunk_dir: Path) -> int | None:
    marker = trunk_dir / DIVERGED
    return int(json.loads(marker.read_text())["step"]) if marker.is_file() else None


def _newest_step(run_dir: Path) -> int:
    from scaletrain.train import checkpoint

    done = checkpoint.complete_checkpoints(run_dir / "checkpoints")
    return checkpoint.step_of(done[0]) if done else 0

