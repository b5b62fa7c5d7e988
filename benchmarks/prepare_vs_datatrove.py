"""End-to-end `data prepare` against datatrove's filter + MinHash pipeline, on the same corpus, in one run.

Prints one JSON object. Issue 3's numbers: throughput of `scaletrain.data.prepare` (read,
normalise, filter, exact + MinHash dedup, train a tokenizer, tokenize, write shards) on a
corpus of at least 200 MB of real text from this machine, next to datatrove's equivalent
pipeline (JsonlReader -> GopherRepetitionFilter -> GopherQualityFilter -> C4QualityFilter,
then MinhashDedupSignature / Buckets / Cluster / Filter with 14 buckets x 8 hashes over
word 5-grams), and the near-duplicate recall of both on planted copies.

The corpus (built once, then reused from --cache-dir): prose first, up to half the size
(every text file under /usr/share/doc, .gz ones decompressed, and the .txt/.md/.rst files of
the standard library and the site-packages of this interpreter and the venv, in a seeded
random order), then Python sources (the standard library, then the venv's site-packages,
then the interpreter's) until --corpus-mb is reached; files identical to one read before,
binary, not UTF-8, empty or over 2 MB are skipped. Documents are shuffled and written as
JSONL shards ({"text", "id", "path"}, one document per file), so both pipelines read the same
bytes. prepare curates a record by its "path" (code rules for source files, prose rules for
the rest); datatrove's filters are prose filters and see every document as prose.

Planted in it: near copies of --near originals (--edit-rate of their words substituted,
deleted or followed by an inserted word, each at a random position) and byte-identical
copies of --exact other originals (fewer when distinct originals run out: at the default
200 MB the pool gives 1,059, so 1,000 near and 59 exact), each copy placed at a random
position after its original. Originals are prose documents (100 to 5,000 words, at least
5 lines ending in terminal punctuation, so that most pass both pipelines' prose filters)
whose word 5-gram Jaccard similarity with every other document of the corpus is below
0.3: truly distinct.

Per pipeline, over the planted pairs whose original and copy both got past the filters:
    recall  pairs of which at least one member was removed as a duplicate
    fpr     pairs of which both members were removed as duplicates (one removal too many:
            the original has no other duplicate), over the same pairs
prepare keeps the first document of a duplicate group, and the original always comes
first; datatrove keeps one document per cluster, by its file and position, so for it
removing the original instead of the copy is no error ("original_removed_copy_kept").

Then a second measurement, MinHash alone: the planted originals and copies alone, no
filters, through dedup.py's MinHasher + DedupIndex (what prepare runs per document) and
through datatrove's four MinHash stages; every pair reaches dedup there, so recall and
false positives are counted over all of them (curation shortens texts unevenly, which
spreads the Jaccard similarity of the surviving pairs and lowers end-to-end recall).

Wall time depends on what else the cores run; cpu_s (this process and its waited-for
children: prepare's pool, datatrove's forked workers) is the steadier comparison.

prepare runs in this process (workers=2, keep_rejects=True: its rejects say which
documents were removed why; writing them is included in its time), its passes timed
through the progress object it reports to. datatrove runs in its own virtual environment
(--dt-python; `python3 -m venv /tmp/dt-venv && /tmp/dt-venv/bin/pip install datatrove
spacy orjson regex tokenizers "xxhash<4"`: datatrove's English word tokenizer is spaCy's
blank "en", which needs no download, so no filter needs nltk data; tokenizers is only
imported by datatrove.pipeline.dedup), as a subprocess running the driver below.
datatrove does not tokenize: compare its time with prepare's time to the end of curation
(reading + curation + dedup) as well as with prepare's whole time.

    .venv/bin/python benchmarks/prepare_vs_datatrove.py [--corpus-mb 200] [--skip-datatrove]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import importlib
import json
import os
import platform
import random
import re
import resource
import shutil
import subprocess
import sysconfig
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from planted import edit  # benchmarks/planted.py, beside this script
from scaletrain.data.prepare import prepare

# The module itself: the package's attribute `prepare` is the function.
prepare_module = importlib.import_module("scaletrain.data.prepare")

MAX_DOC_BYTES = 2 << 20
DISTINCT_BELOW = 0.3  # max word 5-gram Jaccard of an original with any other document
WORD = re.compile(r"\w+")
TERMINAL_LINE = re.compile(r"^.*\w.*[.!?]['\"]?[ \t]*$", re.MULTILINE)
DUP_REASONS = ("exact_duplicate", "near_duplicate")
CORPUS_VERSION = 1  # bump when the corpus recipe changes, so caches are rebuilt


# -- the corpus -------------------------------------------------------------------------------

def _roots() -> dict[str, Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {"stdlib": stdlib, "venv_site": Path(sysconfig.get_paths()["purelib"]),
            "python_site": stdlib / "site-packages"}


def prose_paths() -> list[tuple[str, Path]]:
    roots = _roots()
    found = [("usr_share_doc", Path(p)) for p in glob.glob("/usr/share/doc/**/*", recursive=True)]
    for family, root in (("stdlib_docs", roots["stdlib"]), ("venv_site_docs", roots["venv_site"]),
                         ("python_site_docs", roots["python_site"])):
        for ext in ("txt", "md", "rst"):
            for p in glob.glob(f"{root}/**/*.{ext}", recursive=True):
                if family == "stdlib_docs" and "site-packages" in Path(p).relative_to(root).parts:
                    continue
                found.append((family, Path(p)))
    unique = sorted({(family, p) for family, p in found if p.is_file() and not p.is_symlink()},
                    key=lambda item: str(item[1]))
    return unique


def code_paths() -> list[tuple[str, Path]]:
    roots = _roots()
    stdlib = sorted(p for p in roots["stdlib"].rglob("*.py")
                    if "site-packages" not in p.relative_to(roots["stdlib"]).parts)
    out = [("stdlib_py", p) for p in stdlib]
    out += [("venv_site_py", p) for p in sorted(roots["venv_site"].rglob("*.py"))]
    if roots["python_site"].resolve() != roots["venv_site"].resolve():
        out += [("python_site_py", p) for p in sorted(roots["python_site"].rglob("*.py"))]
    return [(f, p) for f, p in out if p.is_file() and not p.is_symlink()]


def read_text(path: Path) -> str | None:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read(MAX_DOC_BYTES + 1)
        else:
            if path.stat().st_size > MAX_DOC_BYTES:
                return None
            raw = path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if len(raw) > MAX_DOC_BYTES or b"\0" in raw[:8192]:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def gather(target_bytes: int, rng: random.Random) -> list[dict]:
    """Documents [{text, path, family, kind}]: prose up to half of target_bytes, then code up to target_bytes."""
    seen: set[bytes] = set()
    docs, total = [], 0
    prose = prose_paths()
    rng.shuffle(prose)
    for kind, paths, limit in (("prose", prose, target_bytes // 2), ("code", code_paths(), target_bytes)):
        for family, path in paths:
            if total >= limit:
                break
            text = read_text(path)
            if text is None:
                continue
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if digest in seen:
                continue
            seen.add(digest)
            docs.append({"text": text, "path": str(path), "family": family, "kind": kind})
            total += len(text.encode())
    return docs


def shingles(text: str) -> np.ndarray:
    """Unique word 5-gram hashes of text (lowercased \\w+ words; texts under 5 words give one gram)."""
    words = WORD.findall(text.lower())
    if not words:
        return np.zeros(0, dtype=np.uint64)
    h = np.array([hash(w) for w in words], dtype=np.int64).view(np.uint64)
    n = min(5, len(h))
    grams = np.zeros(len(h) - n + 1, dtype=np.uint64)
    for k in range(n):
        grams = grams * np.uint64(0x9E3779B97F4A7C15) + h[k:len(h) - n + 1 + k]
    return np.unique(grams)


def looks_like_prose(text: str) -> bool:
    words = len(WORD.findall(text))
    return 100 <= words <= 5000 and len(TERMINAL_LINE.findall(text)) >= 5


def distinct_originals(docs: list[dict], pool: list[int], wanted: int) -> list[int]:
    """Up to `wanted` indices of pool (in pool order) whose 5-gram Jaccard with every other document is below
    DISTINCT_BELOW, computed exactly against the whole corpus."""
    sets = {i: shingles(docs[i]["text"]) for i in pool}
    sets = {i: s for i, s in sets.items() if len(s)}
    order = list(sets)
    keys = np.concatenate([sets[i] for i in order])
    owner = np.concatenate([np.full(len(sets[i]), j, dtype=np.int64) for j, i in enumerate(order)])
    sort = np.argsort(keys, kind="stable")
    keys, owner = keys[sort], owner[sort]
    sizes = np.array([len(sets[i]) for i in order])
    worst = np.zeros(len(order))
    position = {i: j for j, i in enumerate(order)}
    for d, doc in enumerate(docs):
        s = sets.get(d) if d in sets else shingles(doc["text"])
        if not len(s):
            continue
        left, right = np.searchsorted(keys, s, "left"), np.searchsorted(keys, s, "right")
        lengths = right - left
        if not lengths.any():
            continue
        # owner[left[k]:right[k]] for every shingle k, gathered without a Python loop
        starts = np.repeat(left - np.cumsum(lengths) + lengths, lengths)
        owners = owner[starts + np.arange(lengths.sum())]
        counts = np.bincount(owners, minlength=len(order))
        if d in position:
            counts[position[d]] = 0
        touched = np.nonzero(counts)[0]
        jaccard = counts[touched] / (sizes[touched] + len(s) - counts[touched])
        worst[touched] = np.maximum(worst[touched], jaccard)
    keep = [i for j, i in enumerate(order) if worst[j] < DISTINCT_BELOW]
    return keep[:wanted]


def text_key(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def build_corpus(root: Path, corpus_mb: int, near: int, exact: int, edit_rate: float, seed: int,
                 shards: int) -> dict:
    """Write root/shards/*.jsonl and root/meta.json; return the meta."""
    start = time.perf_counter()
    rng = random.Random(seed)
    docs = gather(corpus_mb * 10**6, rng)
    natural = len(docs)
    pool = [i for i, d in enumerate(docs) if d["kind"] == "prose" and looks_like_prose(d["text"])]
    rng.shuffle(pool)
    originals = distinct_originals(docs, pool[:2 * (near + exact) + 500], near + exact)
    vocabulary = sorted({w for i in originals for w in WORD.findall(docs[i]["text"]) if w.isalpha()})
    order = list(range(natural))
    rng.shuffle(order)
    place = {d: float(p) for p, d in enumerate(order)}  # sort key of each document: its place in the stream
    planted = []
    for n, i in enumerate(originals):
        kind = "near" if n < near else "exact"
        text = edit(docs[i]["text"], edit_rate, vocabulary, rng) if kind == "near" else docs[i]["text"]
        docs.append({"text": text, "path": docs[i]["path"], "family": docs[i]["family"], "kind": "planted"})
        place[len(docs) - 1] = rng.uniform(place[i] + 0.5, natural)
        planted.append({"kind": kind, "original": i, "copy": len(docs) - 1})
    stream = sorted(range(len(docs)), key=place.__getitem__)
    ids = {d: f"doc{rank:07d}" for rank, d in enumerate(stream)}
    shard_dir = root / "shards"
    if shard_dir.exists():
        shutil.rmtree(shard_dir)
    shard_dir.mkdir(parents=True)
    total = sum(len(docs[d]["text"].encode()) for d in stream)
    per_shard, written, number = total / shards, 0, 0
    out = open(shard_dir / f"{number:05d}.jsonl", "w")
    for d in stream:
        if written >= per_shard * (number + 1) and number < shards - 1:
            out.close()
            number += 1
            out = open(shard_dir / f"{number:05d}.jsonl", "w")
        out.write(json.dumps({"text": docs[d]["text"], "id": ids[d], "path": docs[d]["path"]}) + "\n")
        written += len(docs[d]["text"].encode())
    out.close()
    families = Counter()
    family_docs = Counter()
    for d in docs:
        families[d["family"]] += len(d["text"].encode())
        family_docs[d["family"]] += 1
    meta = {
        "version": CORPUS_VERSION, "corpus_mb": corpus_mb, "seed": seed, "edit_rate": edit_rate,
        "documents": len(docs), "text_bytes": total,
        "jsonl_bytes": sum(p.stat().st_size for p in shard_dir.glob("*.jsonl")),
        "shards": shards,
        "composition_mb": {f: round(b / 1e6, 1) for f, b in families.most_common()},
        "composition_docs": dict(family_docs.most_common()),
        "prose_pool": len(pool),
        "planted": [{"kind": p["kind"], "original": ids[p["original"]], "copy": ids[p["copy"]],
                     "text_key_original": text_key(docs[p["original"]]["text"]),
                     "text_key_copy": text_key(docs[p["copy"]]["text"]),
                     "path": docs[p["original"]]["path"]} for p in planted],
        "build_s": round(time.perf_counter() - start, 1),
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return meta


def corpus(args) -> tuple[Path, dict]:
    name = f"v2-{args.corpus_mb}mb-seed{args.seed}-near{args.near}-exact{args.exact}-edit{args.edit_rate}"
    root = Path(args.cache_dir) / name
    try:
        meta = json.loads((root / "meta.json").read_text())
        if meta["version"] == CORPUS_VERSION and len(list((root / "shards").glob("*.jsonl"))) == meta["shards"]:
            meta["reused"] = True
            return root, meta
    except (OSError, ValueError, KeyError):
        pass
    root.mkdir(parents=True, exist_ok=True)
    meta = build_corpus(root, args.corpus_mb, args.near, args.exact, args.edit_rate, args.seed, args.shards)
    meta["reused"] = False
    return root, meta


# -- ours ----------------------------------------------------------------------------------------

class StageClock:
    """Duck-typed rich Progress: records when each of prepare's passes starts and is marked finished."""

    def __init__(self):
        self.tasks: list[dict] = []

    def add_task(self, description: str, total: int = 0):
        self.tasks.append({"name": description, "start": time.perf_counter(), "end": None})
        return len(self.tasks) - 1

    def advance(self, task, amount) -> None:
        pass

    def update(self, task, completed=None) -> None:
        self.tasks[task]["end"] = time.perf_counter()


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_ours(root: Path, meta: dict, work: Path, args) -> dict:
    out = work / "ours"
    shutil.rmtree(out, ignore_errors=True)
    clock = StageClock()
    cpu0, start = cpu_seconds(), time.perf_counter()
    result = prepare([str(root / "shards")], out, args.vocab_size, workers=args.workers, keep_rejects=True,
                     progress=clock)
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    assert not result.reused
    stages = {t["name"]: round(t["end"] - t["start"], 2) for t in clock.tasks}
    curated_at = next(t["end"] for t in clock.tasks if t["name"] == "curating")
    to_curated = curated_at - start
    mb = meta["text_bytes"] / 1e6
    dropped = result.stats["documents"]["dropped"]
    by_stage = Counter()
    for reason, n in dropped.items():
        if n:
            by_stage[reason.split(":")[0]] += n

    # Status of every planted document, from the rejects (raw texts, by reason).
    rejected: dict[str, list[str]] = defaultdict(list)
    for path in (out / "rejects").glob("*/*.jsonl"):
        reason = path.parent.name
        with open(path) as f:
            for line in f:
                rejected[text_key(json.loads(line)["text"])].append(reason)
    status = {}
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    order = lambda doc_id: int(doc_id[3:])  # noqa: E731
    for p in meta["planted"]:
        groups[p["text_key_original"]].append((order(p["original"]), p["original"]))
        groups[p["text_key_copy"]].append((order(p["copy"]), p["copy"]))
    for key, members in groups.items():
        members = [m for _, m in sorted(set(members))]
        reasons = rejected.get(key, [])
        filters = [r for r in reasons if r not in (*DUP_REASONS, "val_overlap")]
        if filters:
            for m in members:
                status[m] = "filtered:" + filters[0]
            continue
        dups = sum(r in DUP_REASONS for r in reasons)
        for j, m in enumerate(members):  # prepare keeps the first of a group: the later ones are the duplicates
            status[m] = "duplicate" if j >= len(members) - dups else "kept"
        if "val_overlap" in reasons:
            status[members[0]] = "val_overlap"
    return {
        "seconds": round(seconds, 1), "mb_per_s": round(mb / seconds, 2), "cpu_s": round(cpu, 1),
        "stages_s": stages,
        "seconds_to_end_of_curation": round(to_curated, 1),
        "mb_per_s_to_end_of_curation": round(mb / to_curated, 2),
        "docs_in": result.stats["documents"]["read"], "docs_kept": result.stats["documents"]["kept"],
        "mb_kept": round(result.stats["bytes"]["kept"] / 1e6, 1),
        "tokens": result.stats["tokens"],
        "dropped_by_stage": dict(by_stage.most_common()),
        "dropped_top_reasons": dict(Counter({r: n for r, n in dropped.items() if n}).most_common(8)),
        **planted_metrics(meta, status),
    }


