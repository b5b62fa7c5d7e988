"""The `scaletrain` command: parses arguments, calls the library, prints tables and progress."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.logging import RichHandler
from rich.table import Table

from scaletrain import torchrun
from scaletrain.errors import Stopped, UserError
from scaletrain.hangup import Console
from scaletrain.outputs import WRITTEN_BY, check_output_dir, check_output_file, check_written_config, plot_suffixes

# Piped output (CI logs, files) gets wide lines instead of Rich's 80-column default.
# (a reader gone, a broken pipe, is a hang-up: a run stops on it with a checkpoint; hangup.py)
console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
out = Console(width=None if sys.stdout.isatty() else 160)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=console, show_path=False, markup=False)], force=True)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def _bytes(text: str) -> int:
    """'12000000', '12M', '1.5G' -> bytes."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    text = text.strip().lower().removesuffix("b")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 12000000, 12M, 1.5G)") from None


class _Version(argparse.Action):
    """--version, looked up only when asked (reading the packages' metadata takes ~0.1 s)."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(_versions() + "\n")
        parser.exit()


def _versions() -> str:
    """scaletrain's version and those of what it runs on (for a bug report, a benchmark's record)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return (f"scaletrain {of('scaletrain')} (torch {of('torch')}, Python {sys.version.split()[0]}, "
            f"{sys.platform})")


# -- data prepare ---------------------------------------------------------------------------


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from scaletrain.data import prepare
    from scaletrain.data.prepare import DEFAULT_CHUNK_BYTES

    if args.tokenizer is not None and args.vocab_size is not None:
        raise UserError("--vocab-size sizes the tokenizer that prepare trains; with --tokenizer the given one's "
                        "vocabulary is used: drop one of them")
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        result = prepare(args.sources, args.out, 8192 if args.vocab_size is None else args.vocab_size, max_bytes=args.max_bytes,
                         text_field=args.text_field, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                         seed=args.seed, workers=args.workers, progress=progress, filters=args.filters,
                         dedup=not args.no_dedup, minhash=(args.minhash_bands, args.minhash_rows, args.minhash_ngram),
                         decontaminate=args.decontaminate, keep_rejects=args.keep_rejects,
                         chunk_bytes=DEFAULT_CHUNK_BYTES if args.chunk_bytes is None else args.chunk_bytes, kind=args.kind,
                         val_overlap=not args.no_val_overlap, overwrite=args.overwrite, split=args.split,
                         tokenizer_sample=args.tokenizer_sample, bos=not args.no_bos, fim_rate=args.fim_rate,
                         fim_spm_rate=args.fim_spm_rate)
    if result.resumed_chunks:
        console.print(f"resumed an interrupted prepare: {result.resumed_chunks} chunks were already curated")
    table = _data_table(result)
    stats = result.stats
    docs = stats["documents"]
    table.add_row("documents kept / read", f"{docs['kept']:,} / {docs['read']:,}")
    for reason, count in sorted(docs.get("dropped", {}).items(), key=lambda kv: -kv[1]):
        if count:
            table.add_row(f"  dropped: {reason}", f"{count:,}")
    table.add_row("bytes read", f"{stats['bytes']['read']:,}")
    # (after curation: a kept document's lines that the filters removed are not counted)
    table.add_row("bytes kept (after curation)", f"{stats['bytes'].get('curated', stats['bytes']['kept']):,}")
    _token_rows(table, stats)
    if "fim" in stats:
        table.add_row("fill-in-the-middle documents", f"{stats['fim']['documents']:,}")
    return _print_data_table(table, start)


def _data_table(result) -> Table:
    """data prepare's or import's result: its warnings said, and the table of what it wrote begun."""
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    table = Table(title=f"data: {result.out}" + (" (reused: sources and options unchanged)" if result.reused else ""))
    table.add_column("")
    table.add_column("value", justify="right")
    return table


def _print_data_table(table: Table, start: float) -> int:
    """The table ended with the seconds since `start`, printed; the command's status."""
    table.add_row("seconds", f"{time.perf_counter() - start:.1f}")
    out.print(table)
    return 0


def _token_rows(table: Table, stats: dict) -> None:
    table.add_row("train tokens", f"{stats['tokens']['train']:,}")
    table.add_row("validation tokens", f"{stats['tokens']['val']:,}")
    table.add_row("vocabulary", f"{stats['vocab_size']:,}")


def cmd_data_import(args: argparse.Namespace) -> int:
    from scaletrain.data.importer import import_tokens

    start = time.perf_counter()
    result = import_tokens(args.sources, args.out, args.tokenizer, fmt=args.format, dtype=args.dtype, eos=args.eos_id,
                           val_fraction=args.val_fraction, seed=args.seed, overwrite=args.overwrite,
                           column=args.column)
    table = _data_table(result)
    stats = result.stats
    for source in stats["imported"]:
        table.add_row(f"{source['format']} ({source['dtype']}): {source['path']}", f"{source['documents']:,} documents")
    table.add_row("documents kept / read", f"{stats['documents']['kept']:,} / {stats['documents']['read']:,}")
    _token_rows(table, stats)
    if "bos_id" in stats:
        table.add_row("documents begin with", f"beginning-of-sequence id {stats['bos_id']}")
    return _print_data_table(table, start)


def cmd_data_stats(args: argparse.Namespace) -> int:
    from scaletrain.data.stats import describe, plot_lengths

    plot = args.plot
    if plot is not None:
        check_output_file(plot, "--plot")
        plot += "" if os.path.splitext(plot)[1] else ".png"  # (as Matplotlib names it)
        check_output_file(plot, "--plot", plot_suffixes())
    summary = describe(args.data_dir, top=args.top)
    table = Table(title=f"data: {summary['data_dir']}")
    table.add_column("")
    table.add_column("value", justify="right")
    for split, documents in summary["documents"].items():
        table.add_row(f"{split}: documents / tokens", f"{documents:,} / {summary['tokens'][split]:,}")
    if summary["documents_read"]:
        table.add_row("documents read by prepare", f"{summary['documents_read']:,}")
        for reason, count in summary["dropped"].items():
            table.add_row(f"  removed: {reason}", f"{count:,} ({count / summary['documents_read']:.1%})")
        table.add_row("duplicate rate", f"{summary['duplicate_rate']:.2%}")
    table.add_row("mean document length (tokens)", f"{summary['mean_length']:,.0f}")
    for p, value in summary["length_percentiles"].items():
        table.add_row(f"  p{p}", f"{value:,}")
    out.print(table)
    tokens = Table(title=f"top {len(summary['top_tokens'])} tokens (training split)")
    for column in ("id", "token", "share"):
        tokens.add_column(column, justify="right" if column != "token" else "left")
    for entry in summary["top_tokens"]:
        tokens.add_row(str(entry["id"]), repr(entry["token"]), f"{entry['share']:.2%}")
    out.print(tokens)
    if not summary["documents"].get("train"):  # (every document held out or dropped: nothing to plot)
        out.print("document-length histogram: none, the training split holds no documents")
        return 0
    plot = plot_lengths(args.data_dir, plot or f"{args.data_dir.rstrip('/')}/lengths.png")
    out.print(f"document-length histogram: {plot}")
    return 0


# -- train ----------------------------------------------------------------------------------


def _deadline(args: argparse.Namespace) -> float | None:
    """When --time-limit runs out (unix seconds), counted from the command's start: the one given
    to the workers of `train --nproc` (--deadline), or the start of the torchrun that started this
    worker (launch's job files), not a restarted worker's own; None without a limit."""
    from scaletrain.torchrun import LAUNCHED
    from scaletrain.train.metrics import process_started

    if args.deadline is not None or args.time_limit is None:
        return args.deadline
    started = float(os.environ[LAUNCHED]) if os.environ.get(LAUNCHED) else process_started() or time.time()
    return started + args.time_limit


def cmd_train(args: argparse.Namespace) -> int:
    from scaletrain.config import load_config

    cfg = load_config(args.config, args.overrides)  # a bad config is refused before torch loads
    _check_train_options(args)
    if args.stop_at_step is not None and args.stop_at_step >= cfg.total_steps and "WORLD_SIZE" not in os.environ:
        console.print(f"[yellow]warning:[/] --stop-at-step {args.stop_at_step} is not before the run's last step "
                      f"({cfg.total_steps:,}): it trains to its end", highlight=False, soft_wrap=True)
    from scaletrain.train.metrics import process_started
    from scaletrain.train.trainer import TrainingDiverged, train

    deadline = _deadline(args)

    if (args.nproc > 1 or args.max_restarts) and "WORLD_SIZE" not in os.environ:  # (one process restarted too)
        from scaletrain.parallel.layout import check_layout, resolve_layout
        from scaletrain.train.trainer import check_run_dir, resolve

        resolved = resolve(cfg)  # a layout that cannot work is one line here, not N tracebacks there
        check_layout(resolve_layout(resolved.parallel, args.nproc), resolved)
        from scaletrain.train.init_from import init_source

        init_source(resolved)  # a model or checkpoint that does not fit the run, likewise
        check_run_dir(resolved, warn=False)  # and a run directory it cannot resume (another shape, data)
        return _torchrun(args, ["train", args.config, *args.overrides,
                                *([f"--stop-at-step={args.stop_at_step}"] if args.stop_at_step is not None else []),
                                *([f"--deadline={deadline}"] if deadline is not None else [])])
    try:
        result = train(cfg, stop_at_step=args.stop_at_step, launched=process_started(), deadline=deadline)
    except TrainingDiverged as e:
        console.print(f"[red]training diverged:[/] {e}", highlight=False, soft_wrap=True)
        return 1
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    table = Table(title=f"run: {result.run_dir}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("steps", f"{result.step:,} / {result.total_steps:,}")
    table.add_row("tokens seen", f"{result.tokens:,}")
    table.add_row("final train loss", _num(result.train_loss))
    table.add_row("final validation loss", _num(result.val_loss))
    table.add_row("tokens/s", f"{result.tokens_per_s:,.0f}" if result.tokens_per_s else "-")
    table.add_row("run directory", str(result.run_dir))
    out.print(table)
    if result.resumed_from == result.total_steps:
        out.print(f"{result.run_dir} had already finished; to train on, raise train.steps (or train.tokens) above "
                  f"{result.step:,}; to train again from the start, choose a new run.name")
    elif result.step < result.total_steps:
        out.print(f"stopped at step {result.step}; run the same command without --stop-at-step to continue")
    return 0


def _check_train_options(args: argparse.Namespace) -> None:
    """The options of train and cooldown that no config checks."""
    if args.stop_at_step is not None and args.stop_at_step < 1:
        raise UserError(f"--stop-at-step {args.stop_at_step} must be a step number ≥ 1")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts {args.max_restarts} must be ≥ 0")


def cmd_cooldown(args: argparse.Namespace) -> int:
    from scaletrain.cooldown import cooldown_config, mark_branch

    _check_train_options(args)  # (before the branch's files are written)
    cfg = cooldown_config(args.run_dir, args.step, args.steps, args.decay_shape, args.name, args.overrides)
    path = Path(cfg.run.dir) / f"{cfg.run.name}.toml"
    mark_branch(cfg, args.run_dir, args.step, args.steps)  # (for the run's report)
    path.write_text(cfg.to_toml())
    out.print(f"wrote {path}: {cfg.run_dir} decays from step {args.step:,} of {args.run_dir} over {args.steps:,} steps "
              f"({cfg.train.decay_shape}, to {cfg.train.min_lr_ratio:g} x train.lr); training it", highlight=False)
    return cmd_train(argparse.Namespace(config=str(path), overrides=[], stop_at_step=args.stop_at_step,
                                        max_restarts=args.max_restarts, nproc=args.nproc, verbose=args.verbose,
                                        time_limit=args.time_limit, deadline=None))


def _torchrun(args: argparse.Namespace, command_args: list[str]) -> int:
    """Run `args.nproc` processes of `scaletrain COMMAND_ARGS` on this node through torchrun, in
    this process (scaletrain/torchrun.py: a stop signal answered once, a worker's refusal said
    in one line instead of answered by restarts)."""
    code, refused = torchrun.run(["--standalone", f"--nproc-per-node={args.nproc}",
                                  f"--max-restarts={getattr(args, 'max_restarts', 0)}", "-m", "scaletrain.cli",
                                  *(["--verbose"] if args.verbose else []), *command_args])
    if refused is not None:
        _error(refused)
    return code


# The errors of a path that trying again will not mend (others, such as a full disk or a
# filesystem that went away, torchrun's restarts may outlast).
LASTING_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.EROFS}


def _refused(message: str, lasting: bool = True) -> int:
    """Say why a command refused its input, in one line. In a worker of scaletrain.torchrun, where
    the refusal is `lasting` (the same input would be refused again), hand the line to the process
    that runs torchrun instead (torchrun.hand_over: one of those refusing is said), which stops
    every worker: a failure would have torchrun start them all again."""
    if lasting and torchrun.hand_over(message):
        return 0
    _error(message)
    return 2


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


