"""Searches by small runs: a plan of proxy runs in one directory, each trained once and recorded as
a row of results.csv, in worker processes if asked. The mixture search (one proxy per mixture),
the hyperparameter search (one per learning rate and batch) and muP's tuning (one per learning
rate of the narrow proxy) are each a ProxyRuns; an
interrupted search resumes where it stopped: finished runs are kept, an unfinished one resumes
from its checkpoint.
"""

from __future__ import annotations

import csv
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from scaletrain.outputs import check_output_dir, read_rows

log = logging.getLogger("scaletrain")


class ProxyRuns:
    """What a search defines: `keys()` (its runs, in order), `name_of(key)` (the run's name and
    results.csv row), `columns()` and `_run_one(key, train)` (train or finish one run; its row),
    with `text_columns` the columns that are not numbers. A subclass is built from (out, settings)
    alone: worker processes build it again from those."""

    text_columns: tuple[str, ...] = ("name",)
    kind: str | None = None  # what its directory is (outputs.KINDS): another command's is refused

    def __init__(self, out: Path, settings):
        self.out, self.settings = Path(out), settings
        if self.kind:
            check_output_dir(self.out, self.kind)

    def keys(self) -> list:
        raise NotImplementedError

    def name_of(self, key) -> str:
        raise NotImplementedError

    def columns(self) -> list[str]:
        raise NotImplementedError

    def _run_one(self, key, train) -> dict:
        raise NotImplementedError

    def cost_of(self, key) -> float:
        """What the run of `key` costs relative to the others (its FLOPs where they differ), for
        the ETA: the runs left cost what those done here cost, in proportion."""
        return 1.0

    def point_of(self, key):
        """The scaling.grid.Point that the run of `key` trains (its shape, steps and batch), for
        predict_seconds."""
        raise NotImplementedError(f"a {type(self).__name__} does not predict its time")

    def mix_of(self, key) -> dict[str, float] | None:
        """The mixture the run of `key` trains on (run_overrides' `mix`), None for one directory."""
        return None

    def todo(self) -> list:
        """The keys of the runs not yet in results.csv."""
        finished = {row["name"] for row in self.results()}
        return [key for key in self.keys() if self.name_of(key) not in finished]

    def predict_seconds(self, scratch: Path, concurrency: int = 1, pool=None) -> dict:
        """Time the shapes of the runs left here (the smallest, the middlemost and the largest; as
        sweep.time_points does, `concurrency` at once in `pool`), in `scratch` (removed after),
        and predict their wall-clock, `concurrency` at once: {"runs", "flops", "seconds",
        "speed"}. Nothing is trained for the search itself."""
        from scaletrain.sweep import _check_timeable, makespan, time_points

        todo = self.todo()
        points = [self.point_of(key) for key in todo]
        if not todo:
            return {"runs": 0, "flops": 0.0, "seconds": 0.0, "speed": None}
        total = sum(point.compute for point in points)
        _check_timeable(total, self.settings.device, concurrency, f"the {self.kind}")
        largest = {}  # each shape at the largest step it trains: what the timing rounds cap
        for point in points:
            if point.shape not in largest or point.step_flops > largest[point.shape].step_flops:
                largest[point.shape] = point
        shapes = sorted(largest.values(), key=lambda point: point.n)
        chosen = sorted({id(p): p for p in (shapes[0], shapes[len(shapes) // 2], shapes[-1])}.values(),
                        key=lambda point: point.n)
        # Runs of other batches than their shape's largest (hparams' batch factors) pay a step's
        # and a micro-batch's fixed costs more or less often for their FLOPs: timed too.
        other_batches = {p.batch_seqs for p in points} != {p.batch_seqs for p in largest.values()}
        speed = time_points(self.settings, self.vocab_size, chosen, scratch, concurrency, pool, total=total,
                            mix=self.mix_of(todo[0]), fixed=other_batches)
        seconds = makespan([speed.seconds(point, point.steps) for point in points], concurrency)
        return {"runs": len(todo), "flops": total, "seconds": seconds, "speed": speed.to_dict()}

    def results(self) -> list[dict]:
        path = self.out / "results.csv"
        if not path.is_file():
            return []
        return read_rows(path, self.text_columns)

    def _record(self, row: dict) -> None:
        path = self.out / "results.csv"
        new = not path.is_file()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns())
            if new:
                writer.writeheader()
            writer.writerow(row)

    def run(self, progress: Callable[[dict], None] | None = None, concurrency: int = 1) -> list[dict]:
        """Train every run not yet in results.csv; returns all rows, in the plan's order. progress
        gets a dict of runs done / total, FLOPs spent and an ETA after each run: the runs left at
        the pace of those done here, each weighed by cost_of (a search of several budgets trains
        its smallest first)."""
        from scaletrain.sweep import worker_pool

        keys = self.keys()
        planned = {self.name_of(key) for key in keys}
        done = [row for row in self.results() if row["name"] in planned]  # (not those of a plan narrowed since)
        todo = self.todo()
        started, cost_here = time.perf_counter(), 0.0
        cost_left = sum(map(self.cost_of, todo))
        pool = worker_pool(concurrency, self.settings.device) if concurrency > 1 and len(todo) > 1 else None
        try:
            if pool is None:
                from scaletrain.train.trainer import train
                rows = (self._run_one(key, train) for key in todo)
            else:
                rows = pool.map(_run_in_worker, [(type(self), self.out, self.settings, key) for key in todo])
            for key, row in zip(todo, rows):  # (rows come in the order of todo, from a pool too)
                self._record(row)
                done.append(row)
                cost = self.cost_of(key)
                cost_here, cost_left = cost_here + cost, cost_left - cost
                if progress:
                    elapsed = time.perf_counter() - started
                    progress({"done": len(done), "total": len(keys), "name": row["name"],
                              "flops": sum(r["c"] for r in done),
                              "eta_s": elapsed / cost_here * max(cost_left, 0.0) if cost_here > 0 else None})
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
        order = {self.name_of(key): i for i, key in enumerate(keys)}
        return sorted(done, key=lambda row: order.get(row["name"], len(order)))


def train_proxy(cfg, train) -> tuple[dict[str, float], float, float]:
    """Train (or finish) cfg's run: (validation loss by source, validation loss, train loss) at
    its end, or ({}, nan, nan) if it diverged."""
    from scaletrain.train.metrics import read_metrics
    from scaletrain.train.trainer import TrainingDiverged

    try:
        result = train(cfg)
    except TrainingDiverged as e:
        log.warning("%s diverged (%s); it is recorded with losses of nan and left out of the fit", cfg.run_dir, e)
        return {}, math.nan, math.nan
    return read_metrics(cfg.run_dir, "eval")[-1]["loss_by_source"], result.val_loss, result.train_loss


def _run_in_worker(job: tuple[type, Path, object, object]) -> dict:
    from scaletrain.train.trainer import train

    kind, out, settings, key = job
    return kind(out, settings)._run_one(key, train)