# -- datatrove -----------------------------------------------------------------------------------

DRIVER = r'''
import json, os, sys, time
from importlib.metadata import version
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

def main():
    src, work, tasks, workers, mode, order = sys.argv[1:7]
    tasks, workers = int(tasks), int(workers)
    config = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
    # fork, not datatrove's default forkserver: the workers are then this process's children,
    # and their CPU time reaches the benchmark's rusage.
    run = dict(workers=workers, start_method="fork")
    if mode == "full":  # the filters, then their survivors written for the last stage to read again
        filters = [GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter()]  # FineWeb's order
        if order == "quality-first":
            filters[:2] = filters[1::-1]
        first = [JsonlReader(src, glob_pattern="*.jsonl", compression=None), *filters,
                 JsonlWriter(f"{work}/filtered", compression=None)]
        last_input = f"{work}/filtered"
    else:  # "dedup": MinHash alone, over the input as it is
        first = [JsonlReader(src, glob_pattern="*.jsonl", compression=None)]
        last_input = src
    stages = {
        "read_filter_signature" if mode == "full" else "read_signature": LocalPipelineExecutor(
            first + [MinhashDedupSignature(output_folder=f"{work}/signatures", config=config)],
            tasks=tasks, logging_dir=f"{work}/logs/1", **run),
        "buckets": LocalPipelineExecutor([
            MinhashDedupBuckets(input_folder=f"{work}/signatures", output_folder=f"{work}/buckets", config=config),
        ], tasks=config.num_buckets, logging_dir=f"{work}/logs/2", **run),
        "cluster": LocalPipelineExecutor([
            MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove_ids", config=config),
        ], tasks=1, logging_dir=f"{work}/logs/3", **{**run, "workers": 1}),
        "dedup_filter_write": LocalPipelineExecutor([
            JsonlReader(last_input, glob_pattern="*.jsonl", compression=None),
            MinhashDedupFilter(input_folder=f"{work}/remove_ids",
                               exclusion_writer=JsonlWriter(f"{work}/removed", compression=None)),
            JsonlWriter(f"{work}/output", compression=None),
        ], tasks=tasks, logging_dir=f"{work}/logs/4", **run),
    }
    seconds = {}
    for name, executor in stages.items():
        if name == "dedup_filter_write" and mode == "full":
            # A task whose documents were all filtered out writes no file; an empty one keeps
            # file i with task i (and keeps a tiny corpus from failing with "No files found").
            os.makedirs(f"{work}/filtered", exist_ok=True)
            for rank in range(tasks):
                open(f"{work}/filtered/{rank:05d}.jsonl", "a").close()
        start = time.perf_counter()
        executor.run()
        seconds[name] = round(time.perf_counter() - start, 2)
    print(json.dumps({"stages_s": seconds, "versions": {p: version(p) for p in ("datatrove", "spacy", "numpy")},
                      "python": sys.version.split()[0]}))

if __name__ == "__main__":
    main()
'''