# -- launch -------------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace) -> int:
    from scaletrain.config import load_config
    from scaletrain.launch import k8s_manifest, slurm_script

    cfg = load_config(args.config, args.overrides)
    check_written_config(args.out, "--out", args.config, "launch",
                          ("sh", "sbatch", "slurm") if args.launcher == "slurm" else ("json", "yaml", "yml"))
    if (args.image is not None or args.volume is not None) and args.launcher == "slurm":
        raise UserError("--image and --volume describe the containers of a Kubernetes job; a Slurm script runs the "
                        "scaletrain installed on the nodes, in their shared filesystem: drop them, or write a k8s "
                        "manifest")
    train_options = [f"--time-limit={_duration_text(args.time_limit)}"] if args.time_limit is not None else []
    if args.launcher == "slurm":
        text = slurm_script(cfg, args.config, args.overrides, args.nodes, args.gpus_per_node, grace_s=args.grace,
                            max_restarts=args.max_restarts, train_options=train_options)
    else:
        image = "scaletrain:latest" if args.image is None else args.image
        text = k8s_manifest(cfg, args.config, args.overrides, args.nodes, args.gpus_per_node, image,
                            grace_s=args.grace, max_restarts=args.max_restarts, volume=args.volume,
                            train_options=train_options)
        if args.volume is None:
            console.print("[yellow]warning:[/] no --volume: the run's checkpoints are written in each pod's own "
                          "filesystem and are lost with it; give a PersistentVolumeClaim that holds the data and "
                          "runs/ (--volume CLAIM)", highlight=False, soft_wrap=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        console.print(f"wrote {args.out}: submit with "
                      + (f"sbatch {args.out}" if args.launcher == "slurm" else f"kubectl apply -f {args.out}"))
    else:
        sys.stdout.write(text)
    return 0


# -- plan -----------------------------------------------------------------------------------


def _hardware(args: argparse.Namespace):
    from scaletrain.plan.cost import Prices, Reliability
    from scaletrain.plan.hardware import device, device_from_dict
    from scaletrain.plan.planner import Hardware

    try:
        spec = device(args.gpu)
        if args.hardware:
            spec = device_from_dict(_json_file(args.hardware, "--hardware", "a JSON file describing the device"),
                                    base=spec)
        if args.inter_node_gbps is not None:
            spec = device_from_dict({"inter_node_gbs": args.inter_node_gbps / 8}, base=spec)
    except ValueError as e:
        raise UserError(str(e)) from None
    reliability = Reliability(failures_per_device_hour=args.failure_rate, restart_s=args.restart_minutes * 60,
                              async_save=not args.sync_checkpoints)
    prices = Prices(per_device_hour=args.price, pue=args.pue, watts=args.watts)
    return Hardware(spec, args.gpus, args.gpus_per_node or spec.gpus_per_node, reliability=reliability,
                    prices=prices)


def cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from scaletrain.config import load_config
    from scaletrain.plan.planner import Sizing, make_plan, model_for, plan_for_time, size, vocab_of
    from scaletrain.plan.search import MAX_BATCH_GROWTH
    from scaletrain.model.flops import param_counts, train_flops_per_token

    hardware = _hardware(args)
    modes = [args.config is not None, args.compute is not None, args.hours is not None, args.params is not None]
    if sum(modes) > 1:
        raise UserError("give one of a config FILE, --compute C, --hours H or --params N with --tokens D: they are "
                        "ways of saying what to plan, not settings of one plan")
    check_written_config(args.write_config, "--write-config", args.config, "plan")
    beside = Path(args.write_config).with_suffix(".plan.json") if args.write_config else None
    if beside is not None and beside.is_file() and not Path(args.write_config).is_file():
        # (beside plan's own config, check_written_config has checked it with the config)
        raise UserError(f"--write-config {args.write_config!r} writes its plan to {str(beside)!r}, which exists "
                        "without the config it was planned with; give another file name, or remove it")
    if sum(modes) != 1:
        raise UserError("say what to plan: a config FILE (a run as configured), --compute C or --hours H (a budget "
                        "of FLOPs or of wall-clock on the devices, sized by --law or --preset), or --params N with "
                        "--tokens D")
    sized = args.compute is not None or args.hours is not None
    if args.keep_layout and args.config is None:
        raise UserError("--keep-layout plans a config's own layout; give the config FILE")
    if (args.inference_tokens or args.unique_tokens) and not sized:
        raise UserError("--inference-tokens and --unique-tokens size the model for a budget; add --compute C or "
                        "--hours H")
    law_doc, law, boot = (_law_file(args.law) if args.law else (None, _chinchilla_preset(args.preset or "epoch"), [])) \
        if (sized or args.law or args.preset) else (None, None, [])
    if (args.params is None) != (args.tokens is None) and args.config is None:
        raise UserError("--params and --tokens go together: the model's parameter count and its training tokens")
    base, sizing = None, None
    if args.config is not None:
        base = load_config(args.config, args.overrides)
        model, seq_len, data_path = base.model, base.data.seq_len, base.data.path
        if model.vocab_size is None:
            vocab = args.vocab or vocab_of(data_path)
            if vocab is None:
                raise UserError(f"model.vocab_size is unset and {data_path!r} is not a prepared data directory to "
                                "take it from; set model.vocab_size or pass --vocab")
            base = load_config(args.config, [*args.overrides, f"model.vocab_size={vocab}"])
            model = base.model
        if not base.checkpoint.async_save:  # the config saves blocking: plan its checkpoints so
            hardware.reliability = dataclasses.replace(hardware.reliability, async_save=False)
        tokens = base.total_tokens  # (train.batch_ramp's included: the planner times its steps apart)
        batch = base.train.global_batch_tokens
    else:
        seq_len, data_path = args.seq_len, args.data or "data/corpus"
        vocab = args.vocab or (vocab_of(args.data) if args.data else 32768)
        if vocab is None:
            raise UserError(f"--data {args.data!r} is not a prepared data directory to take the vocabulary from; "
                            "prepare it first (scaletrain data prepare) or pass --vocab")
        batch = args.global_batch_tokens
        if args.compute is not None:
            model, tokens, sizing = size(law, args.compute, vocab, seq_len, args.inference_tokens or 0.0,
                                         args.unique_tokens, boot)
            n = param_counts(model)["total"]
            smallest = param_counts(model_for(1, vocab, seq_len))["total"] == n
            if tokens < n and args.unique_tokens and not smallest:  # (repeating the few tokens wants a huge model)
                raise UserError(f"--unique-tokens {args.unique_tokens:.3g} are too few for --compute {args.compute:.3g}: "
                                f"the data-constrained optimum is a model of {n:,} parameters on {tokens:,} tokens, "
                                "under one token per parameter; give more unique tokens or less compute")
            if tokens < n and not smallest:  # (a law whose N grows faster than C: a = 0.9 of a tiny sweep, say)
                raise UserError(f"--compute {args.compute:.3g}: the law sizes a model of {n:,} parameters on {tokens:,} "
                                f"tokens, under one token per parameter (its N_opt grows as C^{law.exponents[0]:.3g}): "
                                "too far from where it was measured to plan with; plan nearer its budgets, or with a law "
                                "fitted on larger ones")
            if tokens < n:  # (the law wants a model below the smallest shape: it would get under a token a parameter)
                enough = 20 * n * train_flops_per_token(model, seq_len)
                raise UserError(f"--compute {args.compute:.3g} FLOPs is too little for the smallest model the planner "
                                f"builds ({n:,} parameters at a vocabulary of {vocab:,}: {tokens:,} tokens, under one token per "
                                f"parameter); plan about {enough:.1g} FLOPs or more, or a smaller --vocab")
        elif args.params is not None:
            model, tokens = model_for(args.params, vocab, seq_len), int(args.tokens)
            n = param_counts(model)["total"]
            if not 2 / 3 <= n / args.params <= 1.5:  # (beyond the family's ends)
                console.print(f"[yellow]warning:[/] --params {args.params:.3g}: the nearest shape the planner builds has "
                              f"{n:,} parameters (at a vocabulary of {vocab:,}); planned with it", highlight=False,
                              soft_wrap=True)
    if law is not None and sizing is None:  # a given model: the law only predicts its loss
        sizing = Sizing("given", law=law, bootstrap=boot)
    # The written config's run is named after its file (runs/30b.toml trains runs/30b), not after
    # the planned config's run, whose checkpoints it would resume with the plan's other settings.
    name = args.name or (Path(args.write_config).stem if args.write_config else None)
    common = dict(data_path=data_path, name=name, top=args.top,
                  context_parallel={"auto": None, "yes": True, "no": False}[args.context_parallel])
    if args.hparams is not None:
        from scaletrain.hparams import load_law

        common["hyperparameters"] = load_law(args.hparams)
    if args.hours is not None:
        plan = plan_for_time(law, args.hours, hardware, vocab, seq_len, inference_tokens=args.inference_tokens or 0.0,
                             unique_tokens=args.unique_tokens, bootstrap=boot, batch_tokens=batch, **common)
    else:
        plan = make_plan(model, tokens, seq_len, hardware, batch_tokens=batch, base=base, sizing=sizing,
                         keep_layout=args.keep_layout, **common)
    if args.params is not None and tokens < plan["hyperparameters"]["global_batch_tokens"]:  # (whole steps)
        console.print(f"[yellow]warning:[/] --tokens {args.tokens:.3g} is less than one step's batch of "
                      f"{plan['hyperparameters']['global_batch_tokens']:,} tokens: planned as that one step",
                      highlight=False, soft_wrap=True)
    rule = plan["hyperparameters"].get("rule_batch_tokens")
    if rule and batch is None and plan["hyperparameters"]["global_batch_tokens"] > MAX_BATCH_GROWTH * rule:
        lay = plan["layout"]["layout"]
        ranks = lay["dp_replicate"] * lay["dp_shard"]
        console.print(f"[yellow]warning:[/] the batch is {plan['hyperparameters']['global_batch_tokens'] / rule:.3g}x the "
                      f"rule's {rule:,.0f} tokens: no layout of {hardware.count:,} devices keeps it within "
                      f"{MAX_BATCH_GROWTH:g}x (this one's {ranks:,} data-parallel ranks take a sequence each at least), and "
                      "a batch beyond the rule's takes more tokens to reach its loss; plan fewer devices or a larger "
                      "budget", highlight=False, soft_wrap=True)
    if law_doc is not None:
        plan["law_warnings"] = _law_warnings(law_doc, plan)
        for warning in plan["law_warnings"]:
            console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if args.write_config:
        import tomllib

        from scaletrain.config import validate_config

        interval = base.checkpoint.interval if base is not None else "auto"
        if interval != "auto" and "interval" in base.checkpoint.model_fields_set:
            run = plan["run"]
            every = (f"about every {run['checkpoint_interval_steps']:,} steps" if run["checkpoint_interval_steps"]
                     < run["steps"] else f"only at the end of the {run['steps']:,} steps")
            mine = f"every {interval:,} steps" if interval else "only at the end"
            console.print(f"[yellow]warning:[/] the written config saves at checkpoint.interval = \"auto\" (Daly's "
                          f"optimum: {every} at the predicted {run['step_s']:.3g} s a step on these devices and their "
                          f"failure rate), not {mine} as the config did; set a fixed interval again in the written file "
                          "where you want one (a rewind across a stop matches an uninterrupted run only with a fixed "
                          "interval)", highlight=False, soft_wrap=True)

        # The config names its plan (log.plan): the run checks its speed and memory against it early.
        plan_path = Path(args.write_config).with_suffix(".plan.json")
        config = tomllib.loads(plan["config"])
        config.setdefault("log", {})["plan"] = str(plan_path.resolve())  # (found from wherever the run starts)
        plan["config"] = validate_config(config, source="the planned config").to_toml()
        with open(args.write_config, "w") as f:
            f.write(f"{WRITTEN_BY['plan']}\n{plan['config']}")
        plan_path.write_text(json.dumps(plan, indent=1) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(plan, indent=1) + "\n")
        return 0
    for table in plan_tables(plan):
        out.print(table)
    if args.write_config:
        nodes = plan["hardware"]["nodes"]
        out.print(f"wrote {args.write_config}: train it with `scaletrain train {shlex.quote(args.write_config)} "
                  f"--nproc {hardware.count}`" if nodes == 1 else
                  f"wrote {args.write_config}: `scaletrain launch slurm {shlex.quote(args.write_config)} --nodes {nodes} "
                  f"--gpus-per-node {hardware.gpus_per_node}` (or `launch k8s ... --image IMAGE`) writes the job "
                  "for it")
    return 0


def _law_warnings(doc: dict, plan: dict) -> list[str]:
    """What to know before trusting a fitted law's sizes and loss for this plan: a run far beyond
    the runs the law was fitted to, and a vocabulary other than its data's (a loss is per token
    of a tokenizer: another vocabulary's losses are not on its scale)."""
    from scaletrain.plan.planner import vocab_of
    from scaletrain.scaling.hparams import EXTRAPOLATION_WARNING

    warnings = []
    fitted = doc.get("approach3", {}).get("range")
    if fitted:
        n, d = plan["model"]["n"], plan["tokens"]
        far = max(plan["compute"] / fitted["compute"][1], n / fitted["n"][1], d / fitted["d"][1])
        if far > EXTRAPOLATION_WARNING:
            warnings.append(f"the law was fitted to runs of up to {fitted['compute'][1]:.3g} FLOPs, "
                            f"{fitted['n'][1]:,.0f} parameters and {fitted['d'][1]:,.0f} tokens; this run "
                            f"({plan['compute']:.3g} FLOPs, {n:,} parameters, {d:,} tokens) is {far:,.3g}x beyond: its "
                            "sizes and loss are extrapolated (fit larger budgets, or check on a smaller run first)")
    data = (doc.get("data") or {}).get("path")
    vocab = vocab_of(data) if data else None
    if vocab is not None and vocab != plan["model"]["vocab_size"]:
        warnings.append(f"the law was measured on {data!r}, tokenized with a vocabulary of {vocab:,}; this run's is "
                        f"{plan['model']['vocab_size']:,}, so its loss is not on the law's scale (plan with --data "
                        "of the same tokenizer, or fit the law on this run's)")
    return warnings


def _json_file(path: str, flag: str, wanted: str, inside: str | None = None):
    """The JSON document in the file `flag` names, or a UserError in one line saying what is wrong
    and to give `wanted` (and, where `path` is a directory holding a file named `inside`, that one)."""
    import json

    file = Path(path)
    if file.is_dir():
        hint = f": the one in it, {str(file / inside)!r}" if inside and (file / inside).is_file() else ""
        raise UserError(f"{flag} {path!r} is a directory; give {wanted}{hint}")
    if not file.is_file():
        raise UserError(f"{flag} {path!r} does not exist; give {wanted}")
    try:
        text = file.read_text()
    except OSError as e:
        raise UserError(f"{flag} {path!r} cannot be read ({e.strerror or e}); give {wanted}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path!r} is not text ({e}); give {wanted}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise UserError(f"{flag} {path!r} is not valid JSON ({e}); give {wanted}") from None


def _law_file(path: str) -> tuple[dict, object, list]:
    """(the law.json document, its approach-3 law, its bootstrap laws), or a UserError in one line."""
    from scaletrain.scaling.fit import bootstrap_laws, law_of

    doc = _json_file(path, "--law", "a law.json written by `scaletrain fit`", inside="law.json")
    try:
        return doc, law_of(doc), bootstrap_laws(doc)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"it has no {e.args[0]!r}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise UserError(f"--law {path!r} is not a law.json written by `scaletrain fit` ({why})") from None


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def _duration(hours: float) -> str:
    from scaletrain.report.goodput import duration

    return duration(hours * 3600)


def plan_tables(plan: dict) -> list[Table]:
    """The plan for people: what to train, on what, how it is split, and what it will take."""
    m, hw, step, run = plan["model"], plan["hardware"], plan["step"], plan["run"]
    what = Table(title="what to train", show_header=False)
    what.add_column(style="bold")
    what.add_column()
    if "moe_experts" in m:  # a mixture of experts
        active = f", {m['n_active'] / 1e9:.3g}B active"
        mlp = (f"{m['moe_experts']} experts of width {m['moe_ffn_dim']}, {m['moe_top_k']} a token"
               + (f", {m['moe_shared_experts']} shared" if m["moe_shared_experts"] else "")
               + (f" (the first {m['moe_dense_layers']} blocks dense, MLP {m['ffn_dim']})" if m["moe_dense_layers"]
                  else ""))
    else:
        active, mlp = "", f"MLP {m['ffn_dim']}"
    what.add_row("model", f"{m['n'] / 1e9:.3g}B parameters ({m['n_non_embedding'] / 1e9:.3g}B non-embedding{active}): "
                          f"width {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads ({m['n_kv_heads']} key/value), "
                          f"{mlp}, vocabulary {m['vocab_size']:,}, sequence {m['seq_len']:,}")
    what.add_row("tokens", f"{plan['tokens']:.4g} ({plan['tokens_per_parameter']:.1f} per parameter)")
    what.add_row("compute", f"{plan['compute']:.4g} FLOPs (6ND: {plan['compute_6nd']:.4g}"
                            + (", N active" if "moe_experts" in m else "") + ")")
    sizing = plan["sizing"]
    if sizing["kind"] == "inference-aware":  # (its training spends more than the budget it is sized against)
        text = (f"inference-aware for {sizing['inference_tokens']:.3g} inference tokens: the loss of the compute-optimal "
                f"model of {sizing['budget']:.3g} FLOPs ({sizing['compute_optimal_n'] / 1e9:.3g}B), reached by a smaller "
                f"one trained on more tokens, at {sizing['lifetime_flops_saved']:.3g} FLOPs less lifetime compute")
        if sizing.get("hours"):
            text += f"; trained in {sizing['hours']:g} hours on these devices"
        what.add_row("sizing", text)
    elif sizing["kind"] != "given":
        text = f"{sizing['kind']} for {sizing['budget']:.3g} FLOPs"
        if sizing["kind"] == "data-constrained":
            epochs = plan["tokens"] / sizing["unique_tokens"]
            text += (f" with {sizing['unique_tokens']:.3g} unique tokens ({epochs:.1f} epochs"
                     + ("; past about 4, each repeat teaches less: Muennighoff et al. 2023" if epochs > 4 else "") + ")")
        if sizing.get("hours"):
            text += f": the budget these devices spend in {sizing['hours']:g} hours"
        what.add_row("sizing", text)
    if plan["predicted_loss"]:
        loss = plan["predicted_loss"]
        low, high = loss.get("interval", (None, None))
        what.add_row("predicted loss", f"{loss['value']:.4f}" + (f" [{low:.4f}, {high:.4f}]" if low is not None else "")
                     + f"  ({loss['source']})")
    hp = plan["hyperparameters"]
    schedule = {"wsd": "warmup-stable-decay", "cosine": "cosine decay", "constant": "constant"}[hp["schedule"]]
    from scaletrain.scaling.hparams import EXTRAPOLATION_WARNING

    far = hp.get("extrapolation") or 1.0
    what.add_row("batch, lr", f"{hp['global_batch_tokens']:,} tokens a step, peak lr {hp['lr']:.3g}, warmup "
                              f"{hp['warmup_steps']} steps, {schedule} ({hp['source']}"
                 + (f", {far:.2g}x beyond the budgets it was measured at: check the rate on a short run first"
                    if far > EXTRAPOLATION_WARNING else "") + ")")

    how = Table(title=f"on {hw['devices']} x {hw['device']['name']} ({hw['nodes']} node{'s' * (hw['nodes'] > 1)})",
                show_header=False)
    how.add_column(style="bold")
    how.add_column()
    how.add_row("layout", plan["layout"]["text"] + (" (the config's)" if plan["layout"].get("kept") else ""))
    if plan["dtype"] == "fp16":
        how.add_row("compute", "float16 with a dynamic loss scale" + ("" if hw["device"].get("bf16", True) else
                                                                      f" ({hw['device']['name']} has no bfloat16)"))
    elif plan["dtype"] == "fp32":
        how.add_row("compute", "float32" + (f": float16's loss scaling does not reach this layout, and "
                                            f"{hw['device']['name']} has no bfloat16" if plan.get("dtype_fallback") else ""))
    mem = plan["memory"]
    parts = ", ".join(f"{key.replace('_', ' ')} {_gb(mem[key])}"
                      + (f" ({_gb(mem['gradients_whole'])} whole while the micro-batches run)"
                         if key == "gradients" and mem.get("gradients_whole") else "")
                      for key in ("parameters", "gradients", "optimizer", "ema", "weight_copies", "activations", "loss")
                      if key != "ema" or mem.get(key))
    how.add_row("memory per device", f"{_gb(mem['peak'])} of {_gb(mem['usable'])} usable: {parts}")
    parts = ", ".join(f"{key.replace('_', ' ')} {step[key]:.3g} s" for key in
                      ("compute", "tensor_parallel", "context_parallel", "expert_parallel", "data_parallel", "pipeline_bubble",
                       "pipeline_sends", "optimizer") if step[key] > 0)
    how.add_row("step", f"{step['total']:.3g} s ({parts})")
    how.add_row("throughput", f"{step['tokens_per_s']:,.0f} tokens/s, MFU {step['mfu']:.1%} "
                              f"({step['mfu_causal']:.1%} counting causal attention)"
                + ("; over 100% as the convention counts the whole score matrix, twice the attention a causal "
                   "kernel computes" if step["mfu"] > 1 else ""))
    if plan["layout"]["layout"]["cp"] > 1:
        how.add_row("", "context parallelism: its attention and all-gathers are modelled, not yet timed on a GPU")
    if plan["batch_ramp"]:
        how.add_row("batch ramp", "; ".join(f"{p['steps']:,} steps of {p['batch_tokens']:,} tokens first: "
                                            f"{p['step_s']:.3g} s, {p['tokens_per_s']:,.0f} tokens/s, "
                                            f"MFU {p['mfu']:.1%}" for p in plan["batch_ramp"]))

    cost = Table(title="what it will take", show_header=False)
    cost.add_column(style="bold")
    cost.add_column()
    cost.add_row("wall-clock", f"{_duration(run['wall_hours'])} ({run['steps']:,} steps; "
                               f"{_duration(run['train_hours'])} without failures)")
    cost.add_row("failures", "none assumed" if run["mtbf_hours"] is None else
                 f"{run['expected_failures']:.2g} expected (job MTBF {_duration(run['mtbf_hours'])}); "
                 f"goodput {run['goodput']:.1%}")
    every = _duration(run["checkpoint_interval_s"] / 3600)
    cost.add_row("checkpoints", f"every {run['checkpoint_interval_steps']:,} steps ({every}), blocking "
                                f"{run['checkpoint_block_s']:.2g} s, writing {run['checkpoint_write_s']:.2g} s")
    cost.add_row("device-hours", f"{run['device_hours']:,.0f}")
    cost.add_row("energy", f"{run['energy_kwh'] / 1000:,.3g} MWh (board power x PUE {hw['prices']['pue']})")
    price = hw["prices"]["per_device_hour"]
    cost.add_row("cost", f"{run['cost']:,.0f} at {price} a device-hour" if run["cost"] is not None
                  else "give --price (per device-hour)")
    if plan["inference"]["tokens"]:
        cost.add_row("lifetime compute", f"{plan['inference']['lifetime_flops']:.3g} FLOPs with "
                                         f"{plan['inference']['tokens']:.3g} inference tokens")
    tables = [what, how, cost]
    if plan["alternatives"]:
        alt = Table(title="the search's best layouts" if plan["layout"].get("kept") else "next best layouts")
        for column in ("layout", "tokens/s", "MFU", "memory"):
            alt.add_column(column, justify="left" if column == "layout" else "right")
        for c in plan["alternatives"]:
            alt.add_row(c["text"] + (" (float32)" if c.get("dtype") == "fp32" and plan["dtype"] != "fp32" else ""),
                        f"{c['time']['tokens_per_s']:,.0f}", f"{c['time']['mfu']:.1%}",
                        _gb(c["memory"]["peak"]))
        tables.append(alt)
    return tables


# -- sweep ----------------------------------------------------------------------------------


def _utilisation(flops_per_s: float | None, device: str, workers: int) -> str:
    """', N% of the bf16 peak of the GPUs in use' where the peak is known."""
    from scaletrain.sweep import peak_in_use

    _, peak = peak_in_use(device, workers)
    if peak is None or flops_per_s is None:
        return ""
    return f", {flops_per_s / peak:.1%} of the GPUs' bf16 peak"


def cmd_sweep(args: argparse.Namespace) -> int:
    from scaletrain.sweep import Sweep, SweepSettings

    budgets = sorted(set(args.budgets))
    settings = SweepSettings(data=args.data, budgets=budgets, shapes=args.shapes, seq_len=args.seq_len,
                             prior=args.prior, eval_tokens=args.eval_tokens, min_steps=args.min_steps, seed=args.seed,
                             device=args.device, optimizer=args.optimizer, mix=args.mix, hparams=_hparams(args.hparams))
    out_dir = Path(args.out) if args.out else Path("sweeps") / Path(args.data).name
    if args.predict_time:
        return _predict_sweep_time(settings, args.concurrency)
    try:
        sweep = Sweep(out_dir, settings)
    except ValueError as e:  # an unknown prior law
        raise UserError(str(e)) from None
    with _searching("sweep", sum(sweep.planned().values()), len(sweep.results())) as show:
        rows = sweep.run(progress=show, concurrency=args.concurrency)
    table = Table(title=f"sweep {out_dir}: {len(rows)} points")
    for column in ("point", "N", "D", "C", "val loss"):
        table.add_column(column, justify="right")
    for row in sorted(rows, key=lambda r: (r["budget"], r["n"])):
        table.add_row(row["name"], f"{row['n']:,.0f}", f"{row['d']:,.0f}", f"{row['c']:.3g}", f"{row['loss']:.4f}")
    out.print(table)
    saved = sweep.savings(rows)
    if sweep.spent_here:
        rate = sweep.spent_here / sweep.elapsed_s
        out.print(f"this invocation: {sweep.spent_here:.3g} FLOPs in {sweep.elapsed_s:.0f} s, {rate:.3g} FLOP/s"
                  + _utilisation(rate, settings.device, args.concurrency))
    out.print(f"cooldown branches: {saved['branched_flops']:.3g} FLOPs instead of {saved['separate_flops']:.3g} for "
              f"separate runs ({saved['saved_fraction']:.0%} saved). Fit with: scaletrain fit {out_dir}")
    return 0


def _predict_sweep_time(settings, concurrency: int) -> int:
    """`sweep --predict-time`: time three of the sweep's shapes here, print its points, FLOPs and
    predicted wall-clock by budget; train nothing."""
    from scaletrain.sweep import SweepPlan, measure_speed

    plan = SweepPlan.on_data(settings)
    calls = plan.calls()
    shapes = sorted({point.shape for points in calls.values() for point, _ in points}, key=plan.n_of)
    console.print(f"timing {len({shapes[0], shapes[len(shapes) // 2], shapes[-1]})} of the sweep's shapes here, "
                  f"{concurrency} at once …")
    logging.getLogger("scaletrain").setLevel(logging.WARNING)  # (the timing runs' own logs)
    pool, start_s = _started_pool(concurrency, settings.device)
    try:
        with tempfile.TemporaryDirectory(prefix="scaletrain-timing-") as scratch:
            speed = measure_speed(plan, [shapes[0], shapes[len(shapes) // 2], shapes[-1]], Path(scratch),
                                  concurrency, pool)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    seconds = plan.budget_seconds(speed, concurrency)
    table = Table(title=f"sweep plan: {sum(map(len, calls.values()))} points, {concurrency} at once, centred on the "
                        f"prior law {settings.prior} (the sweep recentres from its third budget on)")
    for column in ("budget", "points", "FLOPs trained", "predicted"):
        table.add_column(column, justify="right")
    flops = plan.budget_flops()
    for budget, points in calls.items():
        table.add_row(f"{budget:.3g}", ", ".join(point.shape.name for point, _ in points), f"{flops[budget]:.3g}",
                      f"{seconds[budget]:.0f} s")
    out.print(table)
    total = sum(seconds.values()) + start_s
    out.print(f"predicted: {total:.0f} s ({total / 3600:.2f} h) for {sum(flops.values()):.3g} FLOPs (cooldown branches "
              f"included){_started(start_s)}, at {', '.join(f'{r:.3g}' for r in speed.flops_per_s)} FLOP/s per run "
              f"measured for N = {', '.join(f'{n:,.0f}' for n in speed.n)}; nothing trained")
    return 0


# -- mixture --------------------------------------------------------------------------------


def _weights(text: str) -> dict[str, float]:
    """'code=1,prose=3' -> {'code': 1.0, 'prose': 3.0}."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    _distinct([part.partition("=")[0].strip() for part in parts], "the weights")
    weights = {}
    for part in parts:
        name, _, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not NAME=WEIGHT (e.g. code=1,prose=3)") from None
    return weights


def cmd_mixture(args: argparse.Namespace) -> int:
    from scaletrain.mixture import MAX_EPOCHS, MixtureSearch, MixtureSettings, sources_under

    root = Path(args.data)
    if args.sources:
        sources = [name.strip() for name in args.sources.split(",") if name.strip()]
    else:
        sources = sources_under(root, args.target_data)
    if args.runs is not None and args.runs < 1:
        raise UserError(f"--runs {args.runs}: give the number of proxies to train (at least 2 x sources + 1), or leave "
                        "it out for the default")
    settings = MixtureSettings(data=args.data, sources=sources, budget=args.budget, runs=args.runs or 0,
                               seq_len=args.seq_len, prior=args.prior, eval_tokens=args.eval_tokens,
                               min_steps=args.min_steps, seed=args.seed, device=args.device, optimizer=args.optimizer,
                               target_data=args.target_data, hparams=_hparams(args.hparams))
    out_dir = Path(args.out) if args.out else Path("mixtures") / root.name
    with _search_dir(out_dir, args.predict_time, MixtureSearch.kind) as where:
        search = MixtureSearch(where, settings, target=args.target)  # (a bad --target is refused before training)
        point = search.point
        out.print(f"{settings.runs} proxies of {point.shape.name} ({point.n:,} parameters), {point.steps} steps of "
                  f"{point.batch_seqs} x {settings.seq_len} tokens each ({settings.budget:.3g} FLOPs), on mixtures of "
                  f"{', '.join(sources)}")
        if args.predict_time:
            return _predict_search_time(search, "mixture search", args.concurrency, out_dir)
    with _searching("mixtures", settings.runs, len(search.results())) as show:
        rows = search.run(progress=show, concurrency=args.concurrency)
    law, choice = search.choose(rows, target=args.target, tokens=args.tokens)
    table = Table(title=f"mixture search {out_dir}: {len(rows)} proxies")
    table.add_column("run")
    for name in sources:
        table.add_column(f"share {name}", justify="right")
    for name in search.validation:
        table.add_column(f"val {name}", justify="right")
    table.add_column("target", justify="right")
    for row in rows:
        target = sum(w * row[f"loss_{n}"] for n, w in choice.target.items())
        table.add_row(row["name"], *(f"{row[f'share_{n}']:.3f}" for n in sources),
                      *(f"{row[f'loss_{n}']:.4f}" for n in search.validation), f"{target:.4f}")
    out.print(table)
    check = search.check(choice) if args.check else None
    path = search.write(law, choice, check)
    target = " + ".join(f"{w:.3g}·{n}" for n, w in choice.target.items() if w > 0)
    spread = (f"95% {choice.interval[0]:.4f}–{choice.interval[1]:.4f}" if choice.interval else
              "no interval: too few proxies for resamples of them to refit the law; more --runs give one")
    out.print(f"target loss {target}: the law predicts {choice.predicted:.4f} ({spread}) at the "
              f"chosen mixture, {choice.natural:.4f} at the natural one (by tokens), {choice.uniform:.4f} at the uniform "
              f"one; best proxy {choice.best_run['name']} measured {choice.best_run['loss']:.4f}; "
              + (f"the law missed proxies left out of its fit by {choice.loo_error:.2%} on average"
                 if choice.loo_error is not None else "too few proxies to measure the law on one left out"))
    shares = ", ".join(f"{n} {v:.3f}" + (f" ({choice.shares_interval[n][0]:.3f}–{choice.shares_interval[n][1]:.3f})"
                                         if choice.shares_interval else "") for n, v in choice.shares.items())
    out.print(f"chosen mixture: {shares}"
              + (f"; capped at {MAX_EPOCHS:g} epochs of {args.tokens:.3g} tokens: "
                 + ", ".join(f"{n} ≤ {cap:.3f}" for n, cap in choice.caps.items()) if choice.caps else ""))
    if check is not None:
        out.print(f"check: a proxy trained on the chosen mixture ({check['run']}) measured {check['measured']:.4f}, "
                  f"{check['error']:+.2%} from the law's {check['predicted']:.4f}; the best of the others "
                  f"measured {choice.best_run['loss']:.4f}")
    out.print(f"train with it: scaletrain train CONFIG 'data.mix={choice.mix}' (written to {path}); measure its "
              f"scaling law: scaletrain sweep --data {args.data} --mix "
              + ",".join(f"{n}={round(v, 3)}" for n, v in choice.shares.items()) + " --budgets ...")
    return 0


# -- hparams -------------------------------------------------------------------------------


def _small_runs(p: argparse.ArgumentParser, run: str, runs: str, sizing: str, min_steps: int, min_steps_help: str,
                hparams: bool = True) -> None:
    """The options every search by small runs takes (sweep, mixture, hparams): how each `run` is
    sized and trained, and how many at once."""
    p.add_argument("--seq-len", type=_count, default=128, help="training sequence length (128)")
    p.add_argument("--prior", default="epoch", choices=["epoch", "hoffmann"], help=f"published law that {sizing}")
    p.add_argument("--eval-tokens", type=_count, default=16384, help=f"validation tokens of each source per {run} (16384)")
    p.add_argument("--min-steps", type=_how_many, default=min_steps, help=min_steps_help)
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help=f"train.optimizer of every {run} (adamw): measure with the optimizer you will train with")
    p.add_argument("--concurrency", type=_workers, default=1,
                   help=f"{runs} trained at once, in worker processes (GPUs taken in turn)")
    if hparams:
        p.add_argument("--hparams", default=None, metavar="FILE",
                       help=f"the learning-rate and batch rule of every {run}: a hparams.json of `scaletrain hparams` "
                            "(default DeepSeek LLM's)")


@contextlib.contextmanager
def _search_dir(out_dir, predicting: bool, kind: str):
    """Where a search (of outputs.KINDS's `kind`) is built: its directory; with --predict-time,
    where nothing is to be written, a temporary copy of what the directory holds of such a search
    begun (its runs left are timed; settings it would refuse are refused), or an empty one."""
    from scaletrain.outputs import kind_of

    if not predicting:
        yield Path(out_dir)
        return
    check_output_dir(out_dir, kind)
    with tempfile.TemporaryDirectory(prefix="scaletrain-search-") as scratch:
        copy = Path(scratch) / "search"
        copy.mkdir()
        if kind_of(out_dir) == kind:  # (its plan and results: no run's directory is needed)
            for path in Path(out_dir).iterdir():
                if path.is_file() and path.suffix in (".json", ".csv"):
                    shutil.copy2(path, copy / path.name)
        yield copy


def _predict_search_time(search, what: str, concurrency: int, where) -> int:
    """A search's --predict-time: time the shapes of its runs left here, print their FLOPs and
    predicted wall-clock; train nothing. `where`: the search's own directory."""
    left = len(search.todo())
    if not left:
        out.print(f"the {what} in {where} has trained every run; nothing left to time")
        return 0
    workers = min(concurrency, left)  # (as run() trains them: no more at once than there are)
    console.print(f"timing the {what}'s shapes here, {workers} at once …")
    logging.getLogger("scaletrain").setLevel(logging.WARNING)  # (the timing runs' own logs)
    pool, start_s = _started_pool(workers, search.settings.device)
    try:
        with tempfile.TemporaryDirectory(prefix="scaletrain-timing-") as scratch:
            predicted = search.predict_seconds(Path(scratch), workers, pool)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    speed, seconds = predicted["speed"], predicted["seconds"] + start_s
    out.print(f"predicted: {seconds:.0f} s ({seconds / 3600:.2f} h) for the {predicted['runs']} runs left of "
              f"{len(search.keys())}, {predicted['flops']:.3g} FLOPs, {workers} at once{_started(start_s)}, at "
              f"{', '.join(f'{r:.3g}' for r in speed['flops_per_s'])} FLOP/s per run measured for N = "
              f"{', '.join(f'{n:,.0f}' for n in speed['n'])}"
              + (f"; {speed['step_fixed_s'] * 1e3:.3g} ms a step whatever its batch and "
                 f"{speed['micro_batch_s'] * 1e3:.3g} ms a micro-batch whatever its sequences" if speed.get("timed_seqs")
                 else "") + "; nothing trained", highlight=False)
    return 0


def _started_pool(workers: int, device: str):
    """(sweep.worker_pool of `workers` processes, started as a search starts its own before its
    first run: the processes up, the trainer imported; the seconds that took), or (None, 0.0)
    for one worker, which trains in the search's own process."""
    from scaletrain.sweep import worker_pool

    if workers < 2:
        return None, 0.0
    started = time.perf_counter()
    pool = worker_pool(workers, device)
    list(pool.map(abs, range(workers)))
    return pool, time.perf_counter() - started


def _started(seconds: float) -> str:
    return f" (its {seconds:.1f} s of starting worker processes included)" if seconds else ""


@contextlib.contextmanager
def _searching(description: str, total: int, done: int):
    """A progress bar for a search by small runs (a sweep's too): yields the progress callback of
    their run()."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    logging.getLogger("scaletrain").setLevel(logging.WARNING)  # the progress bar speaks for the runs
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=total, info="", completed=done)

        def show(p: dict) -> None:
            eta = f", ETA {p['eta_s']:.0f} s" if p["eta_s"] is not None else ""
            bar.update(task, completed=p["done"], info=f"{p['name']} · {p['flops']:.3g} FLOPs{eta}")

        yield show


def _hparams(path: str | None) -> dict | None:
    """The law of an `--hparams` file as a settings dict (None without one)."""
    if path is None:
        return None
    from scaletrain.hparams import load_law

    return load_law(path).to_dict()


def cmd_hparams(args: argparse.Namespace) -> int:
    from scaletrain.hparams import HparamSearch, HparamSettings
    from scaletrain.scaling.hparams import EXTRAPOLATION_WARNING

    settings = HparamSettings(data=args.data, budgets=sorted(set(args.budgets)), lr_factors=args.lrs,
                              batch_factors=args.batches, seq_len=args.seq_len, prior=args.prior,
                              eval_tokens=args.eval_tokens, min_steps=args.min_steps, seed=args.seed,
                              device=args.device, optimizer=args.optimizer, mix=args.mix)
    out_dir = Path(args.out) if args.out else Path("hparams") / Path(args.data).name
    for budget in args.check or []:  # (before the grid trains: not after)
        if budget <= max(settings.budgets):
            raise UserError(f"--check {budget:.3g}: check the law beyond the budgets it is measured at (above "
                            f"{max(settings.budgets):.3g}); within them the grid's runs already tell")
    with _search_dir(out_dir, args.predict_time, HparamSearch.kind) as where:
        search = HparamSearch(where, settings)
        for budget in settings.budgets:
            at = [p for p in search.points.values() if p.budget == budget]
            out.print(f"budget {budget:.3g}: {at[0].shape.name} ({at[0].n:,} parameters), learning rates "
                      f"{', '.join(f'{lr:.3g}' for lr in sorted({p.lr for p in at}))} x batches of "
                      f"{', '.join(str(b) for b in sorted({p.batch_seqs for p in at}))} x {settings.seq_len} tokens",
                      highlight=False)
        if args.predict_time:
            return _predict_search_time(search, "hyperparameter search", args.concurrency, out_dir)
    with _searching("hparams", len(search.points), len(search.planned_results())) as show:
        rows = search.run(progress=show, concurrency=args.concurrency)
    law, optima, boot = search.fit(rows, samples=args.bootstrap)
    path, doc = search.write(law, optima, boot, args.predict or [])
    for entry in doc["budgets"]:
        budget = entry["budget"]
        at = [row for row in rows if row["budget"] == budget]
        batches = sorted({row["batch_seqs"] for row in at})
        table = Table(title=f"budget {budget:.3g} ({entry['shape']}): validation loss")
        table.add_column("lr \\ batch", justify="right")
        for seqs in batches:
            table.add_column(f"{seqs * settings.seq_len:,} tok", justify="right")
        for lr in sorted({row["lr"] for row in at}):
            cells = []
            for seqs in batches:
                row = next((r for r in at if r["lr"] == lr and r["batch_seqs"] == seqs), None)
                text = "" if row is None else "diverged" if not math.isfinite(row["loss"]) else f"{row['loss']:.4f}"
                cells.append(f"[bold]{text}[/bold]" if row is not None and row["name"] == entry["best_run"]["name"]
                             else text)
            table.add_row(f"{lr:.4g}", *cells)
        out.print(table)
        prior = entry["prior_rule"]
        out.print(f"  optimum ({entry['method']}): lr {entry['lr']:.4g}, batch {entry['batch_tokens']:,.0f} tokens; "
                  f"DeepSeek's rule: lr {prior['lr']:.4g}, batch {prior['batch_tokens']:,.0f}"
                  + (f"; the best run is at the grid's {' and '.join(entry['edges'])}: widen "
                     f"{' and '.join(sorted({'--lrs' if e.startswith('lr') else '--batches' for e in entry['edges']}))}"
                     if entry["edges"] else "")
                  + "".join(f"; left out of the {what} law (its optimum there is only a bound)"
                            for what in ("lr", "batch") if what not in entry["used"]), highlight=False)
    ci = doc["interval"]
    out.print(f"law: lr = {law.lr_coefficient:.4g} · C^{law.lr_exponent:.4f} (exponent 95% "
              f"{ci['lr_exponent'][0]:.3f} to {ci['lr_exponent'][1]:.3f}), batch = {law.batch_coefficient:.4g} · "
              f"C^{law.batch_exponent:.4f} tokens ({ci['batch_exponent'][0]:.3f} to {ci['batch_exponent'][1]:.3f}); "
              "DeepSeek LLM's: -0.125 and 0.327", highlight=False)
    for p in doc["predictions"]:
        lr_low, lr_high = p["lr_interval"]
        b_low, b_high = p["batch_interval"]
        out.print(f"at {p['compute']:.3g} FLOPs: lr {p['lr']:.4g} ({lr_low:.3g}–{lr_high:.3g}), batch "
                  f"{p['batch_tokens']:,.0f} tokens ({b_low:,.0f}–{b_high:,.0f}); DeepSeek's rule: lr "
                  f"{p['prior_rule']['lr']:.4g}, batch {p['prior_rule']['batch_tokens']:,.0f}"
                  + (f" ({p['extrapolation']:.2g}x beyond the budgets measured: the further, the less it holds)"
                     if p["extrapolation"] > EXTRAPOLATION_WARNING else ""), highlight=False)
    for budget in sorted(set(args.check or [])):
        _check_hparams(search, law, budget, args.concurrency)
    out.print(f"wrote {path}; use it: scaletrain sweep --data {shlex.quote(args.data)} --budgets ... --hparams "
              f"{shlex.quote(str(path))} "
              f"(also mixture and plan --hparams)", highlight=False)
    return 0


def _check_hparams(search, law, budget: float, concurrency: int) -> None:
    """hparams --check: the measured law against DeepSeek's rule at `budget`, a run each."""

    from scaletrain.hparams import CheckSettings, HparamCheck

    check = HparamCheck(search.out / "check", CheckSettings(search.settings, law.to_dict(), budget))
    with _searching(f"check {budget:.3g}", 2, 2 - len(check.todo())) as show:
        rows = check.run(progress=show, concurrency=concurrency)
    entry = check.record(rows)
    table = Table(title=f"check at {budget:.3g} FLOPs ({rows[0]['shape']}, {rows[0]['n']:,.0f} parameters, "
                        f"{entry['extrapolation']:.2g}x beyond the budgets measured): validation loss")
    for column in ("rule", "lr", "batch", "steps", "val loss"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row("measured law" if row["rule"] == "measured" else "DeepSeek's", f"{row['lr']:.4g}",
                      f"{row['batch_tokens']:,.0f} tok", f"{row['steps']:,.0f}",
                      "diverged" if not math.isfinite(row["loss"]) else f"{row['loss']:.4f}")
    out.print(table)
    if entry["relative_difference"] is not None:
        better = "the measured law" if entry["loss_difference"] < 0 else "DeepSeek's rule"
        out.print(f"  {better} trained the better model, by {abs(entry['relative_difference']):.2%} of the loss "
                  "(a seed moves such losses by a few tenths of a percent: a difference below that is a tie)",
                  highlight=False)


# -- tune -----------------------------------------------------------------------------------


def cmd_tune(args: argparse.Namespace) -> int:
    from scaletrain.config import load_config
    from scaletrain.tune import DEFAULT_LRS, Tune, proxy_data, tuned_rates

    cfg = load_config(args.config, args.overrides)
    proxy = proxy_data(cfg)["model"]  # a config muP cannot narrow is refused before anything trains
    lrs = args.lrs or list(DEFAULT_LRS)
    check_written_config(args.write_config, "--write-config", args.config, "tune")  # (before training: not after it)
    out_dir = Path(args.out) if args.out else Path("runs") / f"{cfg.run.name}-tune"
    shape = f"width {proxy['dim']}, {proxy['n_layers']} blocks"
    at_once = f", {args.concurrency} at a time" if args.concurrency > 1 else ""
    console.print(f"tuning the learning rate of {cfg.run.name} (width {cfg.model.dim}, {cfg.model.n_layers} blocks) "
                  f"on its proxy of {shape}, {len(set(lrs))} rate{'s' * (len(set(lrs)) != 1)}{at_once}, in {out_dir}", highlight=False)
    tuning = Tune(cfg, out_dir, lrs, steps=args.steps)  # (refused here, before its progress bar is drawn)
    with _searching("rates", len(set(lrs)), len(tuned_rates(out_dir) & set(lrs))) as show:
        doc = tuning.run(progress=show, concurrency=args.concurrency)
    table = Table(title=f"proxy of {shape}: validation loss by learning rate")
    table.add_column("lr", justify="right")
    table.add_column("val loss", justify="right")
    for row in doc["results"]:
        mark = "  ← best" if row["lr"] == doc["best_lr"] else ""
        table.add_row(f"{row['lr']:.4g}", "diverged" if row["diverged"] else f"{row['val_loss']:.4f}{mark}")
    out.print(table)
    if doc["best_lr"] is None:
        raise UserError("every learning rate diverged; give smaller ones with --lrs")
    if doc["edge"]:
        out.print(f"the best rate is the grid's {doc['edge']}: the best may lie beyond it; extend --lrs "
                  + ("below" if doc["edge"] == "smallest" else "above"), highlight=False)
    if doc["fitted_lr"] is not None:
        out.print(f"a parabola in log(lr) through the best and its neighbours is lowest at {doc['fitted_lr']:.4g}",
                  highlight=False)
    if args.write_config:
        # (a run of its own, named after the file: the tuned config must not resume the tuned one's run)
        tuned = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": doc["best_lr"]}),
                                       "run": cfg.run.model_copy(update={"name": Path(args.write_config).stem})})
        Path(args.write_config).write_text(f"{WRITTEN_BY['tune']}\n{tuned.to_toml()}")
        out.print(f"wrote {args.write_config} (train.lr = {doc['best_lr']:.4g}); train it with: scaletrain train "
                  f"{shlex.quote(args.write_config)}", highlight=False)
    return 0


# -- fit ------------------------------------------------------------------------------------


def _number(convert, what: str, ok, bound: str):
    """An argparse type: `convert`, then `ok`, each failure one line saying what would do."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {bound}")
        return value
    return parse


_flops = _number(float, "a number (e.g. 1e21)", lambda v: 0 < v < float("inf"), "positive and finite")
_count = _number(int, "a whole number", lambda v: v >= 1, "at least 1")
_how_many = _number(int, "a whole number", lambda v: v >= 0, "0 or more")


def _wall_seconds(text: str) -> float:
    """A length of time such as 3h50m, 90m or 45s, in seconds."""
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", text.strip())
    if not text.strip() or parts is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length of time; give hours, minutes and seconds such as "
                                         "3h50m, 90m or 45s")
    hours, minutes, seconds = (float(part or 0) for part in parts.groups())
    total = 3600 * hours + 60 * minutes + seconds
    if total <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be longer than nothing")
    return total


def _validation_options(p: argparse.ArgumentParser) -> None:
    """data prepare's and data import's validation split."""
    p.add_argument("--val-fraction", type=float, default=0.005, help="fraction of documents held out (0.005)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="seed of the validation split's draw (prepare's: also of its tokenizer sample and "
                        "fill-in-the-middle draws)")


def _duration_text(seconds: float) -> str:
    """Seconds as _wall_seconds reads them back: '13800s', '0.250s' (never in exponent notation)."""
    return f"{seconds:.0f}s" if seconds == int(seconds) else f"{seconds:.3f}s"


def _given(what: str):
    """An argparse type refusing an empty value (which would otherwise be taken for none given: the
    default directory written, or the current one)."""
    def check(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"is empty; give {what}")
        return text
    return check


_out_dir = _given("the path of a directory")


def _data_dir(text: str) -> str:
    """A data directory as a search records it: data/x/ and ./data/x are data/x (a search run again
    with the path written otherwise is the same search)."""
    return os.path.normpath(text) if text else text


def _two_or_more(values: list, what: str) -> list:
    """`values`, or argparse's error where one alone leaves nothing to choose between."""
    if len(values) < 2:
        raise argparse.ArgumentTypeError(f"gives one; give two or more {what} to choose between")
    return values


def _distinct(values: list, what: str, error: type[Exception] = argparse.ArgumentTypeError) -> list:
    """`values`, or an `error` in one line naming the first given twice (argparse's, for a type)."""
    twice = next((value for i, value in enumerate(values) if value in values[:i]), None)
    if twice is not None:
        raise error(f"{format(twice, 'g') if isinstance(twice, float) else twice} is given twice in {what}; give "
                    "each once")
    return values


_seed = _number(int, "a whole number", lambda v: 0 <= v < 2**63, "from 0 to 2^63 - 1")
_temperature = _number(float, "a number", lambda v: 0 <= v < float("inf"), "0 (greedy) or more, and finite")
_top_p = _number(float, "a number", lambda v: 0 < v <= 1, "above 0 and at most 1 (1: every token)")
# Worker processes at once: each needs a share of the cores to feed its device (a GPU sweep runs
# about 4 a GPU); more than 4 a core only thrash.
_CORES = os.cpu_count() or 1
_workers = _number(int, "a whole number", lambda v: 1 <= v <= 4 * _CORES,
                   f"between 1 and {4 * _CORES} (each worker process needs a share of this machine's {_CORES} CPU "
                   "cores)")
_amount = _number(float, "a number", lambda v: 0 <= v < float("inf"), "zero or positive")
_lr = _number(float, "a learning rate (e.g. 3e-3)", lambda v: 0 < v < float("inf"), "positive and finite")
_pue = _number(float, "a number", lambda v: 1 <= v < float("inf"), "at least 1 (the devices' own power is 1)")


def _chinchilla_preset(name: str):
    """A published law of the form E + A/N^α + B/D^β, or a UserError naming those there are."""
    from scaletrain.scaling.laws import ChinchillaLaw, preset

    try:
        law = preset(name)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not isinstance(law, ChinchillaLaw):
        raise UserError(f"the {name!r} law has no E + A/N^α + B/D^β form to predict with; use hoffmann or epoch")
    return law


def _interval(entry: dict, digits: int = 4) -> str:
    value = f"{entry['value']:.{digits}g}"
    if entry.get("low") is None:
        return value
    return f"{value}  [{entry['low']:.{digits}g}, {entry['high']:.{digits}g}]"


def _backtest(rows: list[dict]) -> str:
    """fit.backtest's rows as '1.4x: -2.8%, 1.9x: -4.3%': how far beyond its budgets the law
    was asked to predict, and by how much the loss reached differed."""
    return ", ".join(f"{row['extrapolation']:.1f}x: {row['error']:+.1%}" for row in rows)


def _check_fit_out(out_dir, given: bool, points: str | None) -> None:
    """Refuse, before fitting, a directory for law.json and the plots that is a file, another
    command's output (a run, data), or — for --points — a sweep, whose own law this fit of other
    points would replace."""
    from scaletrain.outputs import kind_of

    flag = "--out" if given else f"--points {points!r}: its folder"
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{flag} {str(out_dir)!r} is a file; give a directory for law.json and the plots")
    found = kind_of(out_dir)
    if found not in (None, "sweep"):
        raise UserError(f"{flag} {str(out_dir)!r} is a {found}; give --out a directory of its own for law.json and "
                        "the plots")
    if found == "sweep" and points is not None:
        raise UserError(f"{flag} {str(out_dir)!r} is a sweep, whose own law.json a fit of these points would "
                        "replace; give --out a directory of its own for them")


def cmd_fit(args: argparse.Namespace) -> int:
    import json

    from scaletrain.outputs import kind_of
    from scaletrain.scaling import fit as fitting
    from scaletrain.scaling.optimal import data_constrained_optimal, inference_optimal, predict

    if (args.inference_tokens is not None or args.unique_tokens is not None) and not args.predict:
        raise UserError("--inference-tokens and --unique-tokens size the run of a --predict budget; add --predict C")
    if args.preset:
        if args.sweep_dir is not None or args.points is not None:
            raise UserError(f"--preset {args.preset} predicts from a published law, not from fitted points; drop the "
                            "sweep directory and --points, or drop --preset")
        if args.out is not None:
            raise UserError(f"--preset {args.preset} writes nothing (--out takes a fitted law and its plots); drop --out")
        law = _chinchilla_preset(args.preset)
        doc, boot, out_dir = {"source": law.source}, [], None
        out.print(f"published law {args.preset}: {law.source}")
    else:
        if (args.sweep_dir is None) == (args.points is None):
            raise UserError("give a sweep directory or --points CSV (or --preset NAME to predict from a published law)")
        if args.sweep_dir is not None and ((found := kind_of(args.sweep_dir)) not in (None, "sweep")
                                           or Path(args.sweep_dir).is_file()):
            what = "a file" if Path(args.sweep_dir).is_file() else f"a {found}"
            raise UserError(f"{args.sweep_dir!r} is {what}, not a sweep directory; give a sweep's directory, or a CSV "
                            "of points as --points")
        points_path = Path(args.points) if args.points else Path(args.sweep_dir) / "results.csv"
        out_dir = Path(args.out) if args.out else points_path.parent
        _check_fit_out(out_dir, args.out is not None, args.points)  # (before the fit and its bootstrap)
        try:
            points = fitting.read_points(points_path, drop_highest=args.drop_highest)
            doc = fitting.fit_all(points, samples=args.bootstrap, law_min_steps=args.min_steps)
        except ValueError as e:
            raise UserError(str(e)) from None
        doc["source"] = str(points_path)
        grid = points_path.parent / "grid.json"
        if args.sweep_dir and grid.is_file():  # the data the law is of: `report --law` checks a run against it
            swept = json.loads(grid.read_text())["settings"]
            doc["data"] = {"path": str(Path(swept["data"]).resolve()), "mix": swept.get("mix")}
        law, boot = fitting.law_of(doc), fitting.bootstrap_laws(doc)
        fitted = doc["approach3"]["points"]
        table = Table(title=f"scaling law from {len(points)} points, {doc['budgets']} budgets "
                            f"(95% bootstrap intervals, {len(boot)} resamples)"
                            + (f"; approach 3 on the {fitted} of >= {args.min_steps} steps" if args.min_steps else ""))
        table.add_column("")
        table.add_column("value [interval]", justify="right")
        for name in ("E", "A", "B", "alpha", "beta", "a", "b"):
            table.add_row(f"approach 3 {name}", _interval(doc["approach3"][name]))
        for approach in ("approach1", "approach2"):
            fit = doc[approach]
            if "skipped" in fit:
                table.add_row(approach.replace("approach", "approach "), "skipped: " + fit["skipped"])
            else:
                used = (f" ({fit['budgets']} of the {doc['budgets']} budgets: the others lack a profile)"
                        if fit["budgets"] < doc["budgets"] else "")
                for name in ("a", "b"):
                    table.add_row(f"{approach.replace('approach', 'approach ')} {name}{used if name == 'a' else ''}",
                                  _interval(fit[name]))
                if abs(fit["a"]["value"]) < 1e-6:  # (the envelope's lowest points are all one size)
                    table.add_row("", "every budget's lowest point is the same model: this says nothing of N_opt")
        if doc["backtest"]:
            table.add_row("backtest: approach 3 without the largest budgets", _backtest(doc["backtest"]))
        out.print(table)
        for name in doc["approach3"].get("at_bounds", []):
            low, high = fitting.BOUNDS[3 if name == "alpha" else 4]
            console.print(f"[yellow]warning:[/] approach 3's {name} = {doc['approach3'][name]['value']:.4g} lies at the "
                          f"edge of its search ({low:g} to {high:g}): the points do not set it, and what the law "
                          "predicts from it is not to be trusted; add budgets or shapes, or fit longer runs "
                          "(--min-steps)", highlight=False, soft_wrap=True)
    sweep = None  # a sweep directory names the shape of its family to train at each budget
    if args.predict and out_dir is not None and args.sweep_dir and (Path(args.sweep_dir) / "grid.json").is_file():
        from scaletrain.sweep import Sweep

        try:
            sweep = Sweep.open(Path(args.sweep_dir))
        except UserError as e:
            out.print(f"(no shape of the sweep's family named: {e})")
    predictions = []
    for compute in args.predict or []:
        entry = predict(law, compute, boot)
        if args.inference_tokens:
            best, reference = inference_optimal(law, compute, args.inference_tokens)
            entry["inference_aware"] = {"n": best.n, "d": best.d, "tokens_per_parameter": best.tokens_per_parameter,
                                        "lifetime_flops": best.lifetime_flops,
                                        "compute_optimal_lifetime_flops": reference.lifetime_flops,
                                        "saved_fraction": 1 - best.lifetime_flops / reference.lifetime_flops}
        if args.unique_tokens:
            try:
                best = data_constrained_optimal(law, compute, args.unique_tokens)
            except ValueError as e:
                raise UserError(f"--unique-tokens: {e}") from None
            entry["data_constrained"] = {"n": best.n, "d": best.d, "epochs": best.d / args.unique_tokens,
                                         "loss": best.loss}
        predictions.append(entry)
        out.print(f"C = {compute:.3g} FLOPs: N_opt {entry['n']:.4g}, D_opt {entry['d']:.4g} "
                  f"({entry['tokens_per_parameter']:.1f} tokens/parameter), loss {entry['loss']:.4f}"
                  + (f" [{entry['loss_interval'][0]:.4f}, {entry['loss_interval'][1]:.4f}]"
                     if "loss_interval" in entry else ""))
        if "inference_aware" in entry:
            aware = entry["inference_aware"]
            out.print(f"  with {args.inference_tokens:.3g} inference tokens: N {aware['n']:.4g}, D {aware['d']:.4g} "
                      f"({aware['tokens_per_parameter']:.1f} tokens/parameter), lifetime compute "
                      f"{aware['saved_fraction']:.1%} below the compute-optimal model's")
        if "data_constrained" in entry:
            limited = entry["data_constrained"]
            out.print(f"  with {args.unique_tokens:.3g} unique tokens: N {limited['n']:.4g}, D {limited['d']:.4g} "
                      f"({limited['epochs']:.1f} epochs), loss {limited['loss']:.4f}")
        if sweep is not None:
            entry["shape"] = _shape_to_train(sweep, law, compute, out_dir)
    if out_dir is not None:
        from scaletrain.report.scaling import plot_fit

        doc["predictions"] = predictions
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "law.json").write_text(json.dumps(doc, indent=1) + "\n")
        paths = plot_fit(points, doc, out_dir)
        out.print(f"wrote {out_dir / 'law.json'} and {', '.join(p.name for p in paths)}")
    return 0


def _shape_to_train(sweep, law, compute: float, out_dir) -> dict:
    """The shape of the sweep's family that `law` predicts lowest at `compute`, trained as the
    sweep trains it; writes its config beside law.json and says how to train it."""
    from scaletrain.config import ConfigError, validate_config

    name = f"{sweep.out.name}-C{compute:.4g}".replace("+", "")
    try:
        point, cfg = sweep.best_run(law, compute, ["run.dir=runs", f"run.name={name}"])
    except ConfigError as e:
        out.print(f"  in the sweep's shape family: none ({e})")
        return {"skipped": str(e)}
    # Trained on its own, it is evaluated ten times along the way (the sweep's points, only at the end).
    data = cfg.model_dump(exclude_none=True)
    data["eval"]["interval"] = max(1, -(-point.steps // 10))
    cfg = validate_config(data, source="the fitted shape's config")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"train-{point.name}.toml"
    path.write_text(cfg.to_toml())
    loss = law.loss(point.n, point.tokens)
    out.print(f"  in the sweep's shape family: {point.shape.name} (N {point.n:,}, D {point.tokens:,}: {point.steps:,} "
              f"steps of {point.batch_seqs} sequences, lr {point.lr:.3g}), loss {loss:.4f}")
    out.print(f"  train it with: scaletrain train {shlex.quote(str(path))}", soft_wrap=True, highlight=False)
    return {"name": point.shape.name, "n": point.n, "d": point.tokens, "steps": point.steps,
            "batch_seqs": point.batch_seqs, "lr": point.lr, "loss": loss, "config": str(path)}


# -- demo -------------------------------------------------------------------------------------


def demo_table(report: dict, concurrency: int, seconds: float) -> Table:
    """The demo's report (demo.json) as the table `scaletrain demo` prints."""
    low, high = report["predicted_interval"]
    a = report["a"]
    table = Table(title=f"scaletrain demo: {report['points']} sweep points, then {report['extrapolation']:.1f}x the "
                        f"largest budget ({seconds:.0f} s)")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("approach 3 fitted to", f"the {report['law_points']} points of >= {report['law_min_steps']} steps"
                  if report["law_min_steps"] else f"all {report['law_points']} points")
    table.add_row("fitted exponent a (N_opt ∝ C^a), 95% interval", f"{a['value']:.3f} [{a['low']:.3f}, {a['high']:.3f}]")
    b = report["b"]
    table.add_row("fitted exponent b (D_opt ∝ C^b)", f"{b['value']:.3f} [{b['low']:.3f}, {b['high']:.3f}]")
    table.add_row("model trained", f"{report['final']['name']}: N {report['final']['n']:,}, "
                                   f"D {report['final']['tokens']:,}")
    table.add_row("predicted validation loss", f"{report['predicted_loss']:.4f} [{low:.4f}, {high:.4f}]")
    table.add_row("actual validation loss", f"{report['actual_loss']:.4f}")
    table.add_row("error", f"{report['error']:+.2%}")
    if report["backtest"]:
        table.add_row("backtest: the law without the largest budgets", _backtest(report["backtest"]))
    table.add_row("sweep FLOPs saved by cooldown branches", f"{report['sweep_savings']['saved_fraction']:.0%}")
    data = report["data"]
    table.add_row("epochs of the training data", f"{data['final_epochs']:.2f} in the final run, at most "
                  f"{data['sweep_max_epochs']:.2f} in the sweep ({data['train_tokens']:,} tokens)")
    speed = report["throughput"]
    for part, what in (("sweep", f"sweep throughput ({concurrency} at once)"), ("final", "final run throughput")):
        run = speed[part]
        if run["seconds"]:
            table.add_row(what, f"{run['flops_per_s']:.3g} FLOP/s over {run['seconds']:.0f} s"
                          + (f", {run['utilisation']:.1%} of the bf16 peak" if run["utilisation"] is not None else ""))
    timing = report.get("time", {})
    if "predicted" in timing:  # (a time limit: the budgets were fitted to this machine's measured speed)
        actual, predicted = timing["actual"], timing["predicted"]
        table.add_row(f"time limit {timing['limit_s']:.0f} s: budgets scaled by", f"{timing['scale']:.2f}")
        table.add_row("sweep time, predicted / actual", f"{predicted['sweep_s']:.0f} s / {actual['sweep_s']:.0f} s")
        table.add_row("final run time, predicted / actual", f"{predicted['final_s']:.0f} s / {actual['final_s']:.0f} s")
    return table


def cmd_demo(args: argparse.Namespace) -> int:
    from scaletrain.demo import DemoSettings, run_demo

    settings = DemoSettings.gpu() if args.device == "cuda" else DemoSettings(device="cpu")
    settings.seed = args.seed
    if args.minutes is not None:
        if not 0 <= args.minutes < float("inf"):
            raise UserError(f"--minutes {args.minutes:g}: give the minutes the demo may take, e.g. 10 (0: no limit)")
        if 0 < 60 * args.minutes <= settings.reserve_s:  # (found only after minutes of preparing the data)
            raise UserError(f"--minutes {args.minutes:g} leaves nothing beyond the {settings.reserve_s:.0f} s kept for "
                            "the fit and the report, let alone the data, the sweep and the run; give more, e.g. 10 (0: "
                            "no limit)")
        settings.time_limit_s = 60 * args.minutes or None
    logging.getLogger("scaletrain").setLevel(logging.WARNING)
    started = time.perf_counter()

    def show(stage: str, info: dict) -> None:
        if stage == "sweep":
            eta = f", ETA {info['eta_s']:.0f} s" if info.get("eta_s") is not None else ""
            console.print(f"sweep {info['done']}/{info['total']}: {info['name']} ({info['flops']:.3g} FLOPs{eta})")
        elif stage == "train":
            console.print(f"training the predicted optimum {info['name']}: N {info['n']:,}, {info['tokens']:,} tokens")
        elif stage == "calibrate":
            console.print("timing the sweep's shapes on this machine …")
        elif stage == "time":
            predicted = info["predicted"]
            console.print(f"predicted: sweep {predicted['sweep_s']:.0f} s, final run {predicted['final_s']:.0f} s, of "
                          f"{info['available_s']:.0f} s left; budgets x {info['scale']:.2f}: "
                          f"{', '.join(f'{b:.3g}' for b in info['budgets'])} FLOPs")
        else:
            console.print(f"{stage} …")

    report = run_demo(Path(args.out), settings, progress=show)
    out.print(demo_table(report, settings.concurrency, time.perf_counter() - started))
    out.print(f"the final run's report: {report['report']}", soft_wrap=True, highlight=False)
    return 0


# -- generate -------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from scaletrain.generate import generate_text

    texts = generate_text(args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k or None, seed=args.seed, top_p=args.top_p,
                          samples=args.samples, step=args.step, average=args.average, ema=args.ema,
                          device=args.device, suffix=args.suffix)
    for number, text in enumerate(texts, 1):
        out.rule("sample" if len(texts) == 1 else f"sample {number} of {len(texts)}")
        out.print(text, markup=False, highlight=False)
    out.rule()
    return 0


# -- eval -----------------------------------------------------------------------------------


def cmd_eval(args: argparse.Namespace) -> int:
    from scaletrain.evaluate import evaluate_run, is_sweep, weights_to_evaluate
    from scaletrain.train.metrics import json_line

    if args.every and args.step:
        raise UserError("give --step K (one or more) or --all, not both")
    args.step = sorted(set(args.step)) if args.step else args.step  # (a step given twice is evaluated once)
    check_output_file(args.out, "--out", makes_folder=True)
    if is_sweep(Path(args.run_dir)):
        return _eval_sweep(args)
    if args.metric != "loss":
        raise UserError("--metric chooses what a sweep's points are fitted to; give a sweep directory, or drop it")
    check_output_file(args.out, "--out", ("jsonl", "json"), makes_folder=True)  # (a JSON line per checkpoint)
    _check_eval_out(args.out, args.tasks)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        weights_to_evaluate(Path(args.run_dir), args.step, args.every, args.average, args.ema)  # one line, not N
        return _torchrun(args, ["eval", args.run_dir, *args.overrides, *(f"--step={step}" for step in args.step or []),
                                *(["--all"] if args.every else []), *(["--data", args.data] if args.data else []),
                                f"--average={args.average}", *(["--ema"] if args.ema else []),
                                *(["--tasks", *args.tasks] if args.tasks is not None else []),
                                *(["--out", args.out] if args.out else [])])
    main_rank = int(os.environ.get("RANK", 0)) == 0
    records = []
    for record in evaluate_run(args.run_dir, steps=args.step, every=args.every, data=args.data, tasks=args.tasks,
                               overrides=args.overrides, average=args.average, ema=args.ema):
        records.append(record)
        if args.out and main_rank:  # as each is measured: a long sweep over checkpoints keeps what it did
            if len(records) == 1:  # (replaced once there is something to write: a refusal leaves it as it was)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w" if len(records) == 1 else "a") as f:
                f.write(json_line(record) + "\n")
    if not main_rank:
        return 0
    if not records:  # (every checkpoint chosen was pruned while it was read)
        out.print("no checkpoint was evaluated")
        return 1
    out.print(eval_table(args.run_dir, records))
    if args.out:
        out.print(f"wrote {args.out}", highlight=False)
    return 0


def _check_eval_out(path: str | None, tasks: list[str] | None) -> None:
    """Refuse an `eval --out` that would replace what is not an earlier eval's output: one of the
    task files read, or a file whose first line is not an eval record."""
    import json

    if not path or not Path(path).is_file():
        return
    if any(Path(task).resolve() == Path(path).resolve() for task in tasks or []):
        raise UserError(f"--out {path!r} is one of the --tasks files; give the results another name")
    with open(path, errors="replace") as f:
        first = f.readline()
    try:
        record = json.loads(first) if first.strip() else {}
    except json.JSONDecodeError:
        record = None
    if record != {} and not (isinstance(record, dict) and {"step", "checkpoint"} <= record.keys()):
        raise UserError(f"--out {path!r} exists and is not the output of an eval (a JSON line per checkpoint); "
                        "give a new file name, or remove it")


def _eval_sweep(args: argparse.Namespace) -> int:
    """eval of a sweep directory: each point's final checkpoint, written for `fit --points`."""
    from scaletrain.evaluate import evaluate_sweep

    if args.step or args.every or args.average > 1 or args.nproc > 1 or args.ema:
        raise UserError(f"{args.run_dir!r} is a sweep: each point's final checkpoint is evaluated, in one process; "
                        "drop --step, --all, --average, --ema and --nproc")
    if not args.out:
        raise UserError(f"{args.run_dir!r} is a sweep: give --out FILE.csv for its points, to fit with `scaletrain "
                        "fit --points FILE.csv`")
    check_output_file(args.out, "--out", ("csv",), makes_folder=True)
    rows = evaluate_sweep(args.run_dir, args.out, data=args.data, tasks=args.tasks, overrides=args.overrides,
                          metric=args.metric)
    table = Table(title=f"sweep {args.run_dir} on {args.data or 'its own data'}: {args.metric}")
    for name in ("point", "N", "C", "sweep's loss", args.metric):
        table.add_column(name, justify="left" if name == "point" else "right")
    for row in rows:
        table.add_row(row["name"], f"{float(row['n']):,.0f}", f"{float(row['c']):.3g}",
                      f"{float(row['sweep_loss']):.4f}", f"{float(row['loss']):.4f}")
    out.print(table)
    out.print(f"wrote {args.out}: fit a law to it with `scaletrain fit --points {shlex.quote(args.out)}`",
              highlight=False)
    return 0


def eval_table(run_dir: str, records: list[dict]) -> Table:
    """A row per checkpoint: its step and tokens, the validation loss (in bits per byte too, where
    the tokenizer's pieces say their bytes; each source's, of a mixture), each task's accuracy (per character)
    and the right choice's loss."""
    averaged = len(records[0].get("averaged_steps", [])) - 1
    what = "moving averages of the weights" if records[0].get("ema") else "weights"
    table = Table(title=f"evaluation: {run_dir}"
                  + (f" (each the mean of {averaged + 1} checkpoints' {what}, ending at its step)" if averaged > 0
                     else " (each checkpoint's moving average of the weights)" if records[0].get("ema") else ""))
    bits = "bits_per_byte" in records[0]
    for name in ("step", "tokens", "validation loss", *(["bits/byte"] if bits else [])):
        table.add_column(name, justify="right")
    sources = list(records[0]["loss_by_source"]) if len(records[0]["loss_by_source"]) > 1 else []
    tasks = list(records[0].get("task_accuracy", {}))
    for name in sources:
        table.add_column(f"{name} loss", justify="right")
    for name in tasks:
        table.add_column(f"{name} accuracy (per char; loss)", justify="right")
    for r in records:
        table.add_row(*(f"{r[key]:,}" if r[key] is not None else "-" for key in ("step", "tokens")),
                      f"{r['loss']:.4f}",
                      *([f"{r['bits_per_byte']:.4f}"] if bits else []),
                      *(f"{r['loss_by_source'][name]:.4f}" for name in sources),
                      *(f"{r['task_accuracy'][name]:.1%} ({r['task_accuracy_norm'][name]:.1%}; "
                        f"{r['task_nll'][name]:.4f})" for name in tasks))
    return table


# -- report ---------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    from scaletrain.plan.planner import PLANNED
    from scaletrain.report.goodput import wall_line
    from scaletrain.report.run import branch_line, by_source_line, noise_line, run_report

    law = _law_file(args.law)[0] if args.law else None
    plan = None
    if args.plan:
        plan = _json_file(args.plan, "--plan", "the .plan.json that `scaletrain plan --write-config` wrote beside "
                                               "the config")
    summary = run_report(args.run_dir, law, plan)
    table = Table(title=f"run: {summary['run']}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("parameters", f"{summary['parameters']:,}")
    table.add_row("steps", f"{summary['step']:,} / {summary['total_steps']:,}")
    table.add_row("final train loss", _num(summary["train_loss"]))
    table.add_row("final validation loss", _num(summary["val_loss"]))
    if summary["val_bits_per_byte"] is not None:
        table.add_row("final validation bits per byte", _num(summary["val_bits_per_byte"]))
    if summary["val_loss_by_source"]:
        table.add_row("final validation loss by source", by_source_line(summary["val_loss_by_source"]))
    if summary["heldout_loss"]:
        table.add_row("final held-out losses (eval.data)", by_source_line(summary["heldout_loss"]))
    if summary["val_ema_loss"] is not None:
        table.add_row("final validation loss, moving average", _num(summary["val_ema_loss"]))
    table.add_row("tokens/s (median)", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-")
    if summary["mfu"] is not None:
        table.add_row("MFU (median)", f"{summary['mfu']:.1%}")
    if summary["noise"] is not None:
        table.add_row("gradient noise scale (tokens)", noise_line(summary["noise"]))
    if summary["time"] is not None:
        invocations = summary["time"]["invocations"]
        table.add_row(f"goodput over {invocations} invocation{'s' * (invocations != 1)}", wall_line(summary["time"]))
    for name, task in summary["tasks"].items():
        table.add_row(f"{name} accuracy (per character; right choice's loss)",
                      f"{task['accuracy']:.1%} ({task['accuracy_norm']:.1%}; {task['nll']:.4f})")
    prediction = summary.get("prediction")
    if prediction is not None:
        low, high = prediction.get("interval", (None, None))
        table.add_row("predicted final validation loss", f"{prediction['loss']:.4f}"
                      + (f" [{low:.4f}, {high:.4f}]" if low is not None else ""))
        if "error" in prediction:
            table.add_row("reached against predicted", f"{prediction['error']:+.2%}")
        if prediction.get("other_data"):
            table.add_row("note", prediction["other_data"])
    for branch in summary["branches"]:
        table.add_row(f"cooldown from step {branch['step']:,} ({branch['run']})", branch_line(branch))
    if "plan" in summary:
        against = summary["plan"]
        for key, label, form in PLANNED:
            entry = against[key]
            if entry["planned"] is not None:
                table.add_row(f"planned {label} on {against['devices']} x {against['device']}",
                              format(entry["planned"], form)
                              + (f" (measured {entry['ratio']:.3g}x)" if entry["ratio"] is not None else ""))
    for kind in ("resume", "rewind", "hang", "diverged"):
        count = sum(e["kind"] == kind for e in summary["events"])
        if count:
            table.add_row(f"{kind} events", str(count))
    out.print(table)
    out.print(f"wrote {', '.join(summary['files'])}", soft_wrap=True, highlight=False)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from scaletrain.report.compare import compare_runs

    check_output_file(args.out, "--out")
    if not os.path.splitext(args.out)[1]:
        args.out += ".png"  # (what matplotlib writes for a name without a suffix)
    check_output_file(args.out, "--out", plot_suffixes())
    _distinct([str(Path(run).resolve()) for run in args.run_dirs], "the run directories", UserError)
    rows = compare_runs(args.run_dirs, args.out, x=args.x)
    # Runs on other mixtures weigh their validation loss differently: their sources compare.
    sources = sorted({name for row in rows for name in (row["val_loss_by_source"] or {})})
    sources = sources if len(sources) > 1 else []
    table = Table(title=f"{len(rows)} runs")
    for column in ("run", "parameters", "steps", "tokens", "FLOPs", "train loss", "validation loss", "best validation",
                   *(f"val {name}" for name in sources), "tokens/s", "goodput"):
        table.add_column(column, justify="left" if column == "run" else "right")

    def marked(value: float | None, values) -> str:
        lowest = min((v for v in values if v is not None), default=None)
        return _num(value) + (" *" if value is not None and value == lowest else "")

    by_source = [[(r["val_loss_by_source"] or {}).get(name) for r in rows] for name in sources]
    for row in rows:
        table.add_row(row["name"], f"{row['parameters']:,}", f"{row['step']:,} / {row['total_steps']:,}",
                      f"{row['tokens']:,}", f"{row['flops']:.3g}", _num(row["train_loss"]),
                      marked(row["val_loss"], [r["val_loss"] for r in rows]), _num(row["best_val_loss"]),
                      *(marked((row["val_loss_by_source"] or {}).get(name), values)
                        for name, values in zip(sources, by_source)),
                      f"{row['tokens_per_s']:,.0f}", f"{row['goodput']:.1%}" if row["goodput"] is not None else "-")
    out.print(table)
    out.print(f"wrote {args.out} (losses against {args.x}; * the lowest final validation loss"
              + (": a run's validation loss weighs the sources by its own data.mix, so runs on other mixtures "
                 "compare by source" if sources else "") + ")", highlight=False)
    return 0


# -- export ---------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from scaletrain.hf import export_hf

    result = export_hf(args.run_dir, args.out, dtype=args.dtype, step=args.step,
                       max_shard_bytes=args.max_shard_size, average=args.average, ema=args.ema)
    what = "moving averages of the weights" if args.ema else "weights"
    averaged = (f" (the mean of {args.average} checkpoints' {what}, ending there)" if args.average > 1
                else " (its moving average of the weights)" if args.ema else "")
    out.print(f"wrote {result.out}: {result.architecture} from step {result.step:,}{averaged}, "
              f"{result.bytes / 2**20:,.1f} MiB of weights in {args.dtype} ({', '.join(result.files)})")
    return 0


# -- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from scaletrain.plan.cost import LLAMA3_FAILURES_PER_DEVICE_HOUR

    parser = argparse.ArgumentParser(prog="scaletrain", description="Pre-train language models by plan.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_Version, nargs=0, help="show scaletrain's version and torch's, and exit")
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="prepare text into token shards").add_subparsers(dest="data_command",
                                                                                             required=True)
    p = data.add_parser("prepare", help="train a tokenizer and write token shards",
                        description="Read text sources, train (or reuse) a byte-level BPE tokenizer and write "
                                    "token shards, a validation split, stats.json and manifest.json to --out.")
    p.add_argument("sources", nargs="+", metavar="SRC",
                   help="directories, globs or files of text, .jsonl (or .json of JSON lines), .parquet, any "
                        "of them but .parquet compressed (.gz, .bz2, .xz, .zst); or builtin:python-stdlib, "
                        "builtin:python-packages")
    p.add_argument("--out", type=_out_dir, required=True, help="data directory to write")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default 8192; not with --tokenizer)")
    p.add_argument("--max-bytes", type=_bytes, default=None, help="stop reading after this much text (e.g. 50M)")
    p.add_argument("--text-field", default="text", help="field of .jsonl / column of .parquet holding the text")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json instead of training one")
    p.add_argument("--no-bos", action="store_true",
                   help="do not begin documents with a given tokenizer's beginning-of-sequence token (a Llama "
                        "tokenizer's <s> or <|begin_of_text|>, which its models saw before every document)")
    p.add_argument("--fim-rate", type=float, default=0.0, metavar="R",
                   help="fill-in-the-middle for code: this share of training documents cut at two random characters "
                        "and written prefix, suffix, middle between sentinel tokens, so that a model learns to infill "
                        "(0; StarCoder and DeepSeek-Coder: 0.5)")
    p.add_argument("--fim-spm-rate", type=float, default=0.5, metavar="R",
                   help="of those, the share in suffix-prefix-middle order (0.5)")
    p.add_argument("--tokenizer-sample", type=_bytes, default=None, metavar="BYTES",
                   help="train the tokenizer on a sample of about this much of the training text (e.g. 1G; default: "
                        "all of it)")
    _validation_options(p)
    p.add_argument("--workers", type=int, default=None, help="processes that curate and tokenize (default: all cores)")
    p.add_argument("--filters", default="default",
                   help="curation: 'default' (normalise, quality and repetition filters), 'none', or a TOML file")
    p.add_argument("--no-dedup", action="store_true", help="keep exact and near duplicates")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished prepare of other sources or options in --out, or discard the unfinished "
                        "work of one (refused without it: runs trained on a finished one could no longer resume)")
    p.add_argument("--no-val-overlap", action="store_true",
                   help="keep training documents that share a 13-gram with a validation document (by default they "
                        "go, so that the validation loss is not measured on text trained on)")
    p.add_argument("--split", choices=("file", "paragraph", "line"), default="file",
                   help="a text file's documents: the whole file (the default), its paragraphs between blank lines, "
                        "or its lines; one long text (a book) wants paragraph or line, for a validation split and "
                        "the quality filters' length limits")
    p.add_argument("--kind", choices=("auto", "code", "prose"), default="auto",
                   help="curate every document as code or as prose; auto (the default) tells each by its file name: "
                        "a .jsonl record or .parquet row by its path or filename field, prose without one")
    p.add_argument("--minhash-bands", type=int, default=14, help="MinHash LSH bands (FineWeb: 14)")
    p.add_argument("--minhash-rows", type=int, default=8, help="MinHash rows per band (FineWeb: 8)")
    p.add_argument("--minhash-ngram", type=int, default=5, help="word n-grams MinHash compares (5)")
    p.add_argument("--decontaminate", nargs="+", default=[], metavar="FILE",
                   help="evaluation texts: drop training documents sharing a 13-gram with any of them")
    p.add_argument("--keep-rejects", action="store_true", help="write dropped documents to OUT/rejects/REASON/")
    p.add_argument("--chunk-bytes", type=_bytes, default=None,
                   help="input per resumable unit of work (default 64 MiB, the library's)")
    p.set_defaults(func=cmd_data_prepare)

    p = data.add_parser("import", help="make a data directory of tokens another framework wrote (Megatron-LM's "
                                       "indexed datasets, nanoGPT's and OLMo's token files)",
                        description="Copy already tokenized documents into token shards, a validation split and the "
                                    "tokenizer they were made with, as data prepare writes them: no curation, "
                                    "deduplication or re-tokenization.")
    p.add_argument("sources", nargs="+", metavar="SRC",
                   help="a Megatron-LM dataset's prefix (PREFIX.bin and PREFIX.idx), a .parquet of a document's "
                        "token ids a row, or a file of tokens whose documents each end with the end-of-document id "
                        "(nanoGPT's train.bin, an OLMo .npy memmap, a NumPy .npy)")
    p.add_argument("--out", type=_out_dir, required=True, help="data directory to write")
    p.add_argument("--tokenizer", required=True, help="the tokenizer.json the tokens were made with")
    p.add_argument("--format", choices=("auto", "megatron", "flat", "parquet"), default="auto",
                   help="megatron where PREFIX.idx exists, parquet for a .parquet file (auto), else flat")
    p.add_argument("--column", default=None, help="a .parquet file's column of token ids (default input_ids)")
    p.add_argument("--dtype", choices=("uint16", "uint32", "int32"), default=None,
                   help="a raw file's token type (default: uint16 where the tokenizer's ids fit, else uint32)")
    p.add_argument("--eos-id", type=int, default=None,
                   help="the end-of-document id (default: the tokenizer's end-of-text token)")
    _validation_options(p)
    p.add_argument("--overwrite", action="store_true", help="replace a data directory in --out")
    p.set_defaults(func=cmd_data_import)

    p = data.add_parser("stats", help="summarise a prepared data directory and plot its document lengths")
    p.add_argument("data_dir", help="a directory written by `scaletrain data prepare`")
    p.add_argument("--top", type=_count, default=20, help="how many of the most frequent tokens to list")
    p.add_argument("--plot", default=None, help="where to write the length histogram (default DIR/lengths.png)")
    p.set_defaults(func=cmd_data_stats)

    p = commands.add_parser("train", help="train or resume a run from a TOML config",
                            description="Train the run a TOML config describes; resumes from the run directory's "
                                        "newest complete checkpoint when there is one.")
    p.add_argument("config", help="TOML config, e.g. configs/tiny.toml")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value", help="override config values")
    p.add_argument("--nproc", type=_count, default=1,
                   help="processes to start on this node (through torchrun); the layout is the config's [parallel]")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="end this invocation after step K (with a checkpoint) without changing the schedule")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="times torchrun starts every process (one without --nproc) again after one fails or "
                        "hangs (train.hang_timeout_s); they resume from the newest checkpoint (0)")
    p.add_argument("--time-limit", type=_wall_seconds, default=None, metavar="DURATION",
                   help="e.g. 3h50m: once this long has passed since the command started, finish the step under way "
                        "(within two under several processes), save a checkpoint and end with status 0; leave room "
                        "for a step and a save in it (an allocation's end, a spot instance's)")
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # (--time-limit's, for workers)
    p.set_defaults(func=cmd_train)

    p = commands.add_parser("cooldown", help="branch a learning-rate decay off a checkpoint of a run's stable stretch",
                            description="Write and train a run that takes RUN_DIR's checkpoint of step K (weights, "
                                        "optimizer, data position) and decays the learning rate over --steps more "
                                        "steps: the loss the run would reach annealed there (run it again to resume).")
    p.add_argument("run_dir", help="the run directory to branch from, e.g. runs/7b")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="override the branch's config values")
    p.add_argument("--step", type=int, required=True, help="the checkpoint of this step, on the stable stretch")
    p.add_argument("--steps", type=int, required=True, help="steps of the decay")
    p.add_argument("--decay-shape", default=None, help="linear, 1-sqrt or cosine (default the run's train.decay_shape)")
    p.add_argument("--name", default=None, type=_given("a run name"),
                   help="the branch's run.name (default RUN-cooldown-K)")
    p.add_argument("--nproc", type=_count, default=1, help="processes to start on this node (through torchrun)")
    p.add_argument("--stop-at-step", type=int, default=None, help="end this invocation after step K (with a checkpoint)")
    p.add_argument("--max-restarts", type=int, default=0, help="times torchrun starts the processes (one without --nproc) again after a failure")
    p.add_argument("--time-limit", type=_wall_seconds, default=None, metavar="DURATION",
                   help="as train's: once this long has passed, save and end with status 0 (e.g. 3h50m)")
    p.set_defaults(func=cmd_cooldown)

    p = commands.add_parser("launch", help="write a Slurm script or Kubernetes manifest that trains on many nodes")
    p.add_argument("launcher", choices=["slurm", "k8s"])
    p.add_argument("config", help="TOML config, e.g. configs/llama-1b.toml")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value", help="override config values")
    p.add_argument("--nodes", type=int, required=True, help="machines")
    p.add_argument("--gpus-per-node", type=int, required=True, help="processes (GPUs) per machine")
    p.add_argument("--image", default=None, help="k8s: container image with scaletrain installed (scaletrain:latest)")
    p.add_argument("--volume", default=None, metavar="CLAIM[:PATH]",
                   help="k8s: a PersistentVolumeClaim every pod mounts at PATH (/workspace), their working directory: "
                        "where the config's data and runs/ lie, so that checkpoints outlive the pods (and where a "
                        "relative CONFIG path is read from)")
    p.add_argument("--out", default=None, help="file to write (default: print)")
    p.add_argument("--grace", type=int, default=180,
                   help="seconds between SIGTERM (time limit near, preemption) and the kill: enough for a step or "
                        "two and a checkpoint (180)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="times torchrun starts every process again after one fails or hangs; they resume from the "
                        "newest checkpoint (3)")
    p.add_argument("--time-limit", type=_wall_seconds, default=None, metavar="DURATION",
                   help="train's --time-limit for the job: that long after each node's torchrun started, every "
                        "process finishes its step, saves and ends with status 0 (keep it below the scheduler's "
                        "own limit by a step and a save)")
    p.set_defaults(func=cmd_launch)

    p = commands.add_parser("plan", help="choose model, tokens and layout for a budget and hardware; predict "
                                         "memory, time, failures, energy and cost",
                            description="Plan a run before it starts: size the model for a compute budget from a "
                                        "scaling law (or take a config's), search the parallel layout for the "
                                        "hardware, predict memory per device, step time, MFU, wall-clock with "
                                        "failures and checkpoints, energy and cost; write the config to train it.")
    p.add_argument("config", nargs="?", default=None, help="a run config to plan as it is (model and tokens kept)")
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides of the config, e.g. train.tokens=1e9")
    p.add_argument("--compute", type=_flops, default=None, metavar="C", help="training FLOPs to size the model for")
    p.add_argument("--hours", type=_flops, default=None, metavar="H",
                   help="wall-clock to fill instead: the law's model that finishes in H hours on these devices")
    p.add_argument("--law", default=None, help="a law.json of `scaletrain fit` to size with (and predict the loss)")
    p.add_argument("--preset", default=None, help="published law to size with when no --law: epoch (the default), "
                                                  "hoffmann")
    p.add_argument("--inference-tokens", type=_flops, default=None,
                   help="lifetime inference tokens: the smaller model reaching the same loss (Sardana et al. 2023)")
    p.add_argument("--unique-tokens", type=_flops, default=None,
                   help="unique training tokens available (Muennighoff et al. 2023's data-constrained optimum)")
    p.add_argument("--params", type=_flops, default=None, metavar="N", help="plan a model of about N parameters")
    p.add_argument("--tokens", type=_flops, default=None, metavar="D", help="with --params: training tokens")
    p.add_argument("--gpu", default="H100 SXM", help="device from the catalog (default 'H100 SXM'): "
                   "H100 SXM, H100 PCIe, H100 NVL, H200, H200 NVL, A100, A100 40GB, A100 PCIe, A100 40GB PCIe, L4, "
                   "L40S, A10, A10G, RTX 4090, B200, GB200, MI300X; or the name torch gives it, e.g. 'NVIDIA "
                   "A100-SXM4-40GB'")
    p.add_argument("--gpus", type=_count, default=8, help="devices to plan for (8)")
    p.add_argument("--gpus-per-node", type=_count, default=None, help="devices per node (the device's usual: 8)")
    p.add_argument("--hardware", default=None, help="a JSON file of device figures replacing the catalog's "
                                                    "(memory_gb, peak_tflops, memory_bandwidth_gbs, intra_node_gbs, "
                                                    "inter_node_gbs, watts, gpus_per_node)")
    p.add_argument("--inter-node-gbps", type=_flops, default=None,
                   help="network bandwidth per device in Gb/s (default 400; 100 for V100 and T4 hosts)")
    p.add_argument("--seq-len", type=_count, default=4096, help="tokens per sequence, without a config (4096)")
    p.add_argument("--vocab", type=_count, default=None, help="vocabulary size, without a config or --data (32768)")
    p.add_argument("--global-batch-tokens", type=_count, default=None,
                   help="fix the batch (default: the rule's for the compute, rounded for the layout)")
    p.add_argument("--hparams", default=None, metavar="FILE",
                   help="the learning-rate and batch rule of a run sized here (a config keeps its own): a hparams.json of "
                        "`scaletrain hparams` (default DeepSeek LLM's)")
    p.add_argument("--data", default=None, help="prepared data directory for the written config (and its vocabulary)")
    p.add_argument("--name", default=None, type=_given("a run name"),
                   help="run.name of the written config (default: the --write-config file's name without .toml)")
    p.add_argument("--price", type=_amount, default=None, help="price of a device-hour, for the cost")
    p.add_argument("--pue", type=_pue, default=1.2, help="power usage effectiveness of the data centre (1.2)")
    p.add_argument("--watts", type=_amount, default=None, help="power per device (default: its maximum board power)")
    p.add_argument("--failure-rate", type=_amount, default=LLAMA3_FAILURES_PER_DEVICE_HOUR,
                   help="failures per device-hour (default: Llama 3's, one per ~50,700; 0: none)")
    p.add_argument("--restart-minutes", type=_amount, default=10.0,
                   help="minutes from a failure to training again (10)")
    p.add_argument("--sync-checkpoints", action="store_true", help="plan blocking checkpoint writes, not async")
    p.add_argument("--top", type=_count, default=5, help="layouts to show (5)")
    p.add_argument("--keep-layout", action="store_true",
                   help="with a config: plan its own layout (parallel sizes over --gpus, schedule, micro-batch, "
                        "recomputation) instead of the search's best, which are listed after it")
    p.add_argument("--context-parallel", choices=("auto", "yes", "no"), default="auto",
                   help="search layouts that split each sequence over devices: auto (the default) only when "
                        "nothing fits without them, as for very long sequences (their attention is modelled, not yet "
                        "timed on a GPU), yes to weigh them against the rest, no never")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--write-config", default=None, metavar="FILE", help="write the config that trains the plan")
    p.set_defaults(func=cmd_plan)

    p = commands.add_parser("sweep", help="train an IsoFLOP grid of small models for fitting scaling laws",
                            description="For each compute budget, train shapes spanning ~10x in parameters around "
                                        "the expected optimum for D = C / (FLOPs per token) tokens; one constant-LR "
                                        "trunk per shape with a cooldown branch per budget. Rerun to resume.")
    p.add_argument("--data", required=True, type=_data_dir, help="a data directory written by `scaletrain data prepare`")
    p.add_argument("--budgets", required=True, type=lambda text: _distinct([_flops(x) for x in text.split(",")],
                                                                           "--budgets"),
                   help="training FLOPs of each IsoFLOP profile, comma-separated, e.g. 1e12,3e12,1e13")
    p.add_argument("--shapes", type=_count, default=5, help="models per budget (5)")
    _small_runs(p, "point", "points of a budget", "centres the first budgets", 250,
                "plan no point shorter than this many optimizer steps (250): shorter runs are set by their few "
                "updates, not by N and D, and bend the fit")
    p.add_argument("--mix", type=_weights, default=None,
                   help="train every point on this mixture of the data directories under --data, e.g. "
                        "code=0.3,prose=0.7 (data.mix; what `scaletrain mixture` chose): the law of the data you will "
                        "train on")
    p.add_argument("--out", type=_out_dir, default=None, help="sweep directory (default sweeps/DATA_NAME)")
    p.add_argument("--predict-time", action="store_true",
                   help="train nothing: time three of the sweep's shapes here (about 2 s each, less for a short "
                        "sweep; --concurrency at once) and print its points, FLOPs and predicted wall-clock by budget")
    p.set_defaults(func=cmd_sweep)

    p = commands.add_parser("mixture", help="choose a data mixture: small runs on sampled mixtures, a data mixing "
                                            "law fitted to their losses, the mixture it predicts best",
                            description="Train one small proxy model per sampled mixture of the sources under --data, "
                                        "fit L_i(r) = E_i + 1 / sum_j C_ij r_j^g_ij to each source's validation loss "
                                        "(Shukor et al. 2025) and choose the mixture that minimises the target loss. Rerun to "
                                        "resume, or to choose again for another --target or --tokens.")
    p.add_argument("--data", required=True, type=_data_dir, help="the directory holding the sources' data directories (as data.path "
                                                 "of a mixture)")
    p.add_argument("--sources", default=None, help="the data directories under --data to mix, comma-separated "
                                                   "(default: every one but --target-data's)")
    p.add_argument("--budget", required=True, type=_flops, help="training FLOPs of each proxy run, e.g. 1e15")
    p.add_argument("--runs", type=int, default=None,
                   help="proxies (default max(8, 4 x sources): about twice the law's numbers per validation source)")
    p.add_argument("--target", type=_weights, default=None,
                   help="the loss to minimise, as weights of the validation losses (the sources' and --target-data's "
                        "by directory name), e.g. code=1,prose=3 (default --target-data's, else every source alike)")
    p.add_argument("--target-data", default=None,
                   help="a data directory none of the proxies trains on (one tokenizer with the sources), whose "
                        "validation loss every proxy is also measured on and which is then the default target")
    p.add_argument("--tokens", type=_flops, default=None,
                   help="tokens of the run the mixture is for: no source's share may repeat it more than 4 times")
    _small_runs(p, "proxy", "proxies", "sizes the proxy compute-optimally for the budget", 100,
                "refuse a budget that trains fewer steps (100)")
    p.add_argument("--check", action="store_true",
                   help="train one more proxy on the chosen mixture and set its target loss against the prediction")
    p.add_argument("--out", type=_out_dir, default=None, help="search directory (default mixtures/DATA_NAME)")
    p.add_argument("--predict-time", action="store_true",
                   help="train nothing: time the proxy here (a few seconds, --concurrency at once) and print the search's "
                        "FLOPs and predicted wall-clock (of the runs left, where --out holds a search begun)")
    p.set_defaults(func=cmd_mixture)

    p = commands.add_parser("hparams", help="measure the learning-rate and batch rule: a grid of small runs per "
                                            "budget, the best of each, power laws in the compute",
                            description="At each budget, train the prior law's compute-optimal model at the prior "
                                        "rule's learning rate and batch times --lrs and --batches, find the best, "
                                        "and fit lr = a C^b and batch = c C^d (DeepSeek LLM's procedure) with "
                                        "bootstrap intervals; write hparams.json for sweep, mixture and plan "
                                        "--hparams. Rerun to resume.")
    p.add_argument("--data", required=True, type=_data_dir, help="a data directory written by `scaletrain data prepare`")
    p.add_argument("--budgets", required=True, type=lambda text: _distinct([_flops(x) for x in text.split(",")],
                                                                           "--budgets"),
                   help="training FLOPs of each run, comma-separated, two or more, e.g. 1e10,3e10,1e11")
    p.add_argument("--lrs", type=lambda text: [_flops(x) for x in text.split(",")], default=[0.25, 0.5, 1.0, 2.0, 4.0],
                   help="learning rates as factors of DeepSeek's rule at each budget (0.25,0.5,1,2,4)")
    p.add_argument("--batches", type=lambda text: [_flops(x) for x in text.split(",")], default=[0.5, 1.0, 2.0],
                   help="batch sizes as factors of DeepSeek's rule at each budget (0.5,1,2)")
    p.add_argument("--predict", type=_flops, action="append", metavar="C",
                   help="training FLOPs to give the law's learning rate and batch for, with intervals (repeatable)")
    p.add_argument("--check", type=_flops, action="append", metavar="C",
                   help="after the fit, train the compute-optimal model at C FLOPs (above the budgets) with the law's "
                        "learning rate and batch and with DeepSeek's, and compare their losses (repeatable)")
    _small_runs(p, "run", "runs", "sizes each budget's model compute-optimally", 100,
                "leave out batches that train fewer steps (100)", hparams=False)
    p.add_argument("--mix", type=_weights, default=None,
                   help="train every run on this mixture of the data directories under --data (as sweep --mix)")
    p.add_argument("--bootstrap", type=_count, default=200, help="bootstrap resamples for the intervals (200)")
    p.add_argument("--out", type=_out_dir, default=None, help="search directory (default hparams/DATA_NAME)")
    p.add_argument("--predict-time", action="store_true",
                   help="train nothing: time three of the grid's shapes here (a few seconds each, --concurrency at once) "
                        "and print its FLOPs and predicted wall-clock (of the runs left, where --out holds a search "
                        "begun)")
    p.set_defaults(func=cmd_hparams)

    p = commands.add_parser("tune", help="find the learning rate of a muP config on its small proxy",
                            description="Train the config's model narrowed to model.mup_base_dim (and made as shallow "
                                        "as model.mup_base_layers) once per learning rate, and keep the rate of the "
                                        "lowest validation loss: under muP the best rate of the small model is the "
                                        "large one's.")
    p.add_argument("config", help="TOML config with model.mup_base_dim or model.mup_base_layers set")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="override config values (of the proxies and of the config --write-config writes)")
    p.add_argument("--steps", type=_count, default=None,
                   help="train each proxy this many steps (default: the run's length); the written config keeps its own")
    p.add_argument("--lrs", type=lambda text: _two_or_more(_distinct([_lr(part) for part in text.split(",")], "--lrs"),
                                                           "learning rates"), default=None,
                   help="learning rates to try, comma-separated (default: 2^-11 to 2^-5, a factor of 2 apart)")
    p.add_argument("--out", type=_out_dir, default=None, help="directory of the proxy runs and tune.json (runs/NAME-tune)")
    p.add_argument("--concurrency", type=_workers, default=1,
                   help="proxies trained at once, in worker processes (GPUs taken in turn)")
    p.add_argument("--write-config", default=None, metavar="FILE",
                   help="write the config with train.lr set to the best rate")
    p.set_defaults(func=cmd_tune)

    p = commands.add_parser("fit", help="fit scaling laws to a sweep's results and predict from them",
                            description="Fit L(N, D) = E + A/N^α + B/D^β (approach 3) and N_opt, D_opt ∝ C^a, C^b "
                                        "(approaches 1 and 2) with bootstrap intervals; write law.json and plots.")
    p.add_argument("sweep_dir", nargs="?", default=None, help="a sweep directory (its results.csv)")
    p.add_argument("--points", default=None, help="a CSV of points instead: columns n, c (or d), loss[, budget]")
    p.add_argument("--drop-highest", type=_how_many, default=0, help="leave out this many points of highest loss")
    p.add_argument("--min-steps", type=_how_many, default=0,
                   help="fit approach 3 only to points of at least this many optimizer steps (0: all); the demo "
                        "fits at 500 (twice its sweep's --min-steps): short runs are early in training and bend "
                        "the law")
    p.add_argument("--bootstrap", type=_count, default=200, help="bootstrap resamples for the intervals (200)")
    p.add_argument("--predict", type=_flops, action="append", metavar="C",
                   help="training FLOPs to predict N_opt, D_opt and loss for (repeatable); from a sweep "
                        "directory, also the shape of its family to train there, with its config written beside "
                        "law.json")
    p.add_argument("--inference-tokens", type=_flops, default=None,
                   help="with --predict: lifetime inference tokens, for inference-aware sizing (Sardana et al. 2023)")
    p.add_argument("--unique-tokens", type=_flops, default=None,
                   help="with --predict: unique training tokens available, for data-constrained sizing "
                        "(Muennighoff et al. 2023)")
    p.add_argument("--preset", default=None, help="predict from a published law instead: hoffmann, epoch")
    p.add_argument("--out", type=_out_dir, default=None, help="where law.json and the plots go (default: beside the points)")
    p.set_defaults(func=cmd_fit)

    p = commands.add_parser("demo", help="the whole loop on the built-in corpus: sweep, fit, predict, train, check",
                            description="Prepare the built-in corpus, sweep an IsoFLOP grid, fit the scaling law, "
                                        "predict the optimum at a budget beyond the sweep, train it and print "
                                        "predicted against actual loss.")
    p.add_argument("--out", type=_out_dir, default="demo", help="directory for data, sweep and runs (default demo/)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the sweep's points and the final run (0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda runs the larger version (budgets 3e14-3e15 FLOPs, final run 3e16)")
    p.add_argument("--minutes", type=float, default=None,
                   help="finish within this many minutes: time the sweep's shapes here, predict the sweep's and the "
                        "final run's wall-clock, and scale every budget down until they fit (default 10; 8 with "
                        "--device cuda; 0: no limit, the budgets as given)")
    p.set_defaults(func=cmd_demo)

    p = commands.add_parser("generate", help="sample text from a run's newest checkpoint (or another)")
    p.add_argument("run_dir", help="run directory, e.g. runs/demo")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--suffix", default=None,
                   help="fill in the middle: the text after the gap, --prompt the text before it (a model trained on "
                        "data prepared with --fim-rate)")
    p.add_argument("--max-new-tokens", type=_count, default=200)
    p.add_argument("--temperature", type=_temperature, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=_how_many, default=50, help="sample among the k likeliest tokens; 0 for all")
    p.add_argument("--top-p", type=_top_p, default=None,
                   help="and among the likeliest whose probabilities sum to p (nucleus sampling, e.g. 0.95)")
    p.add_argument("--samples", type=_count, default=1, help="continuations to sample, together (1)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--average", type=_count, default=1, metavar="K",
                   help="the mean of the weights of that checkpoint and the K-1 complete ones before it (1)")
    p.add_argument("--ema", action="store_true",
                   help="the checkpoint's moving average of the weights (train.ema_decay) instead of its weights")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run the model: auto (a GPU where there is one), cpu or cuda")
    p.set_defaults(func=cmd_generate)

    p = commands.add_parser("eval", help="validation loss and tasks of a run's checkpoints, on its data or other",
                            description="Measure what training's evaluations measure (validation loss and bits "
                                        "per byte, each source's in a mixture, eval.tasks) for a run's newest "
                                        "checkpoint, the checkpoints of --step, or every kept one (--all): on the "
                                        "run's data or other data prepared with its tokenizer, with other tasks or "
                                        "at another sequence length. Or for a Hugging Face model (Llama, Mistral, Qwen3 "
                                        "and their mixtures of experts) on --data prepared with its tokenizer: a "
                                        "baseline. Nothing in the run directory changes.")
    p.add_argument("run_dir", metavar="RUN_OR_MODEL_DIR",
                   help="run directory, e.g. runs/demo; a Hugging Face model directory (with --data); or a sweep "
                        "directory (with --out FILE.csv)")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="change the run's settings for the evaluation, e.g. eval.tokens=1000000 data.seq_len=1024 "
                        "train.device=cpu parallel.tp=2 (the layout: all FSDP unless given)")
    p.add_argument("--step", type=int, action="append", default=None,
                   help="the checkpoint of this step (repeat for more; default: the newest)")
    p.add_argument("--all", dest="every", action="store_true", help="every complete checkpoint, oldest first")
    p.add_argument("--data", default=None, help="a data directory prepared with the run's tokenizer, instead of "
                                                "the run's data (its validation split)")
    p.add_argument("--tasks", nargs="*", default=None, metavar="TASK.jsonl",
                   help="multiple-choice tasks instead of the run's eval.tasks (none: no tasks)")
    p.add_argument("--average", type=int, default=1, metavar="K",
                   help="evaluate each chosen checkpoint as the mean of its weights and the K-1 complete "
                        "checkpoints' before it (with --all: each that has K-1 before it) (1)")
    p.add_argument("--ema", action="store_true",
                   help="evaluate each chosen checkpoint's moving average of the weights (train.ema_decay); "
                        "with --average, the mean of the K checkpoints' moving averages")
    p.add_argument("--out", default=None, help="also write a JSON line per checkpoint to this file (of a sweep: "
                                               "the CSV of its points, for `fit --points`)")
    p.add_argument("--metric", default="loss", metavar="loss|bits_per_byte|task_nll:TASK",
                   help="of a sweep: the number its points' loss column holds, what `fit` fits (loss)")
    p.add_argument("--nproc", type=_count, default=1, help="processes to start on this node (through torchrun)")
    p.set_defaults(func=cmd_eval)

    p = commands.add_parser("report", help="summarise a run (losses, speed, events; against a law's prediction)",
                            description="Write plots (loss.png, speed.png and, where the run logged what they "
                                        "show, batch.png, progress.png, norms.png, tasks.png) and a self-contained report.html "
                                        "into the run directory and print its summary; with --law, the law's predicted final "
                                        "loss for this model and token count beside the loss reached.")
    p.add_argument("run_dir", help="run directory, e.g. demo/final")
    p.add_argument("--law", default=None, help="a law.json written by `scaletrain fit` (or the demo's sweep)")
    p.add_argument("--plan", default=None, help="the plan the run was written from (the .plan.json that "
                                                "`plan --write-config` writes, or `plan --json`'s output)")
    p.set_defaults(func=cmd_report)

    p = commands.add_parser("compare", help="several runs side by side: losses on one plot, a table of what each "
                                            "reached and cost",
                            description="Draw the runs' train and validation losses against tokens, training FLOPs "
                                        "(at equal compute) or wall-clock into one PNG and print a row per run.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, e.g. runs/baseline runs/mtp")
    p.add_argument("--x", choices=("tokens", "flops", "hours"), default="tokens",
                   help="the plot's horizontal axis (default tokens)")
    p.add_argument("--out", default="compare.png", help="the plot's path (default compare.png)")
    p.set_defaults(func=cmd_compare)

    p = commands.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory",
                            description="Write config.json, safetensors weights, the tokenizer and a model card "
                                        "that transformers' AutoModelForCausalLM and AutoTokenizer load "
                                        "(LlamaForCausalLM; Qwen3ForCausalLM with QK-norm).")
    p.add_argument("run_dir", help="run directory, e.g. demo/final")
    p.add_argument("--out", type=_out_dir, required=True, help="directory to write (new or empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights' dtype (float32: exactly as trained)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--average", type=int, default=1, metavar="K",
                   help="the mean of the weights of that checkpoint and the K-1 complete ones before it (1)")
    p.add_argument("--ema", action="store_true",
                   help="the checkpoint's moving average of the weights (train.ema_decay) instead of its weights; "
                        "with --average, the mean of the K checkpoints' moving averages")
    p.add_argument("--max-shard-size", type=_bytes, default="5G",
                   help="split the weights into files of at most this size (5G, Hugging Face's default)")
    p.set_defaults(func=cmd_export)
    return parser


