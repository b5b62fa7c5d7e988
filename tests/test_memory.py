"""The planner's memory model against what training actually holds: the bytes autograd saves
for the backward pass (counted by a saved-tensors hook) and the parameter, gradient and
optimizer bytes a real run reports."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import ROOT, run_with_retry, tiny_config
from zygote import run_ranks, script
from scaletrain.config import ModelConfig, load_config
from scaletrain.model.flops import matmul_params
from scaletrain.model.llama import Transformer, document_ids, shifted_targets
from scaletrain.plan.memory import (activation_bytes_per_token, block_bytes_per_token, choose_recompute,
                                    in_flight_microbatches, pipeline_ranks, rank_memory, training_memory)
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

SHAPES = [dict(dim=128, n_layers=3, n_heads=4, n_kv_heads=2), dict(dim=96, n_layers=2, n_heads=3, ffn_dim=160),
          dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True),
          # Mixtures: top-2 (renormalised) after a dense block; top-1 by sigmoid with a shared expert.
          dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160, moe_experts=8, moe_top_k=2, moe_ffn_dim=40,
               moe_dense_layers=1),
          dict(dim=64, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=1, moe_ffn_dim=40, moe_shared_experts=1,
               moe_score="sigmoid")]


def _not_activations(model: Transformer):
    """A test of a tensor (storage address, dtype, shape) that the estimate counts elsewhere:
    the parameters and buffers (and views of them), and autocast's 16-bit copies of the weights
    (the estimate's weight_copies), each expert's slice of the stacked expert weights too, which
    autocast copies one by one."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    weight_shapes = {shape for p in model.parameters() for whole in (tuple(p.shape), tuple(p.shape)[-2:])
                     for shape in (whole, whole[::-1])}
    return lambda ptr, dtype, shape: ptr in own or (dtype in (torch.bfloat16, torch.float16)
                                                    and tuple(shape) in weight_shapes)


@contextlib.contextmanager
def counting_saves(model: Transformer):
    """Within it, the bytes of the distinct tensors autograd saves for backward (a dict of
    storage -> bytes, filled as they are saved), but for _not_activations."""
    elsewhere = _not_activations(model)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if not elsewhere(ptr, t.dtype, t.shape):
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