def read_ids(folder: Path) -> list[str]:
    ids = []
    for path in sorted(folder.glob("**/*.jsonl")):
        with open(path) as f:
            ids += [json.loads(line)["id"] for line in f if line.strip()]
    return ids


def step_stats(logs: Path) -> dict:
    """Documents dropped by each filter of stage 1, from datatrove's own stats.json."""
    try:
        steps = json.loads((logs / "stats.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for step in steps:
        stats = step.get("stats", {})
        counts = {k: (v["total"] if isinstance(v, dict) else v) for k, v in stats.items()
                  if k in ("total", "dropped", "forwarded") or k.startswith("dropped_")}
        if counts:
            out[step.get("name", "?")] = counts
    return out


def drive_datatrove(src: Path, dt_work: Path, mode: str, args) -> tuple[dict, float, float]:
    """Run the driver on src in mode "full" or "dedup"; return (its report, wall seconds, CPU seconds)."""
    shutil.rmtree(dt_work, ignore_errors=True)
    dt_work.mkdir(parents=True)
    driver = dt_work / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    cpu0, start = cpu_seconds(), time.perf_counter()
    with open(dt_work / "datatrove.log", "w") as log:
        proc = subprocess.run([args.dt_python, str(driver), str(src), str(dt_work), str(args.workers),
                               str(args.workers), mode, args.dt_filter_order],
                              stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    if proc.returncode != 0:
        tail = (dt_work / "datatrove.log").read_text()[-3000:]
        raise RuntimeError(f"datatrove driver ({mode}) exited with {proc.returncode}:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), seconds, cpu


def datatrove_status(dt_work: Path, planted: list[dict]) -> tuple[dict, set, set]:
    kept = set(read_ids(dt_work / "output"))
    removed = set(read_ids(dt_work / "removed"))
    status = {}
    for p in planted:
        for doc_id in (p["original"], p["copy"]):
            status[doc_id] = "kept" if doc_id in kept else "duplicate" if doc_id in removed else "filtered"
    return status, kept, removed


def run_datatrove(root: Path, meta: dict, work: Path, args) -> dict:
    dt_work = work / "datatrove"
    try:
        report, seconds, cpu = drive_datatrove(root / "shards", dt_work, "full", args)
    except RuntimeError as e:
        return {"error": str(e)}
    status, kept, removed = datatrove_status(dt_work, meta["planted"])
    mb = meta["text_bytes"] / 1e6
    return {
        "seconds": round(seconds, 1), "mb_per_s": round(mb / seconds, 2), "cpu_s": round(cpu, 1),
        "stages_s": report["stages_s"],
        "docs_in": meta["documents"], "docs_kept": len(kept),
        "docs_removed_as_duplicates": len(removed),
        "filter_steps": step_stats(dt_work / "logs" / "1"),
        "versions": report["versions"], "python": report["python"],
        **planted_metrics(meta, status),
    }


def planted_subset(root: Path, meta: dict, folder: Path, shards: int) -> list[tuple[str, str]]:
    """Write the planted originals and copies alone, in corpus order, as `shards` JSONL files; return (id, text)."""
    wanted = {p[m] for p in meta["planted"] for m in ("original", "copy")}
    docs = []
    for path in sorted((root / "shards").glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record["id"] in wanted:
                    docs.append((record["id"], record["text"]))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    per = -(-len(docs) // shards)
    for n in range(shards):
        with open(folder / f"{n:05d}.jsonl", "w") as f:
            for doc_id, text in docs[n * per:(n + 1) * per]:
                f.write(json.dumps({"text": text, "id": doc_id}) + "\n")
    return docs


def run_dedup_only(root: Path, meta: dict, work: Path, args) -> dict:
    """Recall of the MinHash stages alone, no filters, on the planted pairs alone (every pair reaches dedup)."""
    subset = work / "planted_subset"
    docs = planted_subset(root, meta, subset, args.workers)
    mb = sum(len(t.encode()) for _, t in docs) / 1e6
    out = {"documents": len(docs), "mb": round(mb, 1)}
    # ours: what prepare does per document after curation (exact key, signature, index), one process
    from scaletrain.data.dedup import DedupIndex, MinHasher, exact_key
    hasher, index = MinHasher(14, 8, 5), DedupIndex(14, 8)
    status = {}
    start = time.perf_counter()
    for doc_id, text in docs:
        reason = index.add(exact_key(text), hasher.signature(text))
        status[doc_id] = "kept" if reason is None else "duplicate"
    seconds = time.perf_counter() - start
    out["ours"] = {"seconds": round(seconds, 2), "mb_per_s_one_process": round(mb / seconds, 2),
                   **planted_metrics(meta, status, brief=True)}
    if not args.skip_datatrove and Path(args.dt_python).exists():
        dt_work = work / "datatrove_dedup"
        try:
            report, seconds, cpu = drive_datatrove(subset, dt_work, "dedup", args)
        except RuntimeError as e:
            out["datatrove"] = {"error": str(e)}
        else:
            status, _, _ = datatrove_status(dt_work, meta["planted"])
            out["datatrove"] = {"seconds": round(seconds, 1), "cpu_s": round(cpu, 1), "stages_s": report["stages_s"],
                                **planted_metrics(meta, status, brief=True)}
    return out


# -- metrics -------------------------------------------------------------------------------------

def planted_metrics(meta: dict, status: dict[str, str], brief: bool = False) -> dict:
    out = {}
    for kind in ("near", "exact"):
        pairs = [p for p in meta["planted"] if p["kind"] == kind]
        reached = [p for p in pairs if not status[p["original"]].startswith("filtered")
                   and not status[p["copy"]].startswith("filtered")]
        removed = [sum(status[p[m]] == "duplicate" for m in ("original", "copy")) for p in reached]
        detected = sum(r >= 1 for r in removed)
        both = sum(r == 2 for r in removed)
        out[kind] = {
            "planted": len(pairs), "reached_dedup": len(reached),
            "recall": round(detected / len(reached), 4) if reached else None,
            "missed": len(reached) - detected,
            "both_removed": both,
            "original_removed_copy_kept": sum(status[p["original"]] == "duplicate" and status[p["copy"]] != "duplicate"
                                              for p in reached),
        }
    reached_all = out["near"]["reached_dedup"] + out["exact"]["reached_dedup"]
    both_all = out["near"]["both_removed"] + out["exact"]["both_removed"]
    summary = {"recall": out["near"]["recall"], "exact_recall": out["exact"]["recall"],
               "fpr": round(both_all / reached_all, 5) if reached_all else None,
               "false_positives": both_all, "pairs_reached_dedup": reached_all}
    if brief:
        return {**summary, "missed": out["near"]["missed"] + out["exact"]["missed"]}
    return {**summary, "planted": out,
            "planted_status": dict(Counter(s.split(":")[0] for s in status.values()))}


# -- main ----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-mb", type=int, default=200)
    parser.add_argument("--cache-dir", default="/tmp/st-bench-corpus")
    parser.add_argument("--work-dir", default=None, help="where both pipelines write (default: a temporary directory)")
    parser.add_argument("--dt-python", default="/tmp/dt-venv/bin/python")
    parser.add_argument("--near", type=int, default=1000)
    parser.add_argument("--exact", type=int, default=300)
    parser.add_argument("--edit-rate", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--skip-datatrove", action="store_true")
    parser.add_argument("--dt-filter-order", choices=("fineweb", "quality-first"), default="fineweb",
                        help="datatrove's filters as FineWeb orders them (repetition, quality, C4), or with the "
                             "cheaper quality filter first, as prepare orders its stages")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--skip-dedup-only", action="store_true",
                        help="skip the second measurement: MinHash alone on the planted pairs alone")
    args = parser.parse_args()

    root, meta = corpus(args)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="st-bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "prepare_vs_datatrove",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "corpus": {"dir": str(root), "reused": meta["reused"], "mb": round(meta["text_bytes"] / 1e6, 1),
                   "jsonl_mb": round(meta["jsonl_bytes"] / 1e6, 1), "documents": meta["documents"],
                   "shards": meta["shards"], "composition_mb": meta["composition_mb"],
                   "composition_docs": meta["composition_docs"], "build_s": meta["build_s"],
                   "planted": {"near": sum(p["kind"] == "near" for p in meta["planted"]),
                               "exact": sum(p["kind"] == "exact" for p in meta["planted"]),
                               "edit_rate": meta["edit_rate"], "originals_from_prose_pool": meta["prose_pool"]}},
        "settings": {"workers": args.workers, "vocab_size": args.vocab_size, "minhash": [14, 8, 5],
                     "ours": "prepare(filters='default', dedup=True, keep_rejects=True)",
                     "datatrove": ("GopherRepetition -> GopherQuality" if args.dt_filter_order == "fineweb" else
                                   "GopherQuality -> GopherRepetition") + " -> C4Quality -> JsonlWriter -> MinHash "
                                  "signature / buckets (14 tasks) / cluster / filter -> JsonlWriter, uncompressed"},
    }
    if not args.skip_ours:
        report["ours"] = run_ours(root, meta, work, args)
    if not args.skip_datatrove:
        if not Path(args.dt_python).exists():
            report["datatrove"] = {"error": f"{args.dt_python} not found; see this script's docstring"}
        else:
            report["datatrove"] = run_datatrove(root, meta, work, args)
    if not args.skip_dedup_only:
        report["dedup_only_on_planted_pairs"] = run_dedup_only(root, meta, work, args)
    ours, dt = report.get("ours"), report.get("datatrove")
    if ours and dt and "error" not in dt:
        report["throughput_ratio_ours_over_datatrove"] = round(ours["mb_per_s"] / dt["mb_per_s"], 2)
        report["throughput_ratio_to_end_of_curation"] = round(ours["mb_per_s_to_end_of_curation"] / dt["mb_per_s"], 2)
        # CPU seconds per MB: steadier than wall time when the cores are shared with other work
        report["cpu_ratio_datatrove_over_ours"] = round(dt["cpu_s"] / ours["cpu_s"], 2)
    report["versions"] = {"python": platform.python_version(), "scaletrain": prepare_module._version(),
                          "prepare_version": prepare_module.PREPARE_VERSION,
                          "datatrove": (dt or {}).get("versions", {}).get("datatrove"),
                          "datatrove_python": (dt or {}).get("python")}
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
