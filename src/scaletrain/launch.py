"""Job files that run `scaletrain train` on many nodes: a Slurm batch script and a Kubernetes
manifest. Each starts torchrun once per node with a c10d rendezvous on the first node, so the
training command is the same one `--nproc` runs on a single node; torchrun runs as `--nproc`
runs it (scaletrain/torchrun.py), so that a stop signal is answered once and a refusal the
workers find (bad input) ends the job with status 2 in one line instead of being restarted:
where the workers of one node refuse and those of another do not (a path missing on one node),
the Job fails at once (Kubernetes) or the node ends the job step (Slurm), not waiting on timeouts.

Both give a stopping job time to save: the workers end a step or two after SIGTERM with a
checkpoint (train/resilience.py), so the job asks for SIGTERM `grace_s` seconds before it is
killed — Slurm before the time limit (`--signal`), Kubernetes as the pod's termination grace —
and torchrun waits as long before it kills its workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, read
by torch ≥ 2.13; 30 s before). A Slurm job is requeueable: a preempted one starts again and
resumes from its newest checkpoint. torchrun starts every worker again `max_restarts` times
after one fails or hangs (train/resilience.py's watchdog ends a hung one), and they resume too."""

from __future__ import annotations

import json
import os
import re
import shlex

from scaletrain.config import ConfigError, RunConfig
from scaletrain.parallel.layout import check_layout as check_mesh
from scaletrain.parallel.layout import resolve_layout
from scaletrain.torchrun import END_STEP_ON_REFUSAL

RDZV_PORT = 29500  # (Kubernetes: a pod has its own network namespace)
# Slurm: the rendezvous port of a job is its own, RDZV_PORT_BASE plus its id modulo RDZV_PORTS, so
# that two jobs whose first node is the same do not meet at one store (the second's torchrun would
# join the first's, and die with it).
RDZV_PORT_BASE, RDZV_PORTS = 20000, 20000
# Seconds between SIGTERM and the kill: the step or two the ranks take to agree, and a checkpoint.
GRACE_S = 180
# Times torchrun starts every worker again after one fails or hangs (train/resilience.py's
# watchdog); each start resumes from the newest checkpoint.
MAX_RESTARTS = 3
TORCHRUN = ["python3", "-m", "scaletrain.torchrun"]
# How a job file says it is launch's own (which a later launch may replace): a Slurm script's
# second line, a Kubernetes job's annotation.
WRITTEN, WRITTEN_KEY = "# written by scaletrain launch", "scaletrain/written-by"
REFUSED_STATUS = 2  # (scaletrain.torchrun's, when the workers refused their input)


def _train_args(config: str, overrides: list[str], options: list[str]) -> list[str]:
    return ["-m", "scaletrain.cli", "train", *options, config, *overrides]


