"""Where a new run's weights come from (`checkpoint.init_from`).

Either a Hugging Face model directory (continued pre-training of a published or exported
model: `scaletrain.hf` reads and checks it), or a checkpoint of another scaletrain run — the
next stage of the same model's pre-training: an annealing or mid-training phase on another data
mix (OLMo 2's second stage, Llama 3's annealing), a longer context (data.seq_len, model.max_seq_len,
rope settings), another layout or schedule. Such a run takes the checkpoint's weights and, with
`checkpoint.init_optimizer`, its optimizer state (AdamW's moments, Muon's momentum), and starts
its own count of steps and tokens, its own learning-rate schedule and its own data order from
the beginning. (To continue one run on the same data, `checkpoint.resume` takes a checkpoint
with its data position, step and random state instead.)

Checked before a process group starts: a run directory must hold a complete checkpoint (its
newest is taken) and not be this run's own, the checkpoint must hold every weight of `model.*`
in the same shape (a mismatch names the tensor and, when the source run's config.toml is
beside it, the shape settings that differ), its tokenizer must be the data's, and its optimizer
the run's when its state is taken (when the source's config.toml is not beside it, a missing
optimizer state is found as the state loads), and its parametrization (muP's base width and
depth, model.mup_*) the run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import ConfigError, RunConfig, load_config, toml_value

# The model.* settings that give weights their shapes (the rest, rope, sequence length, masks
# and routing, hold none): those a mismatch names.
SHAPES = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "qk_norm", "tie_embeddings",
          "moe_experts", "moe_ffn_dim", "moe_shared_experts", "moe_dense_layers", "mtp_depth")


def starts_fresh(name: str) -> bool:
    """Whether a weight may be missing from the checkpoint a run starts from, and then keeps its
    initial value: the experts' routing biases (at zero: a model that switches auxiliary-loss-free
    balancing on for its next stage starts them there) and multi-token prediction's modules (a
    stage that adds model.mtp_depth trains them from their initialisation)."""
    return name.endswith("expert_bias") or name.startswith("mtp.")


@dataclass(frozen=True)
class InitSource:
    kind: str  # "hf" or "checkpoint"
    path: Path  # the Hugging Face model directory, or the checkpoint directory


def init_source(cfg: RunConfig) -> InitSource | None:
    """Where a run `cfg` (resolved: see trainer.resolve) takes its first weights from, checked
    against its model, data and optimizer (ConfigError when they do not fit); None when it takes
    them from nowhere: no checkpoint.init_from, or a run that resumes from a checkpoint (its own,
    or the one checkpoint.resume names) and needs the source no more."""
    from scaletrain.hf import check_matches, check_tokenizer
    from scaletrain.train import checkpoint

    given = cfg.checkpoint.init_from
    if not given:
        return None
    path = Path(given)
    hugging_face = (path / "config.json").is_file()
    source_run = path if (path / "checkpoints").is_dir() else path.parent.parent  # (RUN/checkpoints/step_N)
    if not hugging_face and source_run.resolve() == cfg.run_dir.resolve():
        raise ConfigError(f"checkpoint.init_from = {given!r} is this run's own directory: a next stage is a run of "
                          "its own; choose a new run.name for it")
    if cfg.checkpoint.resume not in ("auto", "never") or checkpoint.committed_checkpoints(cfg.run_dir / "checkpoints"):
        return None
    data_tokenizer = next(iter(cfg.data.sources.values())) / "tokenizer.json"
    if hugging_face:
        check_matches(cfg.model, path)
        check_tokenizer(path, data_tokenizer, given)
        return InitSource("hf", path)
    if (path / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint
        found = checkpoint.complete_checkpoints(path / "checkpoints", say_damaged=True)
        if not found:
            raise ConfigError(f"checkpoint.init_from = {given!r} is a run directory without a complete checkpoint; "
                              "give one that has trained past its first checkpoint, or one of its checkpoints")
        path = found[0]
    elif not (path / checkpoint.MARKER).is_file() and not (path / ".metadata").is_file():
        raise ConfigError(f"checkpoint.init_from = {given!r} is neither a Hugging Face model directory (config.json "
                          "and *.safetensors) nor a scaletrain run directory or checkpoint "
                          "(…/checkpoints/step_NNNNNNN)")
    problem = checkpoint.check_complete(path)
    if problem:
        raise ConfigError(f"checkpoint.init_from = {given!r}: checkpoint {path} is not usable: {problem}; give "
                          "another of that run's checkpoints")
    source_cfg = _source_config(source_run)
    check_tokenizer(source_run, data_tokenizer, given)
    if cfg.checkpoint.init_optimizer and source_cfg is not None and source_cfg.train.optimizer != cfg.train.optimizer:
        raise ConfigError(f"checkpoint.init_from = {given!r} was trained with train.optimizer = "
                          f"{source_cfg.train.optimizer!r}, so its optimizer state cannot start this run's "
                          f"{cfg.train.optimizer!r}; set train.optimizer = {source_cfg.train.optimizer!r}, or "
                          "checkpoint.init_optimizer = false to start the optimizer afresh")
    if source_cfg is not None and parametrization(source_cfg) != parametrization(cfg):
        before, now = parametrization(source_cfg), parametrization(cfg)
        differ = [key for key in before if before[key] != now[key]
                  and not (key == "mup_depth_alpha" and before["mup_base_layers"] != now["mup_base_layers"])]
        setting = {key: "unset" if value is None else toml_value(value) for key, value in before.items()}
        raise ConfigError(f"checkpoint.init_from = {given!r} was trained with "
                          f"{', '.join(f'model.{key} = {setting[key]}' for key in differ)}, this run with "
                          f"{', '.join('unset' if now[key] is None else toml_value(now[key]) for key in differ)}: its "
                          "weights hold muP's multipliers folded in and their learning rates follow from them, so a "
                          "next stage keeps its parametrization; set it as that run had it")
    check_weights(path, cfg, source_cfg, f"checkpoint.init_from = {given!r}", "model.* must describe the model it holds")
    return InitSource("checkpoint", path)


def parametrization(cfg: RunConfig) -> dict:
    """The settings of muP that a run's weights carry (its base width; its base depth and, with
    one, the exponent of its residual multiplier)."""
    m = cfg.model
    return {"mup_base_dim": m.mup_base_dim, "mup_base_layers": m.mup_base_layers,
            "mup_depth_alpha": m.mup_depth_alpha if m.mup_base_layers else None}


def _source_config(run_dir: Path) -> RunConfig | None:
    """The config.toml of the run that wrote a checkpoint, when it is beside it and readable (a
    checkpoint copied elsewhere has none: its tensors are then checked on their own)."""
    try:
        return load_config(run_dir / "config.toml")
    except (ConfigError, OSError):  # missing, unreadable or of another version: only the messages lose
        return None


def model_shapes(cfg: RunConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every entry of the model's state dict, as checkpoints name them, without
    allocating it."""
    import torch

    from scaletrain.model.llama import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model)
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def check_weights(path: Path, cfg: RunConfig, source_cfg: RunConfig | None, subject: str, remedy: str) -> None:
    """ConfigError, before any tensor is read, where checkpoint `path` holds a model of other
    shapes than `cfg`'s (`source_cfg`: the config of the run it is of, whose differences are named):
    "{subject} holds another model: ...; {remedy}"."""
    from scaletrain.train.checkpoint import saved_shapes

    saved = saved_shapes(path)
    problems = []
    for name, shape in model_shapes(cfg).items():
        there = saved.get(f"model.{name}", "missing")
        if there == "missing":
            if not starts_fresh(name):
                problems.append(f"it has no {name}")
        elif there != shape:
            problems.append(f"its {name} is {_dims(there)}, this model's {_dims(shape)}")
    if not problems:
        return
    hint = ""
    if source_cfg is not None:
        before, now = source_cfg.model.model_dump(), cfg.model.model_dump()
        differ = [f"model.{key} = {'unset' if before[key] is None else toml_value(before[key])}"
                  for key in SHAPES if before[key] != now[key]]
        if differ:
            hint = f"; its run had {', '.join(differ)}"
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ConfigError(f"{subject} holds another model: {problems[0]}{more}{hint}; {remedy}")


def _dims(shape) -> str:
    return "x".join(map(str, shape)) if shape else "a scalar"