class _Made(TorchDispatchMode):
    """Every storage the ops within it make: (address, weak reference, bytes, dtype, shape)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[int, StorageWeakRef, int, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made.append((s.data_ptr(), StorageWeakRef(s), s.nbytes(), t.dtype, tuple(t.shape)))
        return out


@contextlib.contextmanager
def keeping_alive(model: Transformer):
    """Within it, nothing; on leaving it, the bytes of the storages the ops within it made that are
    still alive (a dict of storage -> bytes), but for _not_activations. Unlike counting_saves it sees
    what recomputation keeps: each block's input under checkpointing, the outputs a selective
    policy caches. (Torch's CausalBias cannot be made within it: not for context parallelism.)"""
    elsewhere = _not_activations(model)
    alive: dict[int, int] = {}
    with _Made() as mode:
        yield alive
    alive.update({ptr: size for ptr, ref, size, dtype, shape in mode.made
                  if not ref.expired() and not elsewhere(ptr, dtype, shape)})


def saved_bytes(model: Transformer, tokens: torch.Tensor, bf16: bool, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, counter=counting_saves) -> int:
    """Bytes the blocks keep for the backward pass, counted by `counter` (counting_saves, or
    keeping_alive where the model recomputes), for the tokens at `positions` (all from 0 when None),
    attending within `documents` if given (and the model's sliding window)."""
    with counter(model) as kept:
        x = model.tok_embeddings(tokens)
        cos, sin = (model.rope_cos, model.rope_sin) if positions is None else (model.rope_cos[positions],
                                                                               model.rope_sin[positions])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            masks = model.attention_masks(x, x.shape[1], documents, positions)
            for name, block in model.layers.items():
                x = block(x, cos, sin, bias=masks[int(name)])
        del masks, cos, sin
    for t in (tokens, x):  # (the embedding's saved indices, and the output)
        kept.pop(t.untyped_storage().data_ptr(), None)
    return sum(kept.values())


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa", "mha-ffn", "qk-norm", "moe-top2-dense", "moe-top1-shared-sigmoid"])
@pytest.mark.parametrize("bf16, stream", [(False, False), (True, False), (True, True)],
                         ids=["float32", "bf16", "bf16-stream"])
def test_predicted_activation_bytes_are_what_autograd_saves(shape, bf16, stream):
    """stream: the residual stream in bf16, as FSDP's bf16 parameters make it (here the model's
    weights in bf16, as FSDP gathers them). With each recomputation: what stays alive for the
    backward pass once the forward is done (a mixture's grouped GEMMs' outputs kept by selective)."""
    from scaletrain.parallel.recompute import apply_recompute

    cfg = ModelConfig(vocab_size=512, max_seq_len=64, **shape)
    batch, seq = 3, 64
    tokens = torch.randint(0, 512, (batch, seq))
    gathered = "bf16" if stream else None
    state = Transformer(cfg).state_dict()
    for mode in ("none", "selective", "full"):
        model = Transformer(cfg)
        model.load_state_dict(state)
        apply_recompute(model.to(torch.bfloat16 if stream else torch.float32), mode)
        measured = saved_bytes(model, tokens, bf16, counter=keeping_alive)
        predicted = activation_bytes_per_token(cfg, bf16, mode, gather_dtype=gathered) * batch * seq * cfg.n_layers
        # (Dense blocks to the byte; a mixture recomputing within 8 bytes, its balancing loss's scalars,
        # and without recomputation within 1%: its routing keeps small tensors the tally leaves out.)
        tolerance = dict(abs=0) if not cfg.moe_experts else dict(rel=0.01) if mode == "none" else dict(abs=8)
        assert measured == pytest.approx(predicted, **tolerance), mode
        if mode == "none":  # (under "full" the estimate adds the block its backward rebuilds)
            assert training_memory(cfg, seq, batch, bf16=bf16, gather_dtype=gathered).activations \
                == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_attention_within_documents_saves_one_mask_for_all_blocks(bf16, monkeypatch):
    """One bias for all blocks; and on CUDA, whose masked kernel takes no grouped heads, the
    keys and values repeated to every query head in place of the grouped ones (measured here
    with the CPU taking CUDA's path)."""
    from scaletrain.model import llama

    cfg = ModelConfig(vocab_size=512, max_seq_len=64, document_mask=True, **SHAPES[0])
    assert cfg.kv_heads < cfg.n_heads
    model = Transformer(cfg)
    batch, seq = 3, 64
    tokens = torch.randint(0, 511, (batch, seq))
    tokens[:, ::9] = 511  # documents of 8 tokens
    measured = saved_bytes(model, tokens, bf16, documents=document_ids(tokens, 511))
    assert training_memory(cfg, seq, batch, bf16=bf16, cuda=False).activations == pytest.approx(measured, rel=0.01)
    causal = cfg.model_copy(update={"document_mask": False})
    assert measured - training_memory(causal, seq, batch, bf16=bf16).activations > batch * seq**2  # the mask counts
    monkeypatch.setattr(llama, "REPEATED_KV_DEVICES", ("cuda", "cpu"))
    repeated = saved_bytes(model, tokens, bf16, documents=document_ids(tokens, 511))
    assert repeated > 1.03 * measured
    assert training_memory(cfg, seq, batch, bf16=bf16).activations == pytest.approx(repeated, rel=0.01)
    # A sliding window shorter than the sequence: one bias too, of the window's band (and none
    # where the window spans the sequence, which is causal attention).
    monkeypatch.undo()
    for window, extra in ((16, True), (64, False)):
        windowed = cfg.model_copy(update={"document_mask": False, "sliding_window": window})
        measured = saved_bytes(Transformer(windowed), tokens, bf16)
        assert training_memory(windowed, seq, batch, bf16=bf16, cuda=False).activations == pytest.approx(measured,
                                                                                                            rel=0.01)
        assert (measured > training_memory(causal, seq, batch, bf16=bf16).activations + seq * seq) == extra
    # Local and global blocks (model.full_attention_layers): within documents the documents' mask
    # beside the window's; without, the window's alone, and on CUDA's path keys and values
    # repeated in the windowed blocks only (the others take flash).
    mixed = cfg.model_copy(update={"sliding_window": 16, "full_attention_layers": [1]})
    measured = saved_bytes(Transformer(mixed), tokens, bf16, documents=document_ids(tokens, 511))
    assert training_memory(mixed, seq, batch, bf16=bf16, cuda=False).activations == pytest.approx(measured, rel=0.01)
    assert measured > saved_bytes(model, tokens, bf16, documents=document_ids(tokens, 511)) + batch * seq * seq
    # A pipeline rank builds the masks its own blocks take (model/llama.py's attention_masks): one
    # where its blocks are all windowed or all whole, where a count for the whole model says two.
    for held in (0, 1):
        stage = Transformer(mixed)
        for name in [name for name in stage.layers if name != str(held)]:
            del stage.layers[name]
        measured = saved_bytes(stage, tokens, bf16, documents=document_ids(tokens, 511))
        own = dict(blocks=1, cuda=False, bf16=bf16)
        assert rank_memory(mixed, seq, batch, layers=[held], **own).activations == pytest.approx(measured, rel=0.01)
        assert rank_memory(mixed, seq, batch, **own).activations > measured + batch * seq * seq
    spanning = mixed.model_copy(update={"sliding_window": seq})  # (one mask, the documents', for every block)
    measured = saved_bytes(Transformer(spanning), tokens, bf16, documents=document_ids(tokens, 511))
    assert training_memory(spanning, seq, batch, bf16=bf16, cuda=False).activations == pytest.approx(measured, rel=0.01)
    mixed = mixed.model_copy(update={"document_mask": False})
    monkeypatch.setattr(llama, "REPEATED_KV_DEVICES", ("cuda", "cpu"))
    measured = saved_bytes(Transformer(mixed), tokens, bf16)
    assert training_memory(mixed, seq, batch, bf16=bf16).activations == pytest.approx(measured, rel=0.01)


CP_SAVED = """
import json, sys
import torch
import torch.distributed as dist
from test_memory import saved_bytes
from scaletrain.config import ModelConfig
from scaletrain.model import llama
from scaletrain.model.llama import Transformer, document_ids
from scaletrain.parallel.context import apply_cp, local_positions, shard_sequence

dist.init_process_group("gloo")
cfg = ModelConfig(vocab_size=512, max_seq_len=128, dim=128, n_layers=2, n_heads=4, n_kv_heads=2)
model = Transformer(cfg)
apply_cp(model, dist.group.WORLD, 128)
torch.manual_seed(0)  # the same sequences on both ranks
whole = torch.randint(0, 511, (3, 128))
whole[:, ::9] = 511  # documents of 8 tokens
tokens = shard_sequence(whole, dist.get_rank(), dist.get_world_size())
positions = local_positions(128, dist.get_rank(), dist.get_world_size())
got = {bf16: saved_bytes(model, tokens, bf16, positions) for bf16 in (False, True)}
documents = saved_bytes(model, tokens, False, positions, document_ids(whole, 511))
llama.REPEATED_KV_DEVICES = ("cuda", "cpu")  # (CUDA's path: keys and values repeated for the masked kernel)
repeated = saved_bytes(model, tokens, True, positions, document_ids(whole, 511))
if dist.get_rank() == 0:
    print(json.dumps({"float32": got[False], "bf16": got[True], "float32-documents": documents,
                      "bf16-documents-cuda": repeated}))
dist.destroy_process_group()
"""


FSDP_FLOAT16 = """
import json
import torch
from test_memory import counting_saves
from scaletrain.config import ModelConfig, ParallelConfig
from scaletrain.model.llama import Transformer
from scaletrain.parallel.fsdp import apply_fsdp
from scaletrain.parallel.layout import resolve_layout
from scaletrain.parallel.mesh import init_distributed

mesh = init_distributed(torch.device("cpu"), resolve_layout(ParallelConfig(dp_shard=2), 2))
cfg = ModelConfig(vocab_size=512, max_seq_len=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
                  mtp_depth=1)
torch.manual_seed(0)
model = Transformer(cfg)
shapes = Transformer(cfg)  # (unsharded: counting_saves leaves out 16-bit tensors of its weights' shapes)
seen, counts, open_counts = [], {}, []
for name, module in [*model.layers.items(), ("mtp", model.mtp[0])]:
    module.register_forward_hook(lambda m, args, out, name=name: seen.append(
        (name, str(args[0].dtype), [str(o.dtype) for o in (out if isinstance(out, tuple) else (out,))])))
for name, block in model.layers.items():  # what each trunk block saves (counted from before FSDP's gather)
    def enter(m, args, name=name):
        open_counts.append(counting_saves(shapes))
        counts[name] = open_counts[-1].__enter__()
    block.register_forward_pre_hook(enter)
    def leave(m, args, out):
        open_counts.pop().__exit__(None, None, None)
    block.register_forward_hook(leave)
apply_fsdp(model, mesh, param_dtype=torch.float16, stream_dtype=torch.float32)
tokens = torch.randint(0, 512, (3, 65))
with torch.autocast("cpu", dtype=torch.float16):
    loss = model(tokens[:, :-1], tokens[:, 1:])
loss.backward()
grads = sorted({str(p.grad.dtype) for p in model.parameters()})
print(json.dumps({"seen": seen, "grads": grads, "saved": sum(sum(c.values()) for c in counts.values())}))
"""


def test_float16_fsdp_gathers_float16_and_hands_the_stream_on_in_float32(tmp_path):
    """Under float16, FSDP gathers float16 parameters (not float32 ones, whose autocast copies
    every rank would keep for the backward pass) and each block, and multi-token prediction's
    module, hands the residual stream on in float32, the first block taking the embedding in
    float32 too; what the blocks then keep is the memory model's float32-stream tally with
    QK-norm's 16-bit q and k. 2 gloo processes."""
    import json

    path = tmp_path / "fsdp_float16.py"
    path.write_text(FSDP_FLOAT16)
    result = run_with_retry(lambda: run_ranks(script, (str(path), []), 2, timeout=120), "2 ranks of fsdp_float16.py")
    measured = json.loads([line for line in result.stdout.splitlines() if line.startswith("[rank0] ")][-1][8:])
    assert measured["seen"][:3] == [["0", "torch.float32", ["torch.float32"]], ["1", "torch.float32", ["torch.float32"]],
                                    ["mtp", "torch.float32", ["torch.float32", "torch.float32"]]]
    assert measured["grads"] == ["torch.float32"]  # (the sharded weights and their gradients stay float32)
    cfg = ModelConfig(vocab_size=512, max_seq_len=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True)
    predicted = activation_bytes_per_token(cfg, True, "none", gather_dtype="fp16") * 3 * 64 * cfg.n_layers
    assert measured["saved"] == pytest.approx(predicted, rel=0.01)
    assert predicted < activation_bytes_per_token(cfg, True, "none") * 3 * 64 * cfg.n_layers  # (16-bit q and k)


def test_context_parallel_ranks_save_the_keys_and_values_of_the_whole_sequence(tmp_path):
    """2 gloo processes, each with half of 3 sequences of 128 tokens: the bytes autograd saves
    are the dense block's per local token plus the other rank's keys and values (the CPU's
    materialised mask adds under 1%); within documents, plus one bias of the rank's queries."""
    import json

    path = tmp_path / "cp_saved.py"
    path.write_text(CP_SAVED)
    result = run_with_retry(lambda: run_ranks(script, (str(path), []), 2, timeout=120), "2 ranks of cp_saved.py")
    measured = json.loads([line for line in result.stdout.splitlines() if line.startswith("[rank0] ")][-1][8:])
    cfg = ModelConfig(vocab_size=512, max_seq_len=128, dim=128, n_layers=2, n_heads=4, n_kv_heads=2)
    for name, bf16 in (("float32", False), ("bf16", True)):
        predicted = activation_bytes_per_token(cfg, bf16, "none", cp=2) * 3 * 64 * cfg.n_layers
        assert measured[name] == pytest.approx(predicted, rel=0.015), name
        assert predicted > activation_bytes_per_token(cfg, bf16, "none") * 3 * 64 * cfg.n_layers * 1.03
    # Within documents: one bias of this rank's 64 queries over the 128 keys, for both blocks.
    documents = cfg.model_copy(update={"document_mask": True})
    assert measured["float32-documents"] == pytest.approx(
        training_memory(documents, 128, 3, bf16=False, cp=2, cuda=False).activations, rel=0.015)
    # On CUDA each of a rank's two query chunks attends to its own repeated copy of the keys up to its end.
    assert measured["bf16-documents-cuda"] == pytest.approx(
        training_memory(documents, 128, 3, bf16=True, cp=2).activations, rel=0.015)
    # (less than the bias over the causal run: that one's materialised causal masks are gone)
    assert measured["float32-documents"] - measured["float32"] > 0.5 * 3 * 64 * 128 * 4


def test_recomputation_and_sharding_lower_the_prediction_in_order():
    cfg = ModelConfig(vocab_size=32768, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=2048)
    peaks = [training_memory(cfg, 2048, 8, recompute=mode).peak for mode in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    whole, sharded = training_memory(cfg, 2048, 8), training_memory(cfg, 2048, 8, fsdp=8)
    assert sharded.optimizer < whole.optimizer / 7
    # (FSDP's bf16 parameters make the residual stream bf16: its norms keep bf16 inputs, 4d a token and block less.)
    assert sharded.activations == whole.activations  # (as one process's weights: float32)
    assert training_memory(cfg, 2048, 8, fsdp=8, gather_dtype="bf16").activations \
        == whole.activations - 4 * cfg.dim * 2048 * 8 * cfg.n_layers
    chunked = training_memory(cfg, 2048, 8, loss_chunk_tokens=4096)
    assert chunked.loss < whole.loss / 2
    # FSDP wraps every run of more than one process, gathering over a single shard too (tensor
    # parallelism alone): two blocks' bf16 copies, as under sharding, not autocast's of every block;
    # float32 gathers under bf16 compute keep both. (From torch's world-size-1 path, read, not measured.)
    alone, wrapped, float32 = (training_memory(cfg, 2048, 8, tp=2, gather_dtype=g) for g in (None, "bf16", "fp32"))
    assert wrapped.weight_copies == training_memory(cfg, 2048, 8, tp=2, fsdp=8, gather_dtype="bf16").weight_copies
    assert wrapped.weight_copies < alone.weight_copies / 4 < float32.weight_copies / 4


@pytest.mark.parametrize("overrides", [[], ["model.moe_experts=4", "model.moe_shared_experts=1",
                                             "model.moe_dense_layers=1", "train.optimizer=muon", "train.ema_decay=0.9"],
                                       ["model.mtp_depth=2", "model.qk_norm=true", "train.optimizer=muon"]],
                         ids=["dense", "moe-muon-ema", "mtp-muon"])
def test_parameter_gradient_and_optimizer_bytes_equal_a_real_runs(stdlib_data, tmp_path, overrides):
    run_dir = tmp_path / "run"
    cfg = train(tiny_config(stdlib_data, run_dir, "train.steps=1", "eval.interval=0", *overrides)).run_dir
    held = read_metrics(cfg, "memory")[0]["bytes_by_rank"][0]
    resolved = tiny_config(stdlib_data, run_dir, "model.vocab_size=512", *overrides)
    estimate = training_memory(resolved.model, resolved.data.seq_len, resolved.train.micro_batch, micro_steps=2,
                               bf16=False, optimizer=resolved.train.optimizer, ema=resolved.train.ema_decay > 0)
    assert (estimate.parameters, estimate.gradients, estimate.optimizer, estimate.ema) == (
        held["parameters"], held["gradients"], held["optimizer"], held.get("ema", 0))
    if estimate.ema:  # the moving average of the weights raises the peak by its bytes
        without = training_memory(resolved.model, resolved.data.seq_len, resolved.train.micro_batch, micro_steps=2,
                                  bf16=False, optimizer=resolved.train.optimizer)
        assert estimate.peak - without.peak == estimate.ema == estimate.parameters


def test_the_planner_chooses_the_least_recomputation_that_fits():
    cfg = ModelConfig(vocab_size=32768, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=4096)
    peaks = {mode: training_memory(cfg, 4096, 4, recompute=mode).peak for mode in ("none", "selective", "full")}
    assert choose_recompute(cfg, 4096, 4, peaks["none"])[0] == "none"
    assert choose_recompute(cfg, 4096, 4, peaks["none"] - 1)[0] == "selective"
    assert choose_recompute(cfg, 4096, 4, peaks["selective"] - 1)[0] == "full"
    assert choose_recompute(cfg, 4096, 4, 1e9)[0] == "full"  # nothing fits: the most it can do
    mixture = cfg.model_copy(update={"moe_experts": 8, "moe_ffn_dim": 2048})
    peaks = {mode: training_memory(mixture, 4096, 4, recompute=mode).peak for mode in ("none", "selective", "full")}
    assert peaks["none"] > peaks["selective"] > peaks["full"]
    assert choose_recompute(mixture, 4096, 4, peaks["none"] - 1)[0] == "selective"
    assert choose_recompute(mixture, 4096, 4, peaks["selective"] - 1)[0] == "full"
    # A dense first block wider than the mixture's: the block rebuilt under full recomputation is the larger.
    wide = cfg.model_copy(update={"moe_experts": 16, "moe_ffn_dim": 512, "moe_dense_layers": 1, "ffn_dim": 16384})
    rebuilt = training_memory(wide, 4096, 4, recompute="full").activations - 16 * 4 * 2048 * 4096 * 4
    assert rebuilt == pytest.approx(block_bytes_per_token(wide, True, "none") * 4096 * 4)
    assert block_bytes_per_token(wide, True, "none") > block_bytes_per_token(wide, True, "none", moe=True)
    # Expert parallelism: each rank gathers 1/ep of the experts, holding the same shard of them.
    sharded, split = (training_memory(mixture, 4096, 4, fsdp=8, ep=ep) for ep in (1, 8))
    assert split.weight_copies < sharded.weight_copies and split.parameters == sharded.parameters
    # Pipelined with dense first blocks: each rank counted with the blocks it holds (rank 1 the 8
    # mixtures, as when every block is one; rank 0 the 8 dense ones), the estimate the larger peak.
    dense_first = mixture.model_copy(update={"moe_dense_layers": 8})  # 16 blocks, the last 8 mixtures
    # (Two processes: FSDP's bf16 parameters make the residual stream bf16.)
    ranks = [rank_memory(c, 4096, 4, micro_steps=8, pp=2, gather_dtype="bf16", **held)
             for c, held in pipeline_ranks(dense_first, 2, 8, "1f1b", 1)]
    all_ranks = [rank_memory(c, 4096, 4, micro_steps=8, pp=2, gather_dtype="bf16", **held)
                 for c, held in pipeline_ranks(mixture, 2, 8, "1f1b", 1)]
    assert ranks[1].parameters == all_ranks[1].parameters and ranks[0].parameters < all_ranks[0].parameters
    assert training_memory(dense_first, 4096, 4, micro_steps=8, pp=2, gather_dtype="bf16").peak \
        == max(r.peak for r in ranks)
    # Interleaved, each rank holds 2 dense and 2 mixture stages of 2 blocks: half its blocks mixtures.
    interleaved = training_memory(dense_first, 4096, 4, micro_steps=8, pp=2, pp_schedule="interleaved_1f1b",
                                  pp_stages_per_rank=4)
    assert interleaved.parameters < max(r.parameters for r in all_ranks)
    average = rank_memory(dense_first, 4096, 4, micro_steps=8, pp=2, embedding=False)  # an even share: too few
    assert average.parameters < ranks[1].parameters


def test_auto_recomputation_on_a_cpu_trains_without_and_says_so_in_the_resolved_config(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(stdlib_data, run_dir, "train.steps=1", "eval.interval=0", "parallel.recompute=auto"))
    assert 'recompute = "none"' in (run_dir / "config.toml").read_text()


def test_pipeline_ranks_hold_the_micro_batches_their_schedule_keeps_in_flight():
    assert in_flight_microbatches(1, 8) == 1
    assert in_flight_microbatches(4, 8, "1f1b") == 4  # the first stage runs pp forwards before its first backward
    assert in_flight_microbatches(4, 8, "gpipe") == in_flight_microbatches(4, 8, "looped_bfs") == 8
    assert in_flight_microbatches(4, 8, "interleaved_1f1b", 2) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_microbatches(4, 8, "zbv_zero_bubble", 2) == in_flight_microbatches(4, 8, "interleaved_zero_bubble",
                                                                                      2) == 4
    assert in_flight_microbatches(4, 8, "dualpipev", 2) == 4.5  # a stage's micro-batch more (test_plan walks them)
    assert in_flight_microbatches(4, 2, "1f1b") == 2  # never more than there are


def test_pipelining_splits_the_parameters_and_keeps_1f1b_activations_where_one_device_had_them():
    cfg = load_config(ROOT / "configs" / "llama-1b.toml", ["model.vocab_size=32768", "model.tie_embeddings=false"]).model
    whole = training_memory(cfg, 2048, 1, micro_steps=8, gather_dtype="bf16")  # (as FSDP makes it on pp ranks)
    piped = training_memory(cfg, 2048, 1, micro_steps=8, pp=4, gather_dtype="bf16")
    # the busier rank: a quarter of the blocks, and the head with the final norm (larger than the embedding)
    assert whole.parameters / 4 < piped.parameters < whole.parameters / 2
    # 1F1B: pp micro-batches of L/pp blocks on the first rank are one micro-batch of all L blocks
    first = rank_memory(cfg, 2048, 1, micro_steps=8, pp=4, in_flight=in_flight_microbatches(4, 8), head=False,
                        gather_dtype="bf16")
    assert first.activations == whole.activations and first.loss == 0
    gpipe = training_memory(cfg, 2048, 1, micro_steps=8, pp=4, pp_schedule="gpipe", gather_dtype="bf16")
    assert gpipe.activations == pytest.approx(2 * whole.activations, rel=1e-6)  # 8 micro-batches of L/4 blocks
    assert gpipe.loss == pytest.approx(8 * whole.loss, rel=1e-6)  # the last rank keeps every loss to its backward
    assert gpipe.peak > piped.peak
    # FSDP with pipelining keeps all of a rank's blocks gathered from forward to backward.
    block = (matmul_params(cfg) - cfg.vocab * cfg.dim) / cfg.n_layers
    for pp, blocks in ((1, 2), (2, cfg.n_layers / 2)):
        copies = training_memory(cfg, 2048, 1, micro_steps=8, fsdp=4, pp=pp).weight_copies
        head_and_embedding = 2 if pp == 1 else 1  # the busier pipeline rank holds the head alone
        assert copies == round(2 * (blocks * block + head_and_embedding * cfg.vocab * cfg.dim)), pp
    # ... and its gradients whole until the step's last backward (torch's stages turn FSDP's
    # reduction off for the others): the stage's float32 gradients beside the activations.
    sharded, plain = (training_memory(cfg, 2048, 1, fsdp=4, pp=pp) for pp in (2, 1))
    assert sharded.gradients_whole == pytest.approx(4 * sharded.gradients, abs=4) and plain.gradients_whole == 0
    # (of a mixture under expert parallelism, each rank's own experts only)
    moe = load_config(ROOT / "configs" / "llama-1b.toml", ["model.vocab_size=32768", "model.tie_embeddings=false",
                                                            "model.moe_experts=64", "model.moe_top_k=2"]).model
    one, eight = (training_memory(moe, 2048, 1, fsdp=8, pp=2, ep=ep).gradients_whole for ep in (1, 8))
    routed = moe.n_layers * 3 * moe.dim * moe.expert_dim * 64
    assert one - eight == pytest.approx(4 * routed * (1 - 1 / 8) / 2, rel=1e-6)
    assert sharded.peak == (sharded.parameters + sharded.optimizer + sharded.weight_copies + sharded.activations
                            + sharded.loss + sharded.gradients_whole)


def test_muon_holds_one_moment_of_the_block_matrices_and_the_largest_whole_in_its_step():
    cfg = ModelConfig(vocab_size=32768, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=4096)
    adamw, muon = (training_memory(cfg, 2048, 1, fsdp=8, optimizer=kind) for kind in ("adamw", "muon"))
    block_matrices = 16 * (2 * 2048 * (2048 + 512) + 3 * 2048 * 8192)
    assert adamw.optimizer - muon.optimizer == pytest.approx(4 * block_matrices / 8, abs=1)
    assert (muon.parameters, muon.gradients, muon.activations) == (adamw.parameters, adamw.gradients,
                                                                   adamw.activations)
    # The step's whole w1 on top of the gradients, above a short sequence's activations: 28 bytes an
    # entry when FSDP's shards are shared out (buffers to and from its owner), 20 gathered under TP.
    short = training_memory(cfg, 128, 1, fsdp=8, optimizer="muon")
    assert short.peak == short.parameters + short.optimizer + short.weight_copies + short.gradients + 28 * 2048 * 8192
    split = training_memory(cfg, 128, 1, fsdp=4, tp=2, optimizer="muon")
    assert split.peak == split.parameters + split.optimizer + split.weight_copies + split.gradients + 20 * 2048 * 8192


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_multi_token_prediction_is_counted_as_a_block_and_a_loss_per_depth(bf16):
    """The memory model's estimate of what model.mtp_depth adds — per depth a dense block's
    activations and another loss — against the bytes autograd saves for the depths (the block,
    the joined inputs, the head's log-softmax): over, by at most 35% (the estimate's loss is
    the peak around the loss, gradient included, which is more than the joined inputs it leaves
    out: 1.06-1.08 of what is saved in float32, 1.28-1.31 in bf16, where the float32 loss weighs
    more beside the blocks' bf16 copies)."""
    batch, seq = 3, 64
    shape = dict(vocab_size=512, max_seq_len=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2)
    for depth in (1, 2):
        cfg = ModelConfig(**shape, mtp_depth=depth)
        model = Transformer(cfg)
        stream = torch.randint(0, 512, (batch, seq + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            x = model.tok_embeddings(stream[:, :-1])
            for block in model.layers.values():
                x = block(x, model.rope_cos, model.rope_sin)
            trunk = x.detach().requires_grad_()
            with counting_saves(model) as seen:
                model._mtp_loss(trunk, shifted_targets(stream[:, 1:], depth), model.rope_cos, model.rope_sin, None)
        measured = sum(seen.values())
        with_depths, without = (training_memory(c, seq, batch, bf16=bf16) for c in (cfg, ModelConfig(**shape)))
        predicted = with_depths.activations + with_depths.loss - without.activations - without.loss
        assert 1.0 < predicted / measured < (1.35 if bf16 else 1.1), (depth, predicted, measured)