def check_layout(cfg: RunConfig, nodes: int, gpus_per_node: int) -> None:
    """Refuse, before writing anything, a job whose layout does not fit its processes or does not
    split the model and batch evenly (as `train --nproc` does before it starts any). A vocabulary
    still to come from the data's tokenizer is checked when training starts."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must both be at least 1")
    layout = resolve_layout(cfg.parallel, nodes * gpus_per_node)
    if cfg.model.vocab_size is None:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": 64 * layout.tp})})
    check_mesh(layout, cfg)


def _shutdown_timeout(grace_s: int) -> int:
    """How long torchrun waits for stopping workers: the grace less a little for torchrun itself."""
    if grace_s < 20:
        raise ConfigError(f"--grace {grace_s} s leaves no time to save; give at least 20 seconds (the default 180 "
                          "fits a step or two and a checkpoint of most runs)")
    return grace_s - 10


def _check_restarts(max_restarts: int) -> None:
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts} must be ≥ 0 (0: a failed or hung worker ends the job)")


def slurm_script(cfg: RunConfig, config: str, overrides: list[str], nodes: int, gpus_per_node: int,
                 cpus_per_gpu: int = 8, grace_s: int = GRACE_S, max_restarts: int = MAX_RESTARTS,
                 train_options: list[str] | None = None) -> str:
    """An sbatch script: one task per node, each running torchrun over that node's GPUs, in the
    directory this runs in (where the config's relative paths lie), wherever it is submitted from.
    `train_options`: options of the train command (`--time-limit=...`)."""
    check_layout(cfg, nodes, gpus_per_node)
    _check_restarts(max_restarts)
    torchrun = [*TORCHRUN, f"--nnodes={nodes}", f"--nproc-per-node={gpus_per_node}", f"--max-restarts={max_restarts}",
                "--rdzv-backend=c10d",
                '--rdzv-endpoint="$head":"$port"', '--rdzv-id="$SLURM_JOB_ID"',
                *(shlex.quote(a) for a in _train_args(config, overrides, train_options or []))]
    return "\n".join([
        "#!/bin/bash",
        WRITTEN,
        f"#SBATCH --job-name={cfg.run.name}",
        f"#SBATCH --chdir={shlex.quote(os.getcwd())}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus_per_gpu * gpus_per_node}",
        # In the submission directory: Slurm opens it before the script runs, when the run's own
        # directory may not exist yet.
        f"#SBATCH --output=slurm-{cfg.run.name}-%j.out",
        f"#SBATCH --signal=TERM@{grace_s}",
        "#SBATCH --requeue",
        "set -euo pipefail",
        "# The first node hosts the rendezvous; every node runs torchrun once.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# On a port of the job's own: another job's torchrun may host its store on the same node.",
        f"port=$(({RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORTS}))",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={_shutdown_timeout(grace_s)}",
        "# A node whose processes refuse the run's input (a path missing on that node, say) ends the",
        "# step on every node, whose processes would wait on it until their timeouts: the job fails.",
        f"export {END_STEP_ON_REFUSAL}=1",
        f"mkdir -p {shlex.quote(f'{cfg.run.dir}/{cfg.run.name}')}",
        "srun " + " ".join(torchrun),
        "",
    ])


def k8s_manifest(cfg: RunConfig, config: str, overrides: list[str], nodes: int, gpus_per_node: int,
                 image: str, grace_s: int = GRACE_S, max_restarts: int = MAX_RESTARTS, volume: str | None = None,
                 train_options: list[str] | None = None) -> str:
    """A Kubernetes headless Service and Indexed Job (one pod per node) as a JSON List, which
    `kubectl apply -f` takes like YAML. Pod 0 hosts the rendezvous. `volume`, "CLAIM" or
    "CLAIM:PATH", mounts that PersistentVolumeClaim (shared by every pod: ReadWriteMany) at PATH
    (/workspace), the pods' working directory, where the config's relative paths (data, runs)
    then lie: without one, checkpoints are written in each container's own filesystem and go
    with the pod, and a job run again starts from nothing."""
    check_layout(cfg, nodes, gpus_per_node)
    claim, _, mount = (volume or "").partition(":")
    # (a claim's name is a DNS subdomain; a mount path an absolute path without ':', as Kubernetes takes them)
    if volume is not None and (not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", claim)
                               or (mount and (not mount.startswith("/") or ":" in mount))):
        raise ConfigError(f"--volume {volume!r}: give a PersistentVolumeClaim's name (lower-case letters, digits, "
                          "'-' and '.'), optionally with the absolute path to mount it at, e.g. scaletrain-work or "
                          "scaletrain-work:/workspace")
    if not image.strip() or any(c.isspace() for c in image):
        what = "--image is empty" if not image.strip() else f"--image {image!r} holds a space, which no image name does"
        raise ConfigError(f"{what}; give the container image the pods run, e.g. registry/scaletrain:1.0")
    mount = mount or "/workspace"
    # A DNS label (Service and Job names): lower-case letters, digits and '-', starting with a
    # letter, at most 63 characters (with room for the pods' "-N" suffixes).
    name = "".join(c if c.isascii() and c.isalnum() else "-" for c in cfg.run.name.lower()).strip("-") or "scaletrain"
    if not name[0].isalpha():
        name = f"run-{name}"
    name = name[:56].rstrip("-")
    _check_restarts(max_restarts)
    command = [*TORCHRUN, f"--nnodes={nodes}", f"--nproc-per-node={gpus_per_node}", f"--max-restarts={max_restarts}",
               "--rdzv-backend=c10d",
               f"--rdzv-endpoint={name}-0.{name}:{RDZV_PORT}", f"--rdzv-id={name}",
               *_train_args(config, overrides, train_options or [])]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
               "spec": {"clusterIP": "None", "selector": {"job-name": name},
                        "ports": [{"name": "rendezvous", "port": RDZV_PORT}]}}
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "annotations": {WRITTEN_KEY: "launch"}},
        "spec": {
            # With the shared claim, a failed pod (its torchrun out of restarts, its node lost) is
            # replaced under the same hostname and the job resumes from the claim's checkpoints, up
            # to max_restarts times an index (Kubernetes >= 1.29), the job failing with the first
            # index past that; a pod evicted or preempted (DisruptionTarget) counts against none,
            # and a refusal of the run's input (status 2) fails the job at once: it would be met again.
            # Without the claim a replaced pod would find none of its checkpoints: the job fails.
            "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
            **({"backoffLimitPerIndex": max_restarts, "maxFailedIndexes": 0,
                "podFailurePolicy": {"rules": [
                    {"action": "FailJob",
                     "onExitCodes": {"containerName": "train", "operator": "In", "values": [REFUSED_STATUS]}},
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}}
               if claim else {"backoffLimit": 0}),
            "template": {
                "metadata": {"labels": {"job-name": name}},
                "spec": {
                    "subdomain": name,  # pods are reachable as NAME-INDEX.NAME
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": grace_s,
                    "containers": [{
                        "name": "train", "image": image, "command": command,
                        "env": [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(_shutdown_timeout(grace_s))}],
                        "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
                        "ports": [{"containerPort": RDZV_PORT}],
                        # /dev/shm in memory, not the container's 64 MiB: NCCL's shared-memory
                        # transport (GPUs without peer-to-peer access) fails to start in that.
                        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                                         *([{"name": "work", "mountPath": mount}] if claim else [])],
                        **({"workingDir": mount} if claim else {}),
                    }],
                    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}},
                                *([{"name": "work", "persistentVolumeClaim": {"claimName": claim}}] if claim else [])],
                },
            },
        },
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [service, job]}, indent=1) + "\n"
