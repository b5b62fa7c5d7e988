"""Run several training layouts one after another in one job of N processes (starting processes
costs seconds each on a 2-core machine): the tests start its `main` in N ranks forked from their
forkserver (conftest.launch_runs); by hand, `torchrun --nproc-per-node N tests/run_layouts.py SPEC`,
SPEC a JSON list of {"config": path, "overrides": [...], "stop_at_step": int | null, "damage":
path | null, "glitch": {"step": int, "kind": "nan" | "spike"} | null}. Every layout must use all
N processes. "damage" names a file of the run directory that every process overwrites in the
middle with the same 16 bytes (its size unchanged) before that training starts: a checkpoint file
corrupted on disk. "glitch": the step after that one diverges on every rank (conftest.glitched)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from conftest import flex_on_cpu, glitched
from scaletrain.config import load_config
from scaletrain.parallel.mesh import shutdown
from scaletrain.train.trainer import Trainer


def main(spec_path: str) -> None:
    for spec in json.loads(open(spec_path).read()):
        cfg = load_config(spec["config"], spec["overrides"])
        if spec.get("damage"):
            damage(Path(cfg.run.dir) / cfg.run.name / spec["damage"])
        glitch = spec.get("glitch")
        try:
            # A layout that asks for FlexAttention computes it on the CPU (the single-process
            # references compute SDPA's mask: test_distributed's single_process).
            with glitched(glitch["kind"], glitch["step"]) if glitch else contextlib.nullcontext(), \
                    flex_on_cpu() if cfg.model.attention_kernel == "flex" else contextlib.nullcontext():
                Trainer(cfg).fit(stop_at_step=spec.get("stop_at_step"))
        except BaseException as e:
            shutdown(clean=False)
            raise RuntimeError(f"layout {spec['overrides']} failed: {e}") from e
    shutdown()
    # Everything is on disk: leave without the interpreter's teardown of torch (~1.5 s of CPU
    # per process, which 8 processes on 2 cores wait for in turn).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def damage(path: Path) -> None:
    """Idempotent, so the processes may do it in any order: none restores what another changed."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"damaged by test!")


if __name__ == "__main__":
    main(sys.argv[1])
