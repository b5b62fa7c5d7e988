"""Sample text from a run's newest checkpoint."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from scaletrain.config import load_config, run_config_file
from scaletrain.errors import UserError

log = logging.getLogger("scaletrain")


class GenerateError(UserError, ValueError):
    """A sampling request that cannot be served (prompt too long, bad sampling settings)."""


def load_model(run_dir: str | Path, device: str = "cpu", step: int | None = None, average: int = 1,
               ema: bool = False):
    """The model of a run directory with the weights of its newest intact checkpoint (or of
    the checkpoint of `step`; with `average`, the mean of those weights and of the average - 1
    complete checkpoints' before it: see Trainer.load_average; with `ema`, the moving average of
    the weights the checkpoint holds, train.ema_decay's, or with both the mean of those
    checkpoints' moving averages), and that checkpoint's step."""
    from scaletrain.model.llama import Transformer
    from scaletrain.train import checkpoint
    from scaletrain.train.init_from import check_weights

    run_dir = Path(run_dir)
    config = run_config_file(run_dir)
    cfg = load_config(config)
    root = run_dir / "checkpoints"
    model = Transformer(cfg.model)
    section = "ema" if ema else "model"
    state = {section: model.state_dict()}  # reads only the model's entries of the checkpoint (or their average's)
    # (config.toml edited since: named here, not DCP's size mismatch)
    remedy = f"the model of {str(config)!r} must be the one its checkpoints hold"
    if step is None:
        complete = checkpoint.complete_checkpoints(root)
        if not complete:
            raise checkpoint.no_complete_checkpoint(run_dir)
        check_weights(complete[0], cfg, None, f"the newest checkpoint of {str(run_dir)!r}", remedy)
        path = checkpoint.load_newest(root, state)  # past a damaged newest one, with a warning
    else:
        path = checkpoint.checkpoint_dir(root, step)
        if not path.is_dir():
            have = ", ".join(str(checkpoint.step_of(p)) for p in checkpoint.committed_checkpoints(root)) or "none"
            raise checkpoint.CheckpointError(f"run directory {str(run_dir)!r} has no checkpoint of step {step}; "
                                             f"it has steps: {have}")
        check_weights(path, cfg, None, f"checkpoint {str(path)!r}", remedy)
        checkpoint.load(path, state)
    if average > 1:
        total = {name: value.clone() for name, value in state[section].items()}
        for earlier in checkpoint.with_earlier(path, average)[:-1]:
            checkpoint.load(earlier, state)
            for name, value in state[section].items():
                total[name] += value
        state[section] = {name: value / average for name, value in total.items()}
    model.load_state_dict(state[section])
    return model.to(device).eval(), cfg, checkpoint.step_of(path)


def data_bos_id(run_dir: str | Path, cfg) -> int | None:
    """The beginning-of-sequence id the documents of the run in `run_dir` began with (None:
    none), as its start record says; for a run from before it said so, its data's index.json's,
    where the data is still at hand (else none: documents began with none before then)."""
    from scaletrain.data.shards import DataError, read_index
    from scaletrain.train.metrics import read_metrics

    with contextlib.suppress(OSError):
        starts = read_metrics(run_dir, "start")
        if starts and "bos_id" in starts[-1]:
            return starts[-1]["bos_id"]
    try:
        return read_index(next(iter(cfg.data.sources.values()))).get("bos_id")
    except DataError:
        return None


def generate_text(run_dir: str | Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, use_cache: bool = True, top_p: float | None = None,
                  samples: int | None = None, step: int | None = None, average: int = 1, ema: bool = False,
                  device: str = "cpu", suffix: str | None = None) -> str | list[str]:
    """Continue `prompt` with the run's newest checkpoint (or load_model's choice of `step`,
    `average`, `ema`) on `device` ("auto": a GPU where there is one); temperature 0 is greedy.
    With `samples`, that many continuations, sampled together, as a list. With `suffix`, fill in
    the middle between `prompt` and `suffix` (a model trained on data prepared with --fim-rate:
    asked in prefix-suffix-middle order, as it was trained, until it ends the document): each text
    is prompt + middle + suffix."""
    from scaletrain.data.tokenizer import eos_id as find_eos, fim_ids, load_tokenizer, vocab_size
    from scaletrain.model.sample import generate

    if (not 0 <= temperature < float("inf") or (top_k is not None and top_k < 1) or max_new_tokens < 1
            or (top_p is not None and not 0 < top_p <= 1)):  # before loading anything
        raise GenerateError(f"temperature must be ≥ 0 and finite (0 is greedy), top_k ≥ 1 or unset, top_p in (0, 1] "
                            f"or unset, max_new_tokens ≥ 1; got {temperature}, {top_k}, {top_p}, {max_new_tokens}")
    if samples is not None and samples < 1 or average < 1:
        raise GenerateError(f"samples {samples}, average {average}: ask for at least 1 sample, averaging at least 1 "
                            "checkpoint (1: the checkpoint on its own)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise GenerateError("device cuda: torch sees no GPU here; sample on the cpu (or auto)")
    model, cfg, _ = load_model(run_dir, device, step=step, average=average, ema=ema)
    tokenizer = load_tokenizer(Path(run_dir) / "tokenizer.json")
    eos_id = find_eos(tokenizer)
    # A document begins after an end-of-document token in training, or with the data's
    # beginning-of-sequence token where it has one: so does the prompt (an empty one with either).
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if suffix is not None:
        sentinels = fim_ids(tokenizer)
        if sentinels is None:
            raise GenerateError(f"{run_dir}'s tokenizer has no fill-in-the-middle tokens, so its model never learned "
                                "to infill; train on data prepared with --fim-rate, or drop --suffix")
        pre, suf, mid = sentinels
        ids = [pre, *ids, suf, *tokenizer.encode(suffix, add_special_tokens=False).ids, mid]
    start = data_bos_id(run_dir, cfg)
    ids = [start, *ids] if start is not None else ids or [eos_id]
    room = cfg.model.max_seq_len - len(ids)
    if room < 1:
        raise GenerateError(f"the prompt is {len(ids)} tokens and the model's context model.max_seq_len is "
                            f"{cfg.model.max_seq_len}; shorten the prompt")
    if max_new_tokens > room:  # (the positions the model was trained on end there)
        log.warning("the model's context is %d tokens (model.max_seq_len) and the prompt takes %d: at most %d new "
                    "tokens, not %d", cfg.model.max_seq_len, len(ids), room, max_new_tokens)
    generator = torch.Generator(device).manual_seed(seed)
    prompts = torch.tensor([ids] * (samples or 1), device=device)
    new = generate(model, prompts, min(max_new_tokens, room), temperature=temperature, top_k=top_k,
                   use_cache=use_cache, generator=generator, eos_id=eos_id, vocab=vocab_size(tokenizer), top_p=top_p)
    if suffix is not None:
        if any(eos_id not in row.tolist() for row in new.cpu()):
            log.warning("the middle was cut at %d new tokens, before the model ended it: raise --max-new-tokens for "
                        "the whole of it", new.shape[1])
        texts = [prompt + tokenizer.decode(row.tolist()) + suffix for row in new.cpu()]
    else:
        texts = [tokenizer.decode(ids + row.tolist()) for row in new.cpu()]  # (special tokens decode to nothing)
    return texts if samples is not None else texts[0]
