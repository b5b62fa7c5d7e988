"""`scaletrain data prepare`: sources in, a curated, tokenized data directory out.

    out/tokenizer.json    byte-level BPE, trained on the curated training documents (or the one given)
    out/shards/, index.json   tokens of each document followed by the end-of-document id (shards.py)
    out/stats.json        documents, bytes and tokens read, kept and dropped by reason
    out/manifest.json     sources, options, content hash and the key that decides reuse; written last
    out/rejects/REASON/*.jsonl  with keep_rejects: every dropped document, by reason, for a person to read

The passes, each over documents in the sources' order:
0. read and hash the sources (cheap): decides whether an identical result already exists;
1. curate, in chunks of about `chunk_bytes` of input spread over `workers` processes:
   normalise and filter (curate.py), drop documents that share a 13-gram with the given
   evaluation texts, then, in this process, drop exact and near duplicates of earlier
   documents (dedup.py) and draw each survivor's split;
2. train the tokenizer on the curated training documents (skipped when one is given);
3. per chunk, in the worker processes: drop training documents that share a 13-gram with
   the validation split, tokenize, and write the chunk's shards.
Each finished chunk of passes 1 and 3 is recorded under out/work/, so a prepare that was
interrupted resumes with the first unfinished chunk when it is run again with the same
arguments. Memory holds one chunk and the deduplication index, not the corpus.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import ftfy
import numpy as np
import tokenizers

from scaletrain.outputs import kind_of

from .curate import REASONS as FILTER_REASONS
from .curate import FilterConfig, curate, document_kind, load_filters
from .dedup import DedupIndex, Decontaminator, MinHasher, exact_key
from .shards import (DataError, ShardWriter, clear_data_dir, finished_key, is_complete, refuse_foreign_files,
                     write_index)
from .sources import (BINARY_SNIFF_BYTES, ReadStats, encodable, list_files, read_documents, reader_version,
                      reads_under)
from .tokenizer import FIM_TOKENS, bos_id, check_vocab_size, eos_id, fim_ids, load_tokenizer, train_tokenizer
from .tokenizer import vocab_size as tokenizer_vocab_size

if TYPE_CHECKING:
    from rich.progress import Progress

# Bump when the same sources and options would give a different data directory, so that
# directories prepared by older code are prepared again rather than reused.
PREPARE_VERSION = 2
DEFAULT_CHUNK_BYTES = 64 << 20  # input per resumable unit of work
BATCH_BYTES = 1 << 20  # documents per task sent to a worker: small enough to spread over workers
# Reasons a document is dropped after curate.py's filters, in pipeline order.
PIPELINE_REASONS = ("decontaminated", "exact_duplicate", "near_duplicate", "val_overlap")


class _NothingKept(DataError):
    """Curation kept no document: the prepare has nothing to resume."""


@dataclass
class PrepareResult:
    out: Path
    reused: bool  # an identical earlier result was found in out and left untouched
    stats: dict  # what stats.json holds
    warnings: list[str]  # notes for the user (skipped lines, non-UTF-8 files, ...)
    resumed_chunks: int = 0  # chunks of input an interrupted earlier run had finished


@dataclass
class _Settings:
    """What worker processes need; sent once to each, at its start."""

    filters: FilterConfig
    curate: bool  # False with filters "none": no filters and no validation-overlap removal
    dedup: bool
    bands: int
    rows: int
    ngram: int
    seed: int
    decontaminate: list[str] = field(default_factory=list)  # evaluation texts
    kind: str = "auto"  # "code" or "prose" for every document; "auto": by each one's file name
    val_overlap: bool = True  # drop training documents sharing a 13-gram with a validation one (with curate)


def prepare(sources: list[str], out: str | Path, vocab_size: int, *, max_bytes: int | None = None,
            text_field: str = "text", tokenizer: str | Path | None = None, val_fraction: float = 0.005,
            seed: int = 0, workers: int | None = None, progress: Progress | None = None,
            filters: str | Path = "default", dedup: bool = True, minhash: tuple[int, int, int] = (14, 8, 5),
            decontaminate: list[str | Path] = (), keep_rejects: bool = False,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, kind: str = "auto", val_overlap: bool = True,
            overwrite: bool = False, split: str = "file", tokenizer_sample: int | None = None,
            bos: bool = True, fim_rate: float = 0.0, fim_spm_rate: float = 0.5) -> PrepareResult:
    """Curate and tokenize sources into the data directory out, or reuse what out holds if it
    was prepared identically; resume an interrupted prepare of the same arguments.

    sources: files, directories (read recursively), globs ('data/**/*.txt'), .jsonl and
        .parquet files (text in `text_field`; compressed files too: sources.py), or
        builtin:python-stdlib / builtin:python-packages.
    vocab_size: ids of the tokenizer to train; ignored when `tokenizer` is given.
    max_bytes: stop reading before the documents read exceed this many UTF-8 bytes.
    tokenizer: a tokenizer.json (or a directory holding one) to use instead of training one.
    val_fraction: share of documents, drawn by a hash of (seed, content), held out for validation.
    workers: processes that curate and tokenize (default: all cores; 1 works in this process).
    filters: "default", "none" (no normalisation, no filters, no deduplication) or a TOML file.
    dedup / minhash: exact and near-duplicate removal; MinHash (bands, rows, word n-gram).
    decontaminate: files of evaluation text; training documents sharing a 13-gram with them go.
    keep_rejects: write every dropped document to out/rejects/REASON/*.jsonl.
    kind: "code" or "prose" curates every document by that kind's rules; "auto" tells each by its
        file name (a .jsonl record or .parquet row by its path or filename field; without one,
        prose): a .jsonl of source files without paths wants "code".
    val_overlap: drop training documents that share a 13-gram with a validation document (a
        corpus whose files share long boilerplate, licence headers, loses many to it; a warning
        says when over a tenth go).
    tokenizer_sample: train the tokenizer on a sample of about this many bytes of the training
        documents (each drawn by a hash of (seed, text)) instead of all of them: a BPE vocabulary
        settles long before tens of GB, whose training takes hours and memory in proportion.
    bos: begin every document with the tokenizer's beginning-of-sequence token where it has one
        (a given Llama tokenizer's: its models saw one at the start of every document; as
        torchtitan encodes them), before the end-of-document token the writer appends.
    fim_rate: the share of training documents rearranged for fill-in-the-middle (Bavarian et al.
        2022, "Efficient Training of Language Models to Fill in the Middle"): each cut at two
        characters drawn uniformly, by a hash of (seed, text), into a prefix, middle and suffix,
        and written as <prefix> prefix <suffix> suffix <middle> middle (PSM) or, a `fim_spm_rate`
        share of them, <prefix> <suffix> suffix <middle> prefix middle (SPM, the paper's second
        variant, as StarCoder trained), each part tokenized apart; the validation split is left
        in order. The tokenizer prepare trains gets the sentinels; a given one must have them.
    split: how a text file is cut into documents: "file" (whole), "paragraph" (at blank lines) or
        "line" (sources.SPLITS): one long text, a book, is otherwise one document.
    overwrite: replace a finished prepare in out of other sources or options, or discard the
        unfinished work of one (refused otherwise: it may have taken hours, and runs trained on a
        finished one could no longer resume).
    progress: a rich Progress to which the passes add their tasks.
    """
    sources, out = [str(source) for source in sources], Path(out)
    if kind not in ("auto", "code", "prose"):
        raise DataError(f"kind {kind!r}: give auto (each document by its file name), code or prose")
    _check_options(vocab_size, max_bytes, val_fraction, seed, workers, tokenizer, chunk_bytes, fim_rate > 0)
    if tokenizer_sample is not None and (tokenizer_sample < 1 or tokenizer is not None):
        raise DataError(f"tokenizer_sample {tokenizer_sample}: give a positive number of bytes to train the "
                        "tokenizer on, and no tokenizer to reuse (whose training is done)")
    filter_config = load_filters(filters)
    dedup = dedup and str(filters) != "none"
    if dedup:  # bad MinHash settings fail here, before anything in out is touched
        MinHasher(*minhash, seed=seed)
        DedupIndex(*minhash[:2])
    files = list_files(sources)
    _check_out(out, sources, files)
    workers = workers or os.cpu_count() or 1
    eval_texts = [example for path in decontaminate for example in _read_eval(path)]

    for name, rate in (("fim_rate", fim_rate), ("fim_spm_rate", fim_spm_rate)):
        if not 0 <= rate <= 1:
            raise DataError(f"{name} {rate} is not a share: give one between 0 and 1 (of the training documents "
                            "rearranged, and of those in SPM order)")
    given = None
    if tokenizer is not None:
        given = load_tokenizer(tokenizer)
        if fim_rate and fim_ids(given) is None:
            raise DataError(f"tokenizer {str(tokenizer)!r} has no fill-in-the-middle tokens ("
                            + "; ".join(", ".join(names) for names in FIM_TOKENS) + "); give one that has them "
                            "(a code model's), or let prepare train one")
        tokenizer_path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        # Kept as bytes: out/tokenizer.json may be the very file given, and out is cleared below.
        tokenizer_bytes = tokenizer_path.read_bytes()
        vocab_size = tokenizer_vocab_size(given)

    # Pass 0: read and hash everything that will be used.
    stats = ReadStats()
    task = _add_task(progress, "reading sources", len(files))
    for _ in read_documents(files, text_field, max_bytes, stats, on_file=lambda: _advance(progress, task, 1),
                            split=split):
        pass
    _finish_task(progress, task, len(files))
    options = {"vocab_size": vocab_size, "max_bytes": max_bytes, "text_field": text_field,
               "val_fraction": val_fraction, "seed": seed, "filters": filter_config.model_dump(mode="json"),
               "dedup": dedup, "minhash": list(minhash), "chunk_bytes": chunk_bytes,
               "decontaminate": [hashlib.sha256(t.encode()).hexdigest() for t in eval_texts],
               "keep_rejects": keep_rejects, "curate": str(filters) != "none",
               "tokenizer": None if given is None else
               {"path": str(tokenizer_path), "sha256": hashlib.sha256(tokenizer_bytes).hexdigest()},
               # (only where not the default, so that the directories prepared before keep their key)
               **({"kind": kind} if kind != "auto" else {}), **({} if val_overlap else {"val_overlap": False}),
               **({"split": split} if split != "file" else {}),
               **({"tokenizer_sample": tokenizer_sample} if tokenizer_sample is not None else {}),
               **({"fim": [fim_rate, fim_spm_rate]} if fim_rate else {}),
               **({"reader": reader} if (reader := reader_version(files)) else {}),
               # (a tokenizer prepare trains has none: only a given one's, where it has one)
               **({"bos_id": begins} if bos and given is not None and (begins := bos_id(given)) is not None else {})}
    content_sha256 = stats.content.hexdigest()
    key = _key(options, content_sha256)
    if is_complete(out, key):
        reused_stats = json.loads((out / "stats.json").read_text())
        return PrepareResult(out, True, reused_stats, reused_stats["warnings"])
    if stats.documents["kept"] == 0:
        dropped = stats.as_dict()["documents"]["dropped"]
        reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n) or "the sources hold none"
        hints = [" or a larger max_bytes" if dropped.get("over_max_bytes") else "",
                 f" (a .jsonl record or .parquet row without a field {text_field!r} holds none: name the field "
                 "that holds the text with --text-field)" if dropped.get("missing_field") else "",
                 " (a .jsonl line that is not JSON holds none)" if dropped.get("bad_json") else ""]
        raise DataError(f"no documents to prepare ({reasons}); give sources that contain text" + "".join(hints))

    work = out / "work"
    created = not out.exists()  # (what a prepare that keeps nothing leaves: nothing, if it made out)
    replaced = _replaced(out, options, content_sha256)
    if replaced and not overwrite and finished_key(out) != key:
        raise DataError(f"{str(out)!r} holds a finished prepare of other sources or options ({replaced}); give "
                        "another output directory, or --overwrite to replace it (runs trained on it would then no longer "
                        "resume)")
    started = _work_key(work)
    if started not in (None, key) and not overwrite:
        raise DataError(f"{str(out)!r} holds the unfinished work of a prepare or import of other sources or options; "
                        "run that command again to finish it, give another output directory, or --overwrite to "
                        "discard it")
    if started != key:
        clear_data_dir(out)
        work.mkdir(parents=True)
        (work / "key").write_text(key)
    (out / "manifest.json").unlink(missing_ok=True)  # incomplete until the very end
    settings = _Settings(filter_config, str(filters) != "none", dedup, *minhash, seed=seed,
                         decontaminate=eval_texts, kind=kind, val_overlap=val_overlap)

    # One set of worker processes for passes 1 and 3, started before this process trains the
    # tokenizer: forking after the tokenizers library has run its threads is unsafe.
    try:
        with _pool(workers, settings) as pool:
            result_stats, warnings, resumed = _run_passes(
                pool, files, (text_field, split), max_bytes, stats, settings, chunk_bytes, val_fraction, seed, work,
                out, keep_rejects, given, vocab_size, progress, content_sha256, tokenizer_bytes if given else None,
                tokenizer_sample, bos, (fim_rate, fim_spm_rate) if fim_rate else None)
    except _NothingKept:  # (nothing to resume, nothing for a later prepare to call unfinished)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            clear_data_dir(out)  # (its own files alone; a data directory there before was cleared above)
        raise

    # Last, so that a directory without a manifest is never taken for a complete one.
    _write_json(out / "manifest.json", {
        "key": key,
        "sources": {"given": sources, "files_listed": stats.files_listed, "files_read": stats.files_read},
        "options": options,
        "content_sha256": content_sha256,
        "scaletrain_version": _version(),
        "tokenizers_version": tokenizers.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    shutil.rmtree(work, ignore_errors=True)
    if replaced:
        warnings = [*warnings, f"{out} held a finished prepare that differs from this one ({replaced}: other "
                               "sources or options, other library versions, or damaged files); it was replaced, and "
                               "runs that trained on it no longer resume"]
    return PrepareResult(out, False, result_stats, warnings, resumed)


def _run_passes(pool, files, reading: tuple[str, str], max_bytes, stats: ReadStats, settings: _Settings, chunk_bytes,
                val_fraction, seed, work: Path, out: Path, keep_rejects: bool, given, vocab_size: int, progress,
                content_sha256: str, tokenizer_bytes: bytes | None,
                tokenizer_sample: int | None = None, bos: bool = True,
                fim: tuple[float, float] | None = None) -> tuple[dict, list[str], int]:
    """Passes 1 to 3; returns (stats.json's contents, warnings, chunks resumed from an earlier run)."""
    # Pass 1: curate, deduplicate, draw the split.
    reread = ReadStats()
    task = _add_task(progress, "curating", stats.bytes["kept"])
    chunks = _curate_chunks(pool, files, reading, max_bytes, reread, settings, chunk_bytes, val_fraction,
                            seed, work, out if keep_rejects else None, lambda n: _advance(progress, task, n))
    _finish_task(progress, task, stats.bytes["kept"])
    if reread.content.hexdigest() != content_sha256:
        raise DataError("the sources changed while they were being prepared; prepare again once they are stable")
    curated = _merge_counts(chunks)
    if curated["kept"] == 0:
        long_text = curated["dropped"].get("gopher_quality:too_many_words") and reading[1] == "file"
        raise _NothingKept(f"curation removed every document ({_reason_summary(curated['dropped'])}); "
                           "loosen the filters (--filters FILE.toml, or --filters none)"
                           + (", or cut long texts into documents (--split paragraph, or line): a text file is one "
                              "document" if long_text else ""))
    overrides = _split_overrides(chunks, val_fraction)

    # Pass 2: the tokenizer, trained on training documents only so validation text stays unseen.
    warnings = stats.warnings()
    sampled: list[int | None] = [None]  # (the bytes it was trained on, counted as they are read)
    if given is None:
        tokenizer_file = work / "tokenizer.json"
        if not tokenizer_file.is_file():
            task = _add_task(progress, "training tokenizer", curated["bytes_kept"])
            texts = (text for text, val in _curated_documents(work, chunks, overrides, progress, task) if not val)
            if tokenizer_sample is not None:  # (a share of the documents, drawn apart from the validation split's)
                share = tokenizer_sample / max(1, curated["bytes_kept"])
                texts = (text for text in texts if _tokenizer_draw(seed, text) < share)
            trained = train_tokenizer(_counting(texts, sampled), vocab_size, fim=fim is not None)
            _finish_task(progress, task, curated["bytes_kept"])
            if not sampled[0]:
                raise DataError(f"tokenizer_sample {tokenizer_sample:,} bytes drew no training document (they hold "
                                f"{curated['bytes_kept']:,} bytes in all); give a larger sample, or none")
            (work / "tokenizer_bytes").write_text(str(sampled[0]))  # (before the tokenizer: a resume reads it)
            trained.save(str(tokenizer_file) + ".tmp")
            os.replace(str(tokenizer_file) + ".tmp", tokenizer_file)
        counted = work / "tokenizer_bytes"  # (absent where an older version trained it: not said)
        sampled[0] = int(counted.read_text()) if counted.is_file() else None
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        tok = load_tokenizer(out / "tokenizer.json")
        learned = tokenizer_vocab_size(tok)
        if learned < vocab_size:  # (the data's vocabulary is what the tokenizer has: a model needs no more rows)
            warnings.append(f"the tokenizer learned {learned:,} of the {vocab_size:,} ids asked for: the text has "
                            f"too few distinct byte pairs to merge; the data's vocabulary is {learned:,}")
            vocab_size = learned
    else:
        (out / "tokenizer.json").write_bytes(tokenizer_bytes)
        tok = given
    eos = eos_id(tok)

    # Pass 3: decontaminate against the validation split, tokenize, write shards (per chunk).
    val_file = work / "val_texts.pkl"
    overlap_check = settings.curate and settings.val_overlap
    if overlap_check and not val_file.is_file():
        with open(f"{val_file}.tmp", "wb") as f:
            pickle.dump([text for text, val in _curated_documents(work, chunks, overrides) if val], f)
        os.replace(f"{val_file}.tmp", val_file)
    task = _add_task(progress, "tokenizing", curated["bytes_kept"])
    start = bos_id(tok) if bos else None
    job = _TokenizeJob(str(out), vocab_size, str(val_file) if overlap_check else None,
                       str(out) if keep_rejects else None, start,
                       None if fim is None else _Fim(*fim_ids(tok), *fim, seed=seed))
    written = _tokenize_chunks(pool, work, chunks, overrides, job, lambda n: _advance(progress, task, n))
    _finish_task(progress, task, curated["bytes_kept"])
    splits = {split: {"tokens": sum(w[split]["tokens"] for w in written),
                      "documents": sum(w[split]["documents"] for w in written),
                      "shards": [s for w in written for s in w[split]["shards"]]} for split in ("train", "val")}
    write_index(out, vocab_size, eos, splits, bos_id=start)

    result_stats = stats.as_dict()
    dropped = result_stats["documents"]["dropped"]
    dropped.update({reason: 0 for reason in (*FILTER_REASONS, *PIPELINE_REASONS)})
    bytes_dropped = result_stats["bytes"]["dropped"]
    bytes_dropped.update({reason: 0 for reason in (*FILTER_REASONS, *PIPELINE_REASONS)})
    for chunk in [*chunks, *written]:
        for reason, (documents, nbytes) in chunk["dropped"].items():
            dropped[reason] += documents
            bytes_dropped[reason] += nbytes
    kept_documents = splits["train"]["documents"] + splits["val"]["documents"]
    result_stats["documents"].update(kept=kept_documents, train=splits["train"]["documents"],
                                     val=splits["val"]["documents"])
    # Input bytes throughout, so read = kept + every dropped reason; "curated" is what the kept
    # documents hold after normalisation and line filtering.
    result_stats["bytes"].update(kept=sum(w["bytes"]["train"] + w["bytes"]["val"] for w in written),
                                 train=sum(w["bytes"]["train"] for w in written),
                                 val=sum(w["bytes"]["val"] for w in written),
                                 curated=sum(w["curated_bytes"] for w in written))
    result_stats["tokens"] = {"train": splits["train"]["tokens"], "val": splits["val"]["tokens"]}
    result_stats["vocab_size"], result_stats["eos_id"] = vocab_size, eos
    if start is not None:
        result_stats["bos_id"] = start
    if fim is not None:
        result_stats["fim"] = {"rate": fim[0], "spm_rate": fim[1],
                               "documents": sum(w.get("fim_documents", 0) for w in written)}
    result_stats["tokenizer"] = {"trained": given is None, "learned_vocab_size": tokenizer_vocab_size(tok),
                                 **({"trained_on_bytes": sampled[0]} if sampled[0] is not None else {})}
    if not splits["val"]["tokens"]:
        warnings.append("the validation split is empty (" + ("--val-fraction 0" if val_fraction == 0 else
                        "a single document kept") + "): train measures its validation loss on it and refuses a run "
                        "on this data; prepare with a --val-fraction above 0 and two documents or more"
                        + (" (a text file is one document: --split paragraph, or line, cuts it into many)"
                           if val_fraction > 0 and reading[1] == "file" else ""))
    if not splits["train"]["tokens"]:  # (of use to `eval --data` as a validation set; not to train on)
        warnings.append(f"the training split is empty: the {splits['val']['documents']} document(s) kept went to "
                        "validation; train refuses a run on this data; prepare more text")
    read = result_stats["documents"]["read"]
    if read and dropped["val_overlap"] > 0.1 * read:
        warnings.append(f"{dropped['val_overlap']:,} of the {read:,} documents read ({dropped['val_overlap'] / read:.0%}) "
                        "were dropped for sharing a 13-gram with a validation document: boilerplate the files share "
                        "(licence headers, generated code) counts too; --no-val-overlap keeps them")
    result_stats["warnings"] = warnings
    _write_json(out / "stats.json", result_stats)
    return result_stats, warnings, sum(1 for chunk in chunks if chunk.get("resumed"))


# -- pass 1: curate ---------------------------------------------------------------------------


def _curate_chunks(pool, files, reading: tuple[str, str], max_bytes, reread: ReadStats, settings: _Settings,
                   chunk_bytes: int, val_fraction: float, seed: int, work: Path, rejects: Path | None,
                   advance) -> list[dict]:
    """Run pass 1 chunk by chunk, skipping chunks a previous run finished; return each chunk's record."""
    index = DedupIndex(settings.bands, settings.rows)
    records = []
    documents = read_documents(files, reading[0], max_bytes, reread, split=reading[1])
    for number, chunk in enumerate(_chunks(documents, chunk_bytes)):
        done = work / f"curated_{number:05d}.json"
        if done.is_file():  # finished by an earlier run: restore its documents into the index
            record = {**json.loads(done.read_text()), "resumed": True}
            if settings.dedup:
                keys = np.load(work / f"curated_{number:05d}.keys.npz")
                for exact, signature in zip(keys["exact"], keys["signatures"]):
                    index.add(exact.tobytes(), signature)
            advance(record["bytes_read"])
            records.append(record)
            continue
        records.append(_curate_one_chunk(number, chunk, pool, index, settings, val_fraction, seed, work,
                                         rejects, advance))
    return records


def _curate_one_chunk(number, chunk, pool, index: DedupIndex, settings: _Settings, val_fraction, seed,
                      work: Path, rejects: Path | None, advance) -> dict:
    dropped: dict[str, list[int]] = {}
    kept_exact, kept_signatures = [], []
    draws = []
    kept_bytes = 0
    stem = work / f"curated_{number:05d}"
    with open(f"{stem}.pkl.tmp", "wb") as kept_file, _Rejects(rejects, number) as reject:
        batches = list(_batches(chunk))
        for batch, results in zip(batches, pool(_curate_batch, batches)):
            kept = []
            for (text, nbytes, name), (curated, reason, exact, signature) in zip(batch, results):
                if reason is None and settings.dedup:
                    reason = index.add(exact, signature)
                if reason is not None:
                    entry = dropped.setdefault(reason, [0, 0])
                    entry[0] += 1
                    entry[1] += nbytes
                    reject.write(reason, name, text)
                    continue
                draw = _split_draw(seed, curated)
                kept.append((curated, draw < val_fraction, nbytes, name))
                kept_bytes += len(curated.encode())
                draws.append(draw)
                if settings.dedup:
                    kept_exact.append(exact)
                    kept_signatures.append(signature)
            pickle.dump(kept, kept_file, protocol=pickle.HIGHEST_PROTOCOL)
            advance(sum(nbytes for _, nbytes, _ in batch))
    os.replace(f"{stem}.pkl.tmp", f"{stem}.pkl")
    signatures = np.stack(kept_signatures) if kept_signatures else np.zeros((0, settings.bands * settings.rows))
    # Keys as rows of bytes: numpy's bytes dtype would drop a digest's trailing zero bytes.
    exact_keys = (np.frombuffer(b"".join(kept_exact), dtype=np.uint8).reshape(len(kept_exact), -1)
                  if kept_exact else np.zeros((0, 0), dtype=np.uint8))
    with open(f"{stem}.keys.npz.tmp", "wb") as f:
        np.savez(f, exact=exact_keys, signatures=signatures)
    os.replace(f"{stem}.keys.npz.tmp", f"{stem}.keys.npz")
    draws_array = np.asarray(draws)
    record = {"number": number, "bytes_read": sum(nbytes for _, nbytes, _ in chunk), "kept": len(draws),
              "bytes_kept": kept_bytes,
              "dropped": dropped,
              # the documents nearest the split boundary, in case a split ends up empty
              "min_draw": [float(draws_array.min()), int(draws_array.argmin())] if len(draws) else None,
              "max_draw": [float(draws_array.max()), int(draws_array.argmax())] if len(draws) else None,
              "val": int((draws_array < val_fraction).sum()) if len(draws) else 0}
    _write_json(Path(f"{stem}.json"), record)  # last: the chunk is finished
    return record


def _curate_batch(batch: list[tuple[str, int, str]]) -> list[tuple]:
    """Worker: (curated text or None, reason or None, exact key, MinHash signature) per document."""
    settings, hasher, contamination = _WORKER["settings"], _WORKER["hasher"], _WORKER["contamination"]
    results = []
    for text, _, name in batch:
        curated, reason = curate(text, document_kind(name) if settings.kind == "auto" else settings.kind,
                                 settings.filters)
        if curated is not None and contamination is not None and contamination.contaminated(curated):
            curated, reason = None, "decontaminated"
        if curated is None:
            results.append((None, reason, None, None))
        elif settings.dedup:
            results.append((curated, None, exact_key(curated), hasher.signature(curated)))
        else:
            results.append((curated, None, b"", None))
    return results


def _chunks(documents, chunk_bytes: int) -> Iterator[list]:
    """Consecutive runs of (text, bytes, name) documents of about chunk_bytes each (a document
    is never split)."""
    chunk, size = [], 0
    for document in documents:
        chunk.append(document)
        size += document[1]
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _batches(documents: list) -> Iterator[list]:
    """A chunk's documents in tasks of about BATCH_BYTES for the workers."""
    return _chunks(documents, BATCH_BYTES)


def _split_overrides(chunks: list[dict], val_fraction: float) -> dict[tuple[int, int], bool]:
    """(chunk, position) -> split of the documents moved so that a split is not empty: at least
    one validation document when there are two documents and val_fraction > 0, and always a
    training document."""
    located = [(c["min_draw"], c["max_draw"], c["number"]) for c in chunks if c["kept"]]
    total = sum(c["kept"] for c in chunks)
    val = sum(c["val"] for c in chunks)
    overrides = {}
    if val_fraction > 0 and total >= 2 and val == 0:
        (_, position), _, number = min(located, key=lambda item: item[0][0])
        overrides[(number, position)] = True
    if val == total:
        _, (_, position), number = max(located, key=lambda item: item[1][0])
        overrides[(number, position)] = False
    return overrides


def _curated_documents(work: Path, chunks: list[dict], overrides: dict, progress=None, task=None):
    """(text, is_validation) of every curated document, in order."""
    for chunk in chunks:
        for position, (text, val, _, _) in enumerate(_read_pickled(work / f"curated_{chunk['number']:05d}.pkl", chunk)):
            if progress is not None:
                _advance(progress, task, len(text.encode()))
            yield text, overrides.get((chunk["number"], position), val)


def _read_pickled(path: Path, chunk: dict) -> Iterator[tuple[str, bool, int, str]]:
    """(curated text, is validation, input bytes, source file) of each document a finished chunk
    kept (the source "" in a chunk curated by a version that did not keep it)."""
    count = 0
    with open(path, "rb") as f:
        while True:
            try:
                batch = pickle.load(f)
            except EOFError:
                break
            count += len(batch)
            yield from (document if len(document) == 4 else (*document, "") for document in batch)
    if count != chunk["kept"]:
        raise DataError(f"{path} holds {count} documents, its record says {chunk['kept']} (damaged by a crash?); "
                        f"delete {path.parent} and prepare again")


# -- pass 3: tokenize -------------------------------------------------------------------------


@dataclass
class _TokenizeJob:
    """What a worker needs to tokenize chunks (read lazily, once per process: see _worker_value)."""

    out: str
    vocab_size: int
    val_file: str | None  # pickled validation texts, for the validation-overlap check
    rejects: str | None
    bos_id: int | None = None  # put before every document, where the tokenizer has one
    fim: _Fim | None = None  # fill-in-the-middle's rearrangement of training documents


@dataclass
class _Fim:
    """Fill-in-the-middle (see prepare's fim_rate): the sentinels' ids, the rates, the seed."""

    prefix: int
    suffix: int
    middle: int
    rate: float
    spm_rate: float
    seed: int = 0

    def parts(self, text: str) -> tuple[str, str, str, bool] | None:
        """(prefix, middle, suffix, in SPM order) where `text` is to be rearranged, else None: drawn
        by a hash of (seed, text), so the same on every run, worker and chunk size."""
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16, key=b"fim" + str(self.seed).encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        if rng.random() >= self.rate:
            return None
        spm = bool(rng.random() < self.spm_rate)
        start, end = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
        return text[:start], text[start:end], text[end:], spm

    def arrange(self, prefix: list[int], middle: list[int], suffix: list[int], spm: bool) -> list[int]:
        """The tokens of a rearranged document."""
        if spm:
            return [self.prefix, self.suffix, *suffix, self.middle, *prefix, *middle]
        return [self.prefix, *prefix, self.suffix, *suffix, self.middle, *middle]


def _tokenize_chunks(pool, work: Path, chunks: list[dict], overrides: dict, job: _TokenizeJob,
                     advance) -> list[dict]:
    records: dict[int, dict] = {}
    pending = []
    for chunk in chunks:
        number = chunk["number"]
        done = work / f"shards_{number:05d}.json"
        if done.is_file():  # finished by an earlier run
            records[number] = json.loads(done.read_text())
            advance(records[number]["curated_bytes"])
        else:
            moved = {position: val for (n, position), val in overrides.items() if n == number}
            pending.append((number, chunk["kept"], moved, job))
    for record in pool(_tokenize_chunk, pending):
        records[record["number"]] = record
        advance(record["curated_bytes"])
    return [records[chunk["number"]] for chunk in chunks]


def _tokenize_chunk(task: tuple[int, int, dict, _TokenizeJob]) -> dict:
    """Worker: decontaminate one curated chunk against the validation split, tokenize it, write its shards."""
    number, kept, moved, job = task
    out = Path(job.out)
    work = out / "work"
    tok = _worker_value("tokenizer", str(out / "tokenizer.json"), load_tokenizer)
    overlap = None
    if job.val_file is not None:
        overlap = _worker_value("val_overlap", job.val_file, _load_val_overlap)
    eos = eos_id(tok)
    writers = {split: ShardWriter(out, split, job.vocab_size, eos, prefix=f"{split}_{number:05d}")
               for split in ("train", "val")}
    dropped: dict[str, list[int]] = {}
    split_bytes = {"train": 0, "val": 0}  # input bytes of the documents kept, by split
    curated_bytes = 0  # their bytes after normalisation and line filtering
    fim_documents = [0]  # rearranged for fill-in-the-middle
    batch: list[tuple[str, bool]] = []
    with _Rejects(Path(job.rejects) if job.rejects else None, number, suffix="tokenize") as reject:
        def flush():
            # No special tokens added by the post-processor (which may add an end too, or pairs'
            # tokens): the beginning-of-sequence id, where there is one, is put here, and the
            # writer appends the end-of-document id itself.
            start = [] if job.bos_id is None else [job.bos_id]
            # Fill-in-the-middle: a training document's three parts tokenized apart (none across a cut).
            cuts = [job.fim.parts(text) if job.fim is not None and not val else None for text, val in batch]
            texts = [part for (text, _), cut in zip(batch, cuts) for part in (cut[:3] if cut else (text,))]
            encodings = iter(tok.encode_batch_fast(texts, add_special_tokens=False))
            for (_, val), cut in zip(batch, cuts):
                ids = next(encodings).ids
                if cut:
                    ids = job.fim.arrange(ids, next(encodings).ids, next(encodings).ids, cut[3])
                    fim_documents[0] += 1
                writers["val" if val else "train"].add(start + ids if start else ids)
            batch.clear()

        size = 0
        for position, (text, val, nbytes, source) in enumerate(_read_pickled(work / f"curated_{number:05d}.pkl",
                                                                               {"kept": kept})):
            val = moved.get(position, val)
            if not val and overlap is not None and overlap.contaminated(text):
                entry = dropped.setdefault("val_overlap", [0, 0])
                entry[0] += 1
                entry[1] += nbytes
                reject.write("val_overlap", source, text)
                continue
            curated_bytes += len(text.encode())  # of kept documents only
            split_bytes["val" if val else "train"] += nbytes
            batch.append((text, val))
            size += len(text)
            if size >= BATCH_BYTES:
                flush()
                size = 0
        if batch:
            flush()
    record = {"number": number, "dropped": dropped, "bytes": split_bytes, "curated_bytes": curated_bytes,
              **({"fim_documents": fim_documents[0]} if job.fim is not None else {}),
              **{split: writer.close() for split, writer in writers.items()}}
    _write_json(work / f"shards_{number:05d}.json", record)
    return record


def _load_val_overlap(path: str) -> Decontaminator:
    with open(path, "rb") as f:
        return Decontaminator(pickle.load(f), whole_short_texts=False)


# -- worker processes -------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(settings: _Settings) -> None:
    """Build once per process what every document of pass 1 needs: the hasher and the
    decontamination index of the evaluation texts."""
    _WORKER.clear()
    _WORKER["settings"] = settings
    _WORKER["hasher"] = (MinHasher(settings.bands, settings.rows, settings.ngram, seed=settings.seed)
                         if settings.dedup else None)
    _WORKER["contamination"] = Decontaminator(settings.decontaminate) if settings.decontaminate else None


def _worker_value(name: str, path: str, load):
    """load(path), once per process and path: what pass 3 needs exists only once pass 2 is done."""
    if _WORKER.get(f"{name}_path") != path:
        _WORKER[name], _WORKER[f"{name}_path"] = load(path), path
    return _WORKER[name]


def _init_pool_worker(settings: _Settings) -> None:
    # One tokenizer thread per process: the processes themselves use every core.
    os.environ["RAYON_NUM_THREADS"] = "1"
    _init_worker(settings)


class _pool:
    """`with _pool(n, settings) as run: run(fn, tasks)` maps fn over tasks, in order, on n
    worker processes (or in this process when n is 1), each initialised with settings. A
    worker that dies (killed, out of memory) stops the prepare with a DataError; finished
    chunks are kept, so running it again resumes."""

    def __init__(self, workers: int, settings: _Settings):
        self.workers, self.settings, self.executor, self.broken = workers, settings, None, False

    def __enter__(self):
        if self.workers == 1:
            _init_worker(self.settings)
            return lambda fn, tasks: map(fn, tasks)
        # fork where there is one: spawn would re-run an unguarded calling script in every
        # worker. Nothing in this process has used the tokenizers library's threads yet.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self.executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(method),
                                            initializer=_init_pool_worker, initargs=(self.settings,))
        return self._map

    def _map(self, fn, tasks):
        try:  # a worker that died between two maps breaks the pool before the first submit
            futures = [self.executor.submit(fn, task) for task in tasks]
            for future in futures:
                while True:
                    try:
                        yield future.result(timeout=1.0)
                        break
                    except FuturesTimeout:  # a worker killed while writing its result is never noticed
                        if any(p.exitcode is not None for p in list(self.executor._processes.values())):
                            raise BrokenProcessPool("a worker died") from None
        except BrokenProcessPool:
            self.broken = True
            _release(self.executor)
            raise DataError("a worker process of data prepare died (killed, or out of memory); run the same "
                            "command again to resume from the finished chunks") from None

    def __exit__(self, *exc):
        if self.executor is not None:
            # A broken pool is waited for: its workers are already stopping, and a process that
            # exits while the pool's manager thread is still closing its pipes prints a traceback
            # from concurrent.futures' exit hook (Python 3.11).
            self.executor.shutdown(wait=exc[0] is None or self.broken, cancel_futures=True)


def _release(executor: ProcessPoolExecutor) -> None:
    """After a worker died: end the others, and free the executor's manager thread if it is stuck
    reading a result the dead worker only half wrote (CPython 3.11 waits for the rest forever,
    and so would shutdown and the interpreter's exit): zeros complete the message, which then
    fails to unpickle, and the thread marks the pool broken and ends."""
    for process in list(executor._processes.values()):
        if process.exitcode is None:
            process.kill()
    thread, fd = executor._executor_manager_thread, executor._result_queue._writer.fileno()
    os.set_blocking(fd, False)
    deadline = time.monotonic() + 30
    while thread is not None and thread.is_alive() and time.monotonic() < deadline:
        try:
            os.write(fd, bytes(1 << 16))
        except (BlockingIOError, OSError):
            pass
        thread.join(0.05)


class _Rejects:
    """With a rejects directory, appends each dropped document to rejects/REASON/TAG.jsonl."""

    def __init__(self, root: Path | None, number: int, suffix: str = "curate"):
        self.root, self.files = (root / "rejects") if root else None, {}
        self.tag = f"{number:05d}.{suffix}"

    def __enter__(self):
        return self

    def write(self, reason: str, source: str, text: str) -> None:
        if self.root is None:
            return
        if reason not in self.files:
            folder = self.root / reason.replace(":", "-")
            folder.mkdir(parents=True, exist_ok=True)
            self.files[reason] = open(folder / f"{self.tag}.jsonl", "w")
        self.files[reason].write(json.dumps({"source": source, "text": text}) + "\n")

    def __exit__(self, *exc):
        for f in self.files.values():
            f.close()


# -- helpers ----------------------------------------------------------------------------------


def _merge_counts(chunks: list[dict]) -> dict:
    dropped: dict[str, int] = {}
    for chunk in chunks:
        for reason, (documents, _) in chunk["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + documents
    return {"kept": sum(c["kept"] for c in chunks), "bytes_kept": sum(c["bytes_kept"] for c in chunks),
            "dropped": dropped}


def _tokenizer_draw(seed: int, text: str) -> float:
    """A uniform number in [0, 1) of (seed, text): which documents train a sampled tokenizer."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=b"tokenizer" + str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def _counting(texts, counted: list):
    """texts, their UTF-8 bytes summed into counted[0] as they pass."""
    counted[0] = 0
    for text in texts:
        counted[0] += len(text.encode("utf-8"))
        yield text


def _reason_summary(dropped: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items(), key=lambda kv: -kv[1]) if n)


def _read_eval(path: str | Path) -> list[str]:
    """The examples of an evaluation file: each record of a .jsonl (its "text"; a task's
    "context" and right choice, as eval.tasks' files hold them; else the record's strings), else each paragraph
    (between blank lines, whatever the line endings). An example shorter than 13 words is
    matched whole (GPT-3's rule)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"decontamination file {str(path)!r} does not exist; give files of evaluation text")
    raw = path.read_bytes()
    if b"\0" in raw[:BINARY_SNIFF_BYTES]:  # (what the sources' reader calls binary)
        raise DataError(f"decontamination file {str(path)!r} is binary, not text; give files of evaluation text "
                        "(.jsonl records, or paragraphs)")
    text = encodable(raw.decode("utf-8", errors="replace").removeprefix("\ufeff"))
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if path.suffix.lower() == ".jsonl":
        examples = [_example(line) for line in text.splitlines() if line.strip()]
    else:
        examples = re.split(r"\n[ \t]*\n", text)
    examples = [e for e in examples if e.strip()]
    if not examples:  # (a file given to protect nothing is a mistake worth a word)
        raise DataError(f"decontamination file {str(path)!r} holds no evaluation text; give files of evaluation text "
                        "(.jsonl records, or paragraphs)")
    return examples


def _example(line: str) -> str:
    """The evaluation text of one line of a .jsonl: its record's "text", or a multiple-choice
    task's "context" followed by its right choice (the whole example, question and answer, as
    GPT-3 matched it: a short choice alone would match documents whole, and a short question
    alone any document that asks it; without a valid "label", the context alone), or else the
    record's strings (not its keys, which are no evaluation text)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return line
    if not isinstance(record, dict):
        return line
    if isinstance(record.get("text"), str):
        return encodable(record["text"])
    if isinstance(record.get("context"), str):
        choices, label = record.get("choices"), record.get("label")
        right = (choices[label] if isinstance(choices, list) and type(label) is int and 0 <= label < len(choices)
                 and isinstance(choices[label], str) else "")
        return encodable(f"{record['context']} {right}".strip())
    strings = [v for value in record.values() for v in (value if isinstance(value, list) else [value])
               if isinstance(v, str)]
    return encodable("\n".join(strings))


def _check_options(vocab_size: int, max_bytes: int | None, val_fraction: float, seed: int,
                   workers: int | None, tokenizer: str | Path | None, chunk_bytes: int, fim: bool = False) -> None:
    if tokenizer is None:
        check_vocab_size(vocab_size, fim)
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"max_bytes must be a positive number of bytes, not {max_bytes}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be at least 0 and below 1, not {val_fraction}")
    if not isinstance(seed, int):
        raise DataError(f"seed must be an integer, not {seed!r}")
    if workers is not None and workers < 1:
        raise DataError(f"workers must be at least 1, not {workers}")
    if chunk_bytes < 1:
        raise DataError(f"chunk_bytes must be positive, not {chunk_bytes}")


def _check_out(out: Path, sources: list[str], files) -> None:
    """Refuse an out that the sources would read back on the next run."""
    if out.exists() and not out.is_dir():
        raise DataError(f"output {str(out)!r} is a file; give a directory to prepare the data into")
    found = kind_of(out)
    if found not in (None, "prepared data directory"):
        raise DataError(f"output {str(out)!r} is a {found}; give a new directory to prepare the data into")
    if found is None:
        refuse_foreign_files(out, "prepare")
    resolved = out.resolve()
    for source in sources:
        if reads_under(source, out):
            raise DataError(f"output {str(out)!r} is inside the folder that source {source!r} reads, so the "
                            "next run would read its files back; prepare into a directory outside the sources")
    for file in files:
        if file.path.resolve().is_relative_to(resolved):
            raise DataError(f"source file {str(file.path)!r} is inside the output directory {str(out)!r}; "
                            "prepare into a directory outside the sources")


def _split_draw(seed: int, text: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, content): the same document always lands in
    the same split, duplicates never straddle train and validation, and adding other
    documents moves no document between splits."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def _key(options: dict, content_sha256: str) -> str:
    """What decides reuse: everything the output depends on. The tokenizer is named by its
    hash, not its path, and `workers` is absent because it does not change the output."""
    # ftfy's repairs and rensa's signatures change between their releases: a resumed or reused
    # prepare must not mix them.
    material = {"prepare_version": PREPARE_VERSION, "tokenizers_version": tokenizers.__version__,
                "ftfy_version": ftfy.__version__, "rensa_version": _package_version("rensa"),
                "options": {**options, "tokenizer": options["tokenizer"] and options["tokenizer"]["sha256"]},
                "content_sha256": content_sha256}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _work_key(work: Path) -> str | None:
    """The key of the unfinished prepare or import whose work is out/work, if any."""
    try:
        return (work / "key").read_text()
    except OSError:
        return None


def _replaced(out: Path, options: dict, content_sha256: str) -> str | None:
    """What the finished prepare in out was (its vocabulary and when it was made) and how it
    differs from one of `options` on text of `content_sha256`, when there is one."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        if "imported" in manifest:  # (data import's: no options of prepare's to compare)
            return f"tokens `data import` wrote, made {manifest['created']}"
        made = f"vocabulary {manifest['options']['vocab_size']}, made {manifest['created']}"
        then = dict(manifest["options"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    changed = []
    for name in sorted(then.keys() | options.keys()):
        old, new = then.get(name), options.get(name)
        if name == "tokenizer":  # (named by its hash, not its path)
            old, new = (value and value.get("sha256") for value in (old, new))
        if old != new:
            small = max(len(repr(old)), len(repr(new))) <= 40
            changed.append(f"{name} {old!r} then, {new!r} now" if small and name != "tokenizer" else f"other {name}")
            if name == "bos_id" and old is None:  # (made before documents began with it, or with --no-bos)
                changed[-1] += " (--no-bos prepares as then)"
    if manifest.get("content_sha256") != content_sha256:
        changed.append("other source text")
    return "; ".join([made, *changed[:3], *(["..."] if len(changed) > 3 else [])])


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def _version() -> str:
    return _package_version("scaletrain")


def _add_task(progress, description: str, total: int):
    return None if progress is None else progress.add_task(description, total=total)


def _advance(progress, task, amount: int) -> None:
    if progress is not None:
        progress.advance(task, amount)


def _finish_task(progress, task, total: int) -> None:
    # Totals are estimates (curation removes text); show every task as done.
    if progress is not None:
        progress.update(task, completed=total)
