"""Batches of packed token windows, deterministic, resumable, split across data-parallel ranks.

The token stream of a split (documents joined by end-of-document tokens) is cut into
non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets share seq_len
tokens; window w starts at token w * seq_len). Each epoch visits every window once in an
order drawn from (seed, epoch). Global sample g is window perm[epoch][g % n] with
epoch = g // n, so the whole data order is a pure function of the seed: the loader's only
state is how many global samples were consumed, and a resumed run (even on a different
number of ranks) continues exactly where it stopped.

Global step s takes global samples [s * B, (s + 1) * B), B = sequences per step. Rank r of
W takes the contiguous block [r * B / W, (r + 1) * B / W) of those, in micro-batches; so the
union over ranks of one step is the same B sequences for every W.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from scaletrain.data.shards import DataError, TokenSplit, open_split


class TokenLoader:
    def __init__(self, data_dir: str | Path, seq_len: int, seqs_per_step: int, micro_batch: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, split: str = "train"):
        if seqs_per_step % (world_size * micro_batch):
            raise ValueError(f"{seqs_per_step} sequences per step do not split into {world_size} ranks x "
                             f"micro-batches of {micro_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.split: TokenSplit = open_split(data_dir, split)
        self.seq_len, self.seqs_per_step, self.micro_batch = seq_len, seqs_per_step, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.windows = (self.split.tokens - 1) // seq_len
        if self.windows < 1:
            raise DataError(f"the {split!r} split of {str(data_dir)!r} holds {self.split.tokens} tokens, "
                            f"fewer than one sequence of seq_len + 1 = {seq_len + 1}; lower data.seq_len or add data")
        self.seqs_per_rank = seqs_per_step // world_size
        self.micro_steps = self.seqs_per_rank // micro_batch  # gradient-accumulation steps per optimizer step
        self.consumed = 0  # global samples of completed steps
        self.micro = 0  # micro-batches this rank took of the current step
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _window(self, sample: int) -> int:
        epoch, position = divmod(sample, self.windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return int(self._order[position])

    def _read(self, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.split.read(w * self.seq_len, self.seq_len + 1) for w in windows])
        batch = torch.from_numpy(rows)  # (micro_batch, seq_len + 1) int64
        return batch[:, :-1], batch[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: (inputs, targets), each (micro_batch, seq_len) int64."""
        first = self.consumed + self.rank * self.seqs_per_rank + self.micro * self.micro_batch
        batch = self._read([self._window(g) for g in range(first, first + self.micro_batch)])
        self.micro += 1
        if self.micro == self.micro_steps:
            self.micro = 0
            self.consumed += self.seqs_per_step
        return batch

    @property
    def epoch(self) -> float:
        """Passes over the split so far (fractional)."""
        return self.consumed / self.windows

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "micro": self.micro, "seed": self.seed, "seq_len": self.seq_len,
                "split_tokens": self.split.tokens}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["seq_len"] != self.seq_len:
            raise DataError(f"the checkpoint's data order was drawn for seed {state['seed']} and seq_len "
                            f"{state['seq_len']}, not seed {self.seed} and seq_len {self.seq_len}; resume with "
                            f"the run's original run.seed and data.seq_len")
        if state["split_tokens"] != self.split.tokens:
            raise DataError(f"the checkpoint was trained on a split of {state['split_tokens']} tokens, this data "
                            f"directory's has {self.split.tokens}; resume on the run's original data.path")
        self.consumed, self.micro = int(state["consumed"]), int(state["micro"])


def eval_batches(data_dir: str | Path, seq_len: int, tokens: int, micro_batch: int,
                 rank: int = 0, world_size: int = 1, split: str = "val"):
    """The fixed validation set: the first tokens // seq_len windows of the split (at least one).

    Rank r takes windows r, r + W, ...; yields (inputs, targets) micro-batches of this rank.
    """
    source = open_split(data_dir, split)
    available = (source.tokens - 1) // seq_len
    if available < 1:
        raise DataError(f"the {split!r} split of {str(data_dir)!r} holds {source.tokens} tokens, fewer than one "
                        f"sequence of {seq_len + 1}; prepare with a larger --val-fraction or lower data.seq_len")
    windows = list(range(min(available, max(1, tokens // seq_len))))[rank::world_size]
    for i in range(0, len(windows), micro_batch):
        rows = np.stack([source.read(w * seq_len, seq_len + 1) for w in windows[i:i + micro_batch]])
        batch = torch.from_numpy(rows)
        yield batch[:, :-1], batch[:, 1:]
