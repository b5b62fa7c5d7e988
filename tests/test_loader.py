"""The data loader: packed windows, deterministic order, exact state round-trip, disjoint ranks."""

import time

import numpy as np
import pytest
import torch

from scaletrain.data.loader import IGNORE, Prefetcher, TokenLoader, eval_batches
from scaletrain.data.shards import DataError, ShardWriter, open_split, write_index


@pytest.fixture
def data_dir(tmp_path):
    """Two shards of 'documents' whose tokens are consecutive numbers, so every window is identifiable."""
    writer = ShardWriter(tmp_path, "train", vocab_size=5000, eos_id=0, shard_tokens=1500)
    rng = np.random.default_rng(0)
    next_id = 1
    for _ in range(40):
        length = int(rng.integers(20, 120))
        writer.add(np.arange(next_id, next_id + length) % 4999 + 1)
        next_id += length
    train = writer.close()
    val_writer = ShardWriter(tmp_path, "val", vocab_size=5000, eos_id=0)
    val_writer.add(np.arange(1, 400))
    write_index(tmp_path, vocab_size=5000, eos_id=0, splits={"train": train, "val": val_writer.close()})
    assert len(train["shards"]) >= 2
    return tmp_path


def test_shards_read_back_across_shard_boundaries(data_dir):
    split = open_split(data_dir, "train")
    whole = np.concatenate([np.asarray(s, dtype=np.int64) for s in split.shards])
    assert split.tokens == len(whole)
    boundary = int(split.starts[1])
    assert np.array_equal(split.read(boundary - 5, 10), whole[boundary - 5:boundary + 5])
    assert split.shards[0].dtype == np.uint16


def test_windows_are_packed_inputs_and_shifted_targets(data_dir):
    loader = TokenLoader(data_dir, seq_len=16, seqs_per_step=4, micro_batch=2)
    inputs, targets = loader.next_batch()
    assert inputs.shape == targets.shape == (2, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    split = open_split(data_dir, "train")
    start = None
    for w in range(loader.sources[0].windows):  # each row is one window of the stream
        if np.array_equal(split.read(w * 16, 16), inputs[0].numpy()):
            start = w
    assert start is not None


def test_order_is_deterministic_for_a_seed_and_differs_across_seeds(data_dir):
    a = TokenLoader(data_dir, 16, 4, 2, seed=1)
    b = TokenLoader(data_dir, 16, 4, 2, seed=1)
    c = TokenLoader(data_dir, 16, 4, 2, seed=2)
    batches_a = [a.next_batch()[0] for _ in range(5)]
    assert all(torch.equal(x, b.next_batch()[0]) for x in batches_a)
    assert not all(torch.equal(x, c.next_batch()[0]) for x in batches_a)


def test_an_epoch_visits_every_window_once(data_dir):
    source = TokenLoader(data_dir, 16, 2, 1).sources[0]
    seen = [source.window(g) for g in range(source.windows)]
    assert sorted(seen) == list(range(source.windows))
    second = [source.window(g) for g in range(source.windows, 2 * source.windows)]
    assert sorted(second) == sorted(seen) and second != seen


def test_state_round_trips_exactly(data_dir):
    loader = TokenLoader(data_dir, 16, 8, 2, seed=3)
    for _ in range(7):  # past the end of the first epoch and mid-step
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(30)]
    fresh = TokenLoader(data_dir, 16, 8, 2, seed=3)
    fresh.load_state_dict(state)
    for (x, y), (fx, fy) in zip(expected, (fresh.next_batch() for _ in range(30))):
        assert torch.equal(x, fx) and torch.equal(y, fy)


