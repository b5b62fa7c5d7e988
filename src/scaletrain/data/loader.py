"""Batches of packed token windows from one data directory or a weighted mixture of several:
deterministic, resumable, split across data-parallel ranks.

Each source's token stream (documents joined by end-of-document tokens) is cut into
non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets share seq_len
tokens; window w starts at token w * seq_len). Each epoch of a source visits all its windows
once, in an order drawn from (seed, source, epoch); the i-th sample taken from a source is
window perm[epoch][i % n] with epoch = i // n.

Global step s takes B = seqs_per_step samples (or batch_seqs(s), for a batch that grows over
training). With several sources, which source each of the B samples comes from is drawn by
weight from (seed, d), d counting the steps drawn so far (d = s, except after batches were
skipped), so the mixture holds in expectation within every batch and exactly in the long run;
the loader's whole state is how many samples were consumed and how many were taken from each
source, and the steps trained and drawn. Rank r of W takes the
contiguous block [r * B / W, (r + 1) * B / W) of each step's samples, in micro-batches, so the
union over ranks of one step is the same B sequences for every W, and a resumed run (even on
a different number of ranks) continues exactly where it stopped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.shards import DataError, TokenSplit, open_split


class _Source:
    """One data directory's split as a stream of windows in per-epoch shuffled order."""

    def __init__(self, index: int, name: str, data_dir: Path, split: str, seq_len: int, seed: int):
        self.index, self.name, self.seq_len, self.seed = index, name, seq_len, seed
        self.split: TokenSplit = open_split(data_dir, split)
        self.windows = (self.split.tokens - 1) // seq_len
        if self.windows < 1:
            raise DataError(f"the {split!r} split of {str(data_dir)!r} holds {self.split.tokens} tokens, "
                            f"fewer than one sequence of seq_len + 1 = {seq_len + 1}; lower data.seq_len or add data")
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def window(self, taken: int) -> int:
        """The window of the `taken`-th sample drawn from this source."""
        epoch, position = divmod(taken, self.windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, self.index, epoch]).permutation(self.windows)
        return int(self._order[position])

    def read(self, window: int) -> np.ndarray:
        return self.split.read(window * self.seq_len, self.seq_len + 1)