def _negative_values(argv: list[str]) -> list[str]:
    """`--option -1e12` as `--option=-1e12`: argparse takes a word starting with '-' for an option
    unless it reads as a plain number (-1, -0.5), so `--minutes -1e3`, `--budgets -inf` or
    `--time-limit -5m` got "expected one argument" instead of the option's own check saying what
    would do. (A number with a unit's letters after it too: -5m, -1M, -5GB.)"""
    number = re.compile(r"-(\d+\.?\d*|\.\d+|inf|nan)(e[+-]?\d+)?[A-Za-z]{0,3}", re.I)
    joined: list[str] = []
    for word in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and number.fullmatch(word.split(",")[0]):
            joined[-1] = f"{joined[-1]}={word}"
            continue
        joined.append(word)
    return joined


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments; `section.key=value` overrides may also follow its options,
    those of several values included (`eval RUN --tasks A.jsonl eval.tokens=512`: argparse would
    take the override for a task file)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(_negative_values(sys.argv[1:] if argv is None else list(argv)))
    override = re.compile(r"[A-Za-z_]\w*(\.\w+)+=.*", re.S)
    if hasattr(args, "overrides"):
        for name, values in vars(args).items():
            if name != "overrides" and isinstance(values, list) and all(isinstance(v, str) for v in values):
                setattr(args, name, [v for v in values if not override.fullmatch(v)])
                args.overrides = [*args.overrides, *(v for v in values if override.fullmatch(v))]
    if extra:
        unknown = [text for text in extra if not (hasattr(args, "overrides") and override.fullmatch(text))]
        if unknown:  # (said by the command's own parser, naming only what it does not know)
            command = parser
            for chosen in (args.command, getattr(args, "data_command", None)):  # (data prepare: two levels)
                commands = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
                if commands and chosen in commands[0].choices:
                    command = commands[0].choices[chosen]
            command.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _error(message: str) -> None:
    """An error in one line, printed as it is (a path or value in brackets is not rich markup)."""
    from rich.text import Text

    console.print(Text.assemble(("error:", "red"), " ", message), highlight=False, soft_wrap=True)


