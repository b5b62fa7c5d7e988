"""Multiple-choice tasks evaluated during training (eval.tasks): how a model's ability to pick
the right continuation grows, beside its validation loss.

A task is a JSON Lines file, one example a line: {"context": "...", "choices": ["...", ...],
"label": index of the right choice} (HellaSwag, ARC, PIQA, SciQ and most other multiple-choice
benchmarks convert to it in a few lines). Each (example, choice) is scored by the log-probability
the model gives the choice's tokens after the context, in the manner of lm-evaluation-harness's
multiple-choice tasks: the context and the context + choice are tokenized as the data was (no
special tokens), the choice's tokens being those after the longest common prefix of the two;
an end-of-document token goes first, so that the context starts a document as training
documents do, and a row longer than the sequence loses the start of its context. (The harness
splits at the length of the context's tokens instead, moves the context's trailing spaces into
the choice and adds no end-of-document token: its numbers and these differ a little.)
From those scores, per task:

- accuracy: the right choice has the highest log-probability;
- accuracy_norm: ... the highest log-probability per character of the choice (lm-evaluation-
  harness's acc_norm, which does not favour short choices);
- nll: the right choice's loss per token, averaged over examples — smooth where the accuracies
  are still at chance, as small models' are (Schaeffer et al. 2023; OLMo tracks the like).

Rows are spread over the data-parallel ranks as the validation windows are; every rank runs
the same number of forwards (sharded models gather weights in each).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.config import ConfigError

IGNORE = -100  # (as the loader's: a target the loss skips)
log = logging.getLogger("scaletrain")


@dataclass
class Task:
    name: str
    inputs: np.ndarray  # (rows, longest) int32: one row per (example, choice), padded with 0
    targets: np.ndarray  # (rows, longest) int32: the choice's tokens, IGNORE elsewhere
    lengths: np.ndarray  # (rows,) tokens of each row before its padding
    example: np.ndarray  # (rows,) the example of each row
    chars: np.ndarray  # (rows,) characters of each row's choice
    tokens: np.ndarray  # (rows,) tokens of each row's choice (those scored)
    labels: np.ndarray  # (examples,) the right choice's row

    @property
    def examples(self) -> int:
        return len(self.labels)


def load_task(path: str | Path, tokenizer, eos_id: int, seq_len: int, limit: int, bos_id: int | None = None) -> Task:
    """The first `limit` examples of the task file at `path` as rows of seq_len tokens;
    ConfigError, naming the line, for a file that is not such a task."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"eval.tasks: {str(path)!r} cannot be read ({e}); give JSON Lines files of "
                          '{"context": ..., "choices": [...], "label": index}') from None
    rows, example, chars, tokens, labels = [], [], [], [], []
    cut = 0  # choices longer than seq_len: scored on their last seq_len tokens
    for number, line in enumerate(lines, 1):
        if len(labels) == limit:
            break
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            context, choices, label = item["context"], item["choices"], item["label"]
            if not (isinstance(context, str) and isinstance(choices, list) and len(choices) >= 2
                    and all(isinstance(c, str) and c for c in choices)
                    and isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(choices)):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"eval.tasks: line {number} of {str(path)!r} is not an example; each line must be "
                              '{"context": "...", "choices": ["...", "..."], "label": index of the right '
                              "choice} (two or more non-empty choices)") from None
        # As the data was prepared: no special tokens a tokenizer's post-processor would add.
        prefix = tokenizer.encode(context, add_special_tokens=False).ids
        labels.append(len(rows) + label)
        for choice in choices:
            whole = tokenizer.encode(context + choice, add_special_tokens=False).ids
            if len(whole) <= len(prefix) and whole == prefix[:len(whole)]:
                raise ConfigError(f"eval.tasks: line {number} of {str(path)!r}: the choice {choice!r} adds no token "
                                  "to the context; give choices that are text")
            shared = min(_common_prefix(prefix, whole), len(whole) - 1)  # at least one token of the choice
            # Begun as training's documents are: after an end of document, or with the data's
            # beginning-of-sequence token (lm-evaluation-harness's add_bos_token).
            full = [eos_id if bos_id is None else bos_id, *whole][-(seq_len + 1):]  # too long: the context's start goes
            scored = min(len(whole) - shared, seq_len)
            cut += scored < len(whole) - shared
            rows.append(full)
            example.append(len(labels) - 1)
            chars.append(len(choice))
            tokens.append(scored)
    if not labels:
        raise ConfigError(f"eval.tasks: {str(path)!r} holds no example")
    if cut:
        log.warning("eval.tasks: %d choices of %s are longer than data.seq_len = %d tokens and are scored on their "
                    "last %d only", cut, path, seq_len, seq_len)
    lengths = np.array([len(full) - 1 for full in rows])
    inputs = np.zeros((len(rows), lengths.max()), dtype=np.int32)  # (as long as the longest row, not seq_len)
    targets = np.full((len(rows), lengths.max()), IGNORE, dtype=np.int32)
    for i, (full, n, scored) in enumerate(zip(rows, lengths, tokens)):
        inputs[i, :n] = full[:-1]
        targets[i, n - scored:n] = full[-scored:]
    return Task(path.stem, inputs, targets, lengths, np.array(example), np.array(chars), np.array(tokens),
                np.array(labels))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def task_metrics(task: Task, logprob: np.ndarray) -> dict[str, float]:
    """accuracy, accuracy_norm and nll of a task from each row's summed log-probability of its
    choice."""
    starts = np.flatnonzero(np.r_[True, task.example[1:] != task.example[:-1]])
    ends = np.r_[starts[1:], len(task.example)]
    right = task.labels
    best = np.array([s + np.argmax(logprob[s:e]) for s, e in zip(starts, ends)])
    per_char = logprob / task.chars
    best_norm = np.array([s + np.argmax(per_char[s:e]) for s, e in zip(starts, ends)])
    return {"accuracy": float(np.mean(best == right)), "accuracy_norm": float(np.mean(best_norm == right)),
            "nll": float(np.mean(-logprob[right] / task.tokens[right]))}