class TokenLoader:
    def __init__(self, sources: str | Path | dict[str, str | Path], seq_len: int, seqs_per_step: int,
                 micro_batch: int, rank: int = 0, world_size: int = 1, seed: int = 0, split: str = "train",
                 weights: dict[str, float] | None = None, batch_seqs: Callable[[int], int] | None = None):
        """sources: one data directory, or {name: data directory}; weights: {name: weight} (default
        equal); batch_seqs: the global batch in sequences of the step after s completed ones
        (default: seqs_per_step throughout)."""
        self.batch_seqs = batch_seqs or (lambda step: seqs_per_step)
        self.world_size, self.micro_batch = world_size, micro_batch
        self._check_split(seqs_per_step)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if not isinstance(sources, dict):
            sources = {Path(sources).name or "data": sources}
        weights = weights or {name: 1.0 for name in sources}
        if set(weights) != set(sources) or min(weights.values()) <= 0:
            raise ValueError(f"weights {weights} must be positive and name exactly the sources {list(sources)}")
        # By name, so that listing a mixture's sources in another order draws the same data.
        self.sources = [_Source(i, name, Path(sources[name]), split, seq_len, seed)
                        for i, name in enumerate(sorted(sources))]
        total = sum(weights.values())
        self.probabilities = np.array([weights[s.name] / total for s in self.sources])
        self.seq_len, self.seqs_per_step = seq_len, seqs_per_step
        self.rank, self.seed = rank, seed
        self.consumed = 0  # global samples of completed steps
        self.step = 0  # steps completed: the next one's batch is batch_seqs(step)
        self.draws = 0  # steps drawn from the data: the mixture's draws (past skipped batches too)
        self.micro = 0  # micro-batches this rank took of the current step
        self.taken = [0] * len(self.sources)  # samples taken from each source by completed steps
        self._plan: list[tuple[int, int]] = []  # (source, window) of each of this step's global samples
        self.last_windows: list[tuple[str, int]] = []  # (source name, window) of each row of the last batch

    def _check_split(self, seqs: int) -> None:
        if seqs % (self.world_size * self.micro_batch):
            raise ValueError(f"{seqs} sequences per step do not split into {self.world_size} ranks x "
                             f"micro-batches of {self.micro_batch}")

    @property
    def seqs_per_rank(self) -> int:
        """This rank's sequences of the step being read."""
        return self.batch_seqs(self.step) // self.world_size

    @property
    def micro_steps(self) -> int:
        """Gradient-accumulation steps of the optimizer step being read."""
        return self.seqs_per_rank // self.micro_batch

    def _plan_step(self) -> list[tuple[int, int]]:
        """Source and window of every sample of the current global step, identical on every rank."""
        seqs = self.batch_seqs(self.step)
        self._check_split(seqs)
        if len(self.sources) == 1:
            labels = np.zeros(seqs, dtype=np.int64)
        else:
            rng = np.random.default_rng([self.seed, self.draws, len(self.sources)])
            labels = rng.choice(len(self.sources), size=seqs, p=self.probabilities)
        counts = list(self.taken)
        plan = []
        for label in labels.tolist():
            plan.append((label, self.sources[label].window(counts[label])))
            counts[label] += 1
        return plan

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: (inputs, targets), each (micro_batch, seq_len) int64."""
        if not self._plan:
            self._plan = self._plan_step()
        first = self.rank * self.seqs_per_rank + self.micro * self.micro_batch
        taken = self._plan[first:first + self.micro_batch]
        # Which windows this batch holds (window w is tokens [w seq_len, (w + 1) seq_len] of its
        # source's split): what tells which documents a rank trained on.
        self.last_windows = [(self.sources[s].name, w) for s, w in taken]
        rows = np.stack([self.sources[s].read(w) for s, w in taken])
        self.micro += 1
        if self.micro == self.micro_steps:
            for source, _ in self._plan:
                self.taken[source] += 1
            self.consumed += len(self._plan)
            self.micro, self._plan = 0, []
            self.step += 1
            self.draws += 1
        batch = torch.from_numpy(rows)  # (micro_batch, seq_len + 1) int64
        # Each contiguous: a strided tensor is copied to the GPU through a contiguous copy in
        # pageable memory, which makes the host wait for the GPU, pinned or not.
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens taken from each source by completed steps (seq_len per sample)."""
        return {s.name: taken * self.seq_len for s, taken in zip(self.sources, self.taken)}

    def epochs_by_source(self) -> dict[str, float]:
        """Passes over each source's windows so far."""
        return {s.name: taken / s.windows for s, taken in zip(self.sources, self.taken)}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "micro": self.micro, "seed": self.seed, "seq_len": self.seq_len,
                "step": self.step, "draws": self.draws,
                "taken": {s.name: n for s, n in zip(self.sources, self.taken)},
                "split_tokens": {s.name: s.split.tokens for s in self.sources}}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["seq_len"] != self.seq_len:
            raise DataError(f"the checkpoint's data order was drawn for seed {state['seed']} and seq_len "
                            f"{state['seq_len']}, not seed {self.seed} and seq_len {self.seq_len}; resume with "
                            f"the run's original seed (data.seed, or run.seed where that is unset) and data.seq_len")
        mine, theirs = {s.name: s.split.tokens for s in self.sources}, state["split_tokens"]
        if len(mine) == len(theirs) == 1 and list(mine.values()) == list(theirs.values()):
            # One source, named by its directory: the same data moved (or linked) under another name.
            state = {**state, "taken": {self.sources[0].name: next(iter(state["taken"].values()))}}
        elif theirs != mine:
            def named(split: dict) -> str:
                return ", ".join(f"{name} ({tokens:,} tokens)" for name, tokens in split.items())
            raise DataError(f"the checkpoint was trained on {named(theirs)}, this data is {named(mine)}; resume on "
                            "the run's original data.path and data.mix, or start a new stage from the checkpoint on "
                            "this data with checkpoint.init_from")
        self.consumed, self.micro = int(state["consumed"]), int(state["micro"])
        # (States written before batches could grow: every step took seqs_per_step.)
        self.step = int(state.get("step", self.consumed // self.seqs_per_step))
        self.draws = int(state.get("draws", self.consumed // self.seqs_per_step))
        self.taken = [int(state["taken"][s.name]) for s in self.sources]
        self._plan = self._plan_step() if self.micro else []


class Prefetcher:
    """A TokenLoader read `depth` micro-batches ahead by a background thread, so that the next
    batch is ready (and, with pin=True, already in page-locked memory for an asynchronous copy
    to the GPU) when training asks for it. The wrapped loader runs ahead of training, so
    state_dict(), tokens_by_source(), epochs_by_source() and last_windows are snapshots taken
    after the last micro-batch handed out: a checkpoint resumes where training stopped, not
    where reading did. Load a state before the first next_batch()."""

    def __init__(self, loader: TokenLoader, depth: int = 2, pin: bool = False):
        self.loader, self.depth, self.pin = loader, depth, pin
        self.sources = loader.sources
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._after = self._snapshot()

    def _snapshot(self) -> tuple[dict, dict, dict, list]:
        loader = self.loader
        return loader.state_dict(), loader.tokens_by_source(), loader.epochs_by_source(), list(loader.last_windows)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                inputs, targets = self.loader.next_batch()
                if self.pin:
                    inputs, targets = inputs.pin_memory(), targets.pin_memory()
                item = ((inputs, targets), self._snapshot())
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._queue is None:
            self._queue = queue.Queue(self.depth)
            self._thread = threading.Thread(target=self._read, name="scaletrain-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batch, self._after = item
        return batch

    @property
    def last_windows(self) -> list[tuple[str, int]]:
        return self._after[3]

    def state_dict(self) -> dict:
        return self._after[0]

    def tokens_by_source(self) -> dict[str, int]:
        return self._after[1]

    def epochs_by_source(self) -> dict[str, float]:
        return self._after[2]

    def load_state_dict(self, state: dict) -> None:
        if self._queue is not None:
            raise RuntimeError("load the loader's state before the first batch is read")
        self.loader.load_state_dict(state)
        self._after = self._snapshot()

    def close(self) -> None:
        """Stop reading and wait for the thread: one still inside torch when the interpreter
        exits can abort the process ("terminate called without an active exception")."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


IGNORE = -100  # the target of a padding row: cross-entropy skips it


def eval_windows(split_tokens: int, seq_len: int, tokens: int) -> tuple[int, int]:
    """(the windows of seq_len + 1 tokens a split of split_tokens holds, the windows `tokens` asks
    for: at least one); an evaluation measures the fewer."""
    return (split_tokens - 1) // seq_len, max(1, tokens // seq_len)


def eval_batches(data_dir: str | Path, seq_len: int, tokens: int, rows: int,
                 rank: int = 0, world_size: int = 1, split: str = "val"):
    """The fixed validation set of one data directory: the first tokens // seq_len windows of
    the split (at least one). Rank r takes windows r, r + W, ...; yields (inputs, targets) of
    exactly `rows` rows, the same number of batches on every rank (sharded models run
    collectives in every forward): rows past a rank's last window are padding, with targets
    IGNORE."""
    source = open_split(data_dir, split)
    available, asked = eval_windows(source.tokens, seq_len, tokens)
    if available < 1:
        raise DataError(f"the {split!r} split of {str(data_dir)!r} holds {source.tokens} tokens, fewer than one "
                        f"sequence of {seq_len + 1}; prepare with a larger --val-fraction or lower data.seq_len")
    count = min(available, asked)
    windows = list(range(count))[rank::world_size]
    per_rank = -(-count // world_size)  # the most windows any rank has
    for i in range(0, per_rank, rows):
        chunk = windows[i:i + rows]
        padding = [0] * (rows - len(chunk))  # any window: its targets are ignored
        batch = torch.from_numpy(np.stack([source.read(w * seq_len, seq_len + 1) for w in chunk + padding]))
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].clone()  # (contiguous: see next_batch)
        targets[len(chunk):] = IGNORE
        yield inputs, targets