def _path_problem(e: OSError) -> str:
    """What is wrong with the path of an OSError, and what would be right."""
    path = os.fspath(e.filename) if isinstance(e.filename, os.PathLike) else e.filename  # (no PosixPath('…'))
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        return f"{path!r} is a file, or lies under one, where a directory is needed; give another path"
    if isinstance(e, IsADirectoryError):
        return f"{path!r} is a directory where a file is needed; give the path of a file (new or to overwrite)"
    if isinstance(e, FileNotFoundError):
        return f"{path!r} does not exist (or its folder does not); create the folder or give another path"
    if isinstance(e, PermissionError):
        return f"no permission to use {path!r}; give a path you may write to"
    return f"{path!r}: {e.strerror or e}; give another path"


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # (argparse has said why: a worker of torchrun is not started again for it)
        if e.code == 2 and torchrun.hand_over("the command line was refused (argparse's message above)"):
            return 0
        raise
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except UserError as e:  # (one raised from another error may not happen again: a peer lost mid-load, say)
        return _refused(str(e), lasting=e.__cause__ is None)
    except OSError as e:  # a path given that cannot be used as asked: said in a sentence, not a traceback
        if e.filename is None:
            raise
        return _refused(_path_problem(e), lasting=e.errno in LASTING_ERRNOS)
    except Stopped as e:
        if int(os.environ.get("RANK", 0)) == 0:  # every rank stops alike: one says so
            with contextlib.suppress(OSError):  # (stopped by a hang-up: to a terminal that is gone)
                console.print(str(e), highlight=False, soft_wrap=True)
        return e.code
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