def test_state_from_another_seed_is_refused(data_dir):
    state = TokenLoader(data_dir, 16, 8, 2, seed=3).state_dict()
    with pytest.raises(DataError, match="seed"):
        TokenLoader(data_dir, 16, 8, 2, seed=4).load_state_dict(state)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_split_each_global_batch_without_overlap(data_dir, world_size):
    seqs_per_step, micro = 12, 1
    single = TokenLoader(data_dir, 16, seqs_per_step, micro)
    ranks = [TokenLoader(data_dir, 16, seqs_per_step, micro, rank=r, world_size=world_size)
             for r in range(world_size)]
    for _ in range(6):  # several steps, crossing an epoch boundary
        reference = torch.cat([single.next_batch()[0] for _ in range(single.micro_steps)])
        parts = [torch.cat([loader.next_batch()[0] for _ in range(loader.micro_steps)]) for loader in ranks]
        assert torch.equal(torch.cat(parts), reference)
        assert all(len(p) == seqs_per_step // world_size for p in parts)


def test_a_stream_resharded_to_other_data_parallel_degrees_neither_repeats_nor_skips_documents(data_dir):
    """4 ranks for 3 steps, their state loaded by 2 ranks for 3 steps, then by 3: every step
    trains on the documents an uninterrupted single process trains on, across epochs."""
    seq_len, seqs_per_step = 16, 24
    split = open_split(data_dir, "train")
    stream = split.read(0, split.tokens)
    document_of = np.cumsum(stream == 0)  # document index of each token position (eos_id 0 ends one)

    def documents(windows) -> list[int]:
        return sorted(int(d) for _, w in windows for d in set(document_of[w * seq_len:(w + 1) * seq_len + 1]))

    def step(loaders) -> list[tuple[str, int]]:
        windows = []
        for loader in loaders:
            for _ in range(loader.micro_steps):
                loader.next_batch()
                windows += loader.last_windows
        return windows

    single = TokenLoader(data_dir, seq_len, seqs_per_step, 3)
    state = None
    windows_per_step = 0
    for world_size in (4, 2, 3):
        loaders = [TokenLoader(data_dir, seq_len, seqs_per_step, 1, rank=r, world_size=world_size)
                   for r in range(world_size)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        for _ in range(3):
            resharded, reference = step(loaders), step([single])
            assert sorted(resharded) == sorted(reference)
            assert documents(resharded) == documents(reference)
            windows_per_step = len(reference)
        states = [loader.state_dict() for loader in loaders]
        assert all(s == states[0] for s in states)  # the state is global: any rank's will do
        state = states[0]
    assert 9 * windows_per_step > single.sources[0].windows  # the run crossed an epoch boundary


def _rows(batches) -> list[tuple]:
    """The (input, target) rows of eval batches that are not padding."""
    return [(tuple(x.tolist()), tuple(y.tolist())) for inputs, targets in batches
            for x, y in zip(inputs, targets) if (y != IGNORE).all()]


def test_eval_batches_are_fixed_and_split_across_ranks(data_dir):
    batches = list(eval_batches(data_dir, 16, 160, rows=3))
    assert [len(x) for x, _ in batches] == [3, 3, 3, 3]  # 10 windows and two rows of padding
    assert (batches[-1][1][1:] == IGNORE).all() and (batches[-1][1][0] != IGNORE).all()
    whole = _rows(batches)
    assert len(whole) == 10 and whole == _rows(eval_batches(data_dir, 16, 160, rows=3))
    # 10 windows over 4 ranks: 3, 3, 2, 2, but every rank runs the same number of batches.
    parts = [list(eval_batches(data_dir, 16, 160, 2, rank=r, world_size=4)) for r in range(4)]
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert sorted(sum((_rows(p) for p in parts), [])) == sorted(whole)


def test_a_split_shorter_than_one_sequence_is_refused(data_dir):
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenLoader(data_dir, seq_len=100_000, seqs_per_step=1, micro_batch=1)


def test_a_missing_data_directory_is_refused(tmp_path):
    with pytest.raises(DataError, match="scaletrain data prepare"):
        TokenLoader(tmp_path / "nope", 16, 1, 1)


def test_a_damaged_index_is_refused_in_one_sentence(data_dir, tmp_path):
    import json
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(data_dir, damaged)
    index = json.loads((damaged / "index.json").read_text())
    (damaged / "index.json").write_text(json.dumps({**index, "dtype": "float99"}))
    with pytest.raises(DataError, match="is damaged \\(its dtype 'float99'.*; prepare the data directory again"):
        TokenLoader(damaged, 16, 1, 1)
    for vocab_size, eos_id in ((-1, 0), (0, 0), (70_000, 0), (5000, 5000)):  # (what data stats would size by)
        (damaged / "index.json").write_text(json.dumps({**index, "vocab_size": vocab_size, "eos_id": eos_id}))
        with pytest.raises(DataError, match=f"is damaged \\(vocab_size {vocab_size} with end-of-document id {eos_id} "
                                            "in uint16, where data prepare writes 1 to 65,536 tokens"):
            TokenLoader(damaged, 16, 1, 1)
    (damaged / "index.json").unlink()  # (and what an interrupted prepare leaves)
    (damaged / "work").mkdir()
    (damaged / "work" / "key").write_text("0" * 64)
    with pytest.raises(DataError, match="holds a prepare or import that did not finish; run the same `scaletrain data "
                                        "prepare` .or `data import`. command again"):
        TokenLoader(damaged, 16, 1, 1)


def test_a_shard_holding_ids_beyond_its_tokenizer_is_refused_when_read(data_dir, tmp_path):
    import shutil

    from scaletrain.data.stats import token_counts

    damaged = tmp_path / "damaged"
    shutil.copytree(data_dir, damaged)
    shard = sorted((damaged / "shards").glob("train_*.bin"))[-1]
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    tokens[::7] = 60_000  # (an id of the dtype, not of the tokenizer's 5,000)
    tokens.flush()
    loader = TokenLoader(damaged, 16, 8, 8)
    with pytest.raises(DataError, match=f"shard {shard} holds token id 60000, beyond the 5000 ids of its tokenizer: "
                                        "the file is damaged; prepare the data directory again"):
        for _ in range(30):  # (until a window of the damaged shard is drawn)
            loader.next_batch()
    with pytest.raises(DataError, match="holds token id 60000"):
        token_counts(damaged)
    TokenLoader(data_dir, 16, 8, 8).next_batch()  # (the undamaged data reads)


@pytest.fixture
def two_sources(tmp_path):
    """Source 'low' holds ids 1..999, source 'high' ids 2000..2999: every row tells where it came from."""
    for name, (lo, hi) in {"low": (1, 1000), "high": (2000, 3000)}.items():
        writer = ShardWriter(tmp_path / name, "train", vocab_size=5000, eos_id=0)
        for start in range(lo, hi, 100):
            writer.add(np.arange(start, min(start + 99, hi)))
        write_index(tmp_path / name, vocab_size=5000, eos_id=0, splits={"train": writer.close()})
    return {"low": tmp_path / "low", "high": tmp_path / "high"}


def source_of(row: torch.Tensor) -> str:
    return "high" if int(row.max()) >= 2000 else "low"


def test_a_mixture_samples_by_weight_and_counts_exactly(two_sources):
    loader = TokenLoader(two_sources, 16, seqs_per_step=20, micro_batch=5, weights={"low": 0.3, "high": 0.7})
    counts = {"low": 0, "high": 0}
    for _ in range(50 * loader.micro_steps):
        for row in loader.next_batch()[0]:
            counts[source_of(row)] += 1
    assert loader.tokens_by_source() == {name: n * 16 for name, n in counts.items()}
    assert sum(counts.values()) == 1000
    assert abs(counts["low"] / 1000 - 0.3) < 0.05
    epochs = loader.epochs_by_source()
    assert epochs["low"] == pytest.approx(counts["low"] / loader.sources[0].windows)


def test_a_mixture_resumes_exactly_and_splits_across_ranks(two_sources):
    weights = {"low": 1.0, "high": 1.0}
    loader = TokenLoader(two_sources, 16, 8, 2, seed=5, weights=weights)
    for _ in range(9):  # mid-step
        loader.next_batch()
    state = loader.state_dict()
    expected = torch.cat([loader.next_batch()[0] for _ in range(12)])
    fresh = TokenLoader(two_sources, 16, 8, 2, seed=5, weights=weights)
    fresh.load_state_dict(state)
    assert torch.equal(torch.cat([fresh.next_batch()[0] for _ in range(12)]), expected)

    single = TokenLoader(two_sources, 16, 8, 2, seed=5, weights=weights)
    ranks = [TokenLoader(two_sources, 16, 8, 2, rank=r, world_size=2, seed=5, weights=weights) for r in range(2)]
    for _ in range(5):
        reference = torch.cat([single.next_batch()[0] for _ in range(single.micro_steps)])
        parts = [torch.cat([lo.next_batch()[0] for _ in range(lo.micro_steps)]) for lo in ranks]
        assert torch.equal(torch.cat(parts), reference)


def test_a_growing_batch_of_a_mixture_splits_across_ranks_and_resumes_mid_step(two_sources):
    """batch_seqs: 4 sequences for the first 3 steps, then 8. Each step's rows are drawn from
    the mixture (the draws count steps), split over 2 ranks as one process takes them, and a
    state taken mid-step (in the larger batches) continues exactly."""
    weights = {"low": 1.0, "high": 1.0}

    def ramp(step: int) -> int:
        return 4 if step < 3 else 8

    def loader(**kw) -> TokenLoader:
        return TokenLoader(two_sources, 16, 8, 2, seed=5, weights=weights, batch_seqs=ramp, **kw)

    single, ranks = loader(), [loader(rank=r, world_size=2) for r in range(2)]
    sizes = []
    for _ in range(6):
        reference = torch.cat([single.next_batch()[0] for _ in range(single.micro_steps)])
        parts = [torch.cat([lo.next_batch()[0] for _ in range(lo.micro_steps)]) for lo in ranks]
        assert torch.equal(torch.cat(parts), reference)
        sizes.append(len(reference))
    assert sizes == [4, 4, 4, 8, 8, 8]
    assert (single.state_dict()["step"], single.state_dict()["draws"], single.consumed) == (6, 6, 36)
    assert {source_of(row) for row in reference} == {"low", "high"}  # (a mixture indeed)
    single.next_batch()  # mid-step
    state = single.state_dict()
    expected = torch.cat([single.next_batch()[0] for _ in range(7)])
    fresh = loader()
    fresh.load_state_dict(state)
    assert torch.equal(torch.cat([fresh.next_batch()[0] for _ in range(7)]), expected)


def test_a_mixture_state_for_other_sources_is_refused(two_sources, data_dir):
    state = TokenLoader(two_sources, 16, 8, 2).state_dict()
    with pytest.raises(DataError, match=r"the checkpoint was trained on (high|low) \([\d,]+ tokens\), (high|low) \([\d,]+ "
                                        r"tokens\), this data is .* original data.path"):
        TokenLoader({"low": data_dir, "high": two_sources["high"]}, 16, 8, 2).load_state_dict(state)


def test_the_order_a_mixture_names_its_sources_in_does_not_change_the_data(two_sources):
    forward = TokenLoader(two_sources, 16, 8, 2, seed=3, weights={"low": 0.3, "high": 0.7})
    backward = TokenLoader(dict(reversed(list(two_sources.items()))), 16, 8, 2, seed=3,
                           weights={"high": 0.7, "low": 0.3})
    for _ in range(12):
        assert torch.equal(forward.next_batch()[0], backward.next_batch()[0])


def test_the_prefetcher_hands_out_the_loaders_batches_and_the_state_of_what_it_handed_out(data_dir):
    plain = TokenLoader(data_dir, 16, 8, 2, seed=3)
    ahead = Prefetcher(TokenLoader(data_dir, 16, 8, 2, seed=3), depth=3)
    for _ in range(7):  # not a whole number of steps: the state is mid-step
        expected, got = plain.next_batch(), ahead.next_batch()
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert ahead.last_windows == plain.last_windows
    deadline = time.monotonic() + 30  # until the thread has read ahead; the state must not show it
    while ahead.loader.state_dict() == plain.state_dict() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead.state_dict() == plain.state_dict()
    assert ahead.tokens_by_source() == plain.tokens_by_source()
    assert ahead.loader.state_dict() != plain.state_dict()
    resumed = Prefetcher(TokenLoader(data_dir, 16, 8, 2, seed=3))
    resumed.load_state_dict(ahead.state_dict())
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(plain.next_batch(), resumed.next_batch()))
    for loader in (ahead, resumed):
        loader.close()
    with pytest.raises(RuntimeError, match="before the first batch"):
        ahead.load_state_dict(plain.state_dict())


def test_an_error_in_the_prefetch_thread_is_raised_to_the_consumer(data_dir):
    class Broken(TokenLoader):
        def next_batch(self):
            raise DataError("shard 3 is unreadable")

    ahead = Prefetcher(Broken(data_dir, 16, 8, 2))
    with pytest.raises(DataError, match="shard 3 is unreadable"):
        ahead.next_batch()


def test_an_index_whose_vocabulary_its_tokenizer_passes_is_refused(stdlib_data, tmp_path):
    """index.json's vocab_size below the ids of the directory's tokenizer (edited, or of another
    prepare) would fail in the model's embedding after the run directory is made: refused first."""
    import json
    import shutil

    from scaletrain.data.shards import read_indexes

    damaged = tmp_path / "damaged"
    shutil.copytree(stdlib_data, damaged)
    index = json.loads((damaged / "index.json").read_text())
    assert read_indexes({"a": damaged})["a"]["vocab_size"] == 512
    (damaged / "index.json").write_text(json.dumps({**index, "vocab_size": 10}))
    with pytest.raises(DataError, match="index.json says vocab_size 10, but its tokenizer gives ids up to 511"):
        read_indexes({"a": damaged})
    (damaged / "tokenizer.json").write_text('{"version": "1.0", "mod')
    with pytest.raises(DataError, match="tokenizer.json' is not a tokenizer"):
        read_indexes({"a": damaged})
