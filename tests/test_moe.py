"""Mixture-of-experts blocks: routing against a token-by-token reference, exact parameter and
FLOP counts, the balancing loss, training with resume and recomputation, parity with one process
under data, expert, tensor, context and pipeline parallelism (each checkpoint resumed in one
process), and the layouts and tools that refuse MoE so far."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from conftest import ROOT, launch_runs, run_cli, tiny_config
from scaletrain.config import ConfigError, ModelConfig, load_config
from scaletrain.model import flops
from scaletrain.model.llama import Transformer
from scaletrain.model.moe import MoE, balance_tally, set_balance_weight
from scaletrain.parallel.layout import check_layout, resolve_layout
from scaletrain.plan.memory import rank_memory
from scaletrain.train.metrics import read_metrics
from scaletrain.train.trainer import train

MOE = dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, max_seq_len=64, moe_experts=4, moe_top_k=2,
           moe_shared_experts=1, moe_dense_layers=1, moe_ffn_dim=96)
MOE_OVERRIDES = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_shared_experts=1", "model.moe_ffn_dim=96"]
# Loss-free balancing on top: its biases must be checkpointed and its loads summed over every rank.
BIASED = [*MOE_OVERRIDES, "model.moe_bias_update=0.02"]


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_each_token_gets_the_weighted_sum_of_its_top_k_experts_and_the_shared_one(score):
    torch.manual_seed(0)
    cfg = ModelConfig(**MOE, moe_score=score)
    moe = Transformer(cfg).layers["1"].feed_forward
    assert isinstance(moe, MoE)
    x = torch.randn(2, 8, 64)
    out = moe(x)
    experts = moe.experts
    for t, token in enumerate(x.reshape(-1, 64)):
        logits = moe.router(token)
        top, chosen = logits.topk(2)  # both scores rise with the logit: the same experts
        # Mixtral: a softmax over the chosen logits; DeepSeek-V3: their sigmoids over their sum.
        weights = top.softmax(-1) if score == "softmax" else top.sigmoid() / top.sigmoid().sum()
        expected = moe.shared(token)
        for weight, e in zip(weights, chosen):
            hidden = F.silu(token @ experts.w1[e].T) * (token @ experts.w3[e].T)
            expected = expected + weight * (hidden @ experts.w2[e].T)
        torch.testing.assert_close(out.reshape(-1, 64)[t], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_the_grouped_gemm_computes_what_one_matmul_per_expert_does(monkeypatch, autocast):
    """model/moe.py runs the experts as one grouped GEMM on CPUs; the per-expert loop it
    replaces (kept for other devices) gives the same outputs and gradients, an expert without
    rows included: to float32 rounding (bit for bit on one machine; on an AVX-512 one, MKL's
    kernels for the two shapes rounded an output a unit apart)."""
    from scaletrain.model import moe

    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 10])
    x = torch.randn(int(counts.sum()), 32)
    weights = [torch.randn(4, 48, 32), torch.randn(4, 32, 48), torch.randn(4, 48, 32)]
    grad = torch.randn(int(counts.sum()), 32)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(moe, "_grouped", lambda *args, grouped=grouped: grouped)
        # The rows arrive in the compute dtype (a block casts its normed input), the weights in float32.
        inputs = [t.clone().requires_grad_() for t in (x.to(torch.bfloat16) if autocast else x, *weights)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = moe._run(inputs[0], counts, *inputs[1:])
        out.backward(grad.to(out.dtype))
        results.append([out, *(t.grad for t in inputs)])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert results[0][0].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.count_nonzero(results[0][2][1]) == 0  # expert 1 had no rows: a zero gradient
    nothing = torch.zeros(0, 32, requires_grad=True)  # a rank no row was sent to (expert parallelism)
    moe._run(nothing, torch.zeros(4, dtype=torch.int64), *weights).sum().backward()
    assert nothing.grad.shape == (0, 32)


@pytest.mark.parametrize("dtype, hidden, dim", [(torch.float32, 38, 32), (torch.bfloat16, 36, 32),
                                                (torch.bfloat16, 64, 36)])
def test_experts_of_widths_the_grouped_gemm_cannot_align_run_one_by_one(dtype, hidden, dim):
    """The grouped GEMM takes strides of whole multiples of 16 bytes: other widths (an expert's
    or the model's) run the per-expert loop instead of failing."""
    from scaletrain.model import moe

    counts = torch.tensor([3, 4])
    x = torch.randn(7, dim, dtype=dtype, requires_grad=True)
    weights = [torch.randn(2, hidden, dim), torch.randn(2, dim, hidden), torch.randn(2, hidden, dim)]
    assert not moe._grouped(x, weights[0], dtype)
    assert moe._grouped(x, torch.randn(2, 32, 32), dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        moe._run(x, counts, *weights).float().sum().backward()
    assert x.grad.shape == (7, dim)


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """FlopCounterMode has no formula for the grouped GEMM the experts run as (torch 2.13): each
    row of a meets one expert's matrix, 2 FLOPs per multiply-add, forward and both gradients."""
    return 2 * math.prod(a_shape) * b_shape[-1]


if torch.ops.aten._grouped_mm.default not in flop_registry:
    register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def test_parameter_and_flop_counts_are_exact():
    cfg = ModelConfig(**MOE)
    model = Transformer(cfg)
    counts = flops.param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    routed = model.layers["1"].feed_forward.experts
    per_expert = sum(p[0].numel() for p in routed.parameters())
    assert counts["active"] == counts["total"] - flops.moe_layers(cfg) * (4 - 2) * per_expert
    tokens = torch.randint(0, 256, (2, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    assert counter.get_total_flops() == flops.train_flops_per_token(cfg, 32) * 2 * 32


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balancing_loss_is_one_for_a_uniform_router_and_grows_when_one_expert_takes_all(score):
    cfg = ModelConfig(**MOE, moe_score=score)
    moe = Transformer(cfg).layers["1"].feed_forward
    x = torch.randn(4, 16, 64)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe(x)
        assert moe.aux_loss.item() == pytest.approx(1.0)
        moe.router.weight[0] = 10 * x.reshape(-1, 64).mean(0) / x.reshape(-1, 64).mean(0).norm() ** 2
        moe(x)
        # (by sigmoid, the others keep scores of 1/2: the favourite's normalised share is at most 2/5)
        assert moe.aux_loss.item() > (1.2 if score == "softmax" else 1.05)
    # In training, the block's backward gives the balancing loss the gradient balance_weight, as
    # if weight x (sum of the blocks' balancing losses) had been added to the loss, and tallies it.
    tokens = torch.randint(0, 256, (2, 16))
    torch.manual_seed(0)
    model = Transformer(cfg)
    set_balance_weight(model, 0.5)
    model(tokens, tokens).backward()
    trained = model.layers["1"].feed_forward.router.weight.grad.clone()
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    total, count = balance_tally(model)
    assert count == 2 and total.item() == pytest.approx(sum(m.aux_loss.item() for m in blocks))
    assert balance_tally(model)[1] == 0  # read once: counted again from zero
    model.zero_grad()
    model.eval()  # outside training the blocks add nothing: add their losses by hand
    (model(tokens, tokens) + 0.5 * sum(m.aux_loss for m in blocks)).backward()
    torch.testing.assert_close(model.layers["1"].feed_forward.router.weight.grad, trained)
    set_balance_weight(model, 0.0)
    model.zero_grad()
    model.train()
    model(tokens, tokens).backward()
    assert not torch.allclose(model.layers["1"].feed_forward.router.weight.grad, trained)  # the loss trains the routers
    total, count = balance_tally(Transformer(ModelConfig(vocab_size=256, dim=64, n_layers=1, n_heads=4, max_seq_len=64)))
    assert (total.item(), count) == (0.0, 0)  # (a dense model, or a pipeline stage of dense blocks: counts none)


def test_group_limited_routing_takes_each_tokens_experts_from_its_best_groups_only():
    """DeepSeek-V3's node-limited routing: 8 experts in 4 groups of 2, each token's top 3 from its
    2 groups whose best ceil(3 / 2) = 2 scores sum highest; with every group allowed, plain top-k."""
    from scaletrain.model.moe import group_limited

    torch.manual_seed(0)
    cfg = ModelConfig(**{**MOE, "moe_experts": 8, "moe_top_k": 3, "moe_groups": 4, "moe_group_limit": 2})
    moe = MoE(cfg)
    x = torch.randn(1, 32, 64)
    chosen = []
    moe.experts.forward = lambda rows, counts: chosen.append(counts) or rows  # see what the routing sends
    with torch.no_grad():
        moe(x)
        scores = moe.router(x.reshape(-1, 64)).softmax(-1)
    limited = group_limited(scores, 4, 2, 3)
    for token in range(32):
        strength = scores[token].view(4, 2).sum(-1)  # each group's best 2 of its 2
        best = set(strength.topk(2).indices.tolist())
        picks = limited[token].topk(3).indices
        assert {int(e) // 2 for e in picks} <= best  # within its 2 best groups
        assert torch.isinf(limited[token].view(4, 2)[[g for g in range(4) if g not in best]]).all()
    routed = torch.bincount(limited.topk(3, dim=-1).indices.flatten(), minlength=8)
    assert torch.equal(chosen[0], routed)  # what the block sent its experts
    assert torch.equal(group_limited(scores, 4, 4, 3), scores)  # no limit: the scores as they were
    for overrides, message in (({"moe_groups": 3}, "moe_groups = 3 does not divide the model.moe_experts = 8"),
                               ({"moe_group_limit": 5}, "moe_group_limit = 5 is more than the model.moe_groups = 4"),
                               ({"moe_group_limit": 1, "moe_top_k": 3}, "moe_top_k = 3 experts cannot be chosen")):
        with pytest.raises(ValueError, match=message):
            ModelConfig(**{**MOE, "moe_experts": 8, "moe_top_k": 3, "moe_groups": 4, "moe_group_limit": 2, **overrides})
    from scaletrain.hf import moe_problem

    exportable = cfg.model_copy(update={"moe_shared_experts": 0, "moe_dense_layers": 0, "qk_norm": True})
    assert "route among all experts" in moe_problem(exportable)
    assert moe_problem(exportable.model_copy(update={"moe_group_limit": None})) is None


def test_on_the_meta_device_a_mixture_gives_its_output_shape_without_routing():
    """What older torch's pipeline stages infer shapes with (routing is data-dependent)."""
    moe = Transformer(ModelConfig(**MOE)).layers["1"].feed_forward
    out = moe(torch.empty(2, 16, 64, device="meta"))
    assert out.shape == (2, 16, 64) and out.is_meta


def test_with_one_expert_a_token_the_router_still_learns_from_the_loss():
    """Switch's routing: the output weighted by the chosen expert's probability (a softmax over
    one logit would be 1 and pass the router no gradient)."""
    cfg = ModelConfig(**{**MOE, "moe_top_k": 1, "moe_aux_loss": 0.0})
    model = Transformer(cfg)
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens, tokens).backward()
    assert model.layers["1"].feed_forward.router.weight.grad.abs().sum() > 0


def test_expert_biases_choose_experts_but_do_not_weight_them_and_move_toward_balance():
    """DeepSeek-V3's loss-free balancing: a bias added to an expert's probability only to choose
    the top k; after a step, each bias moves by the rate toward the mean load."""
    from scaletrain.model.moe import MoE, update_expert_bias

    torch.manual_seed(0)
    cfg = ModelConfig(**{**MOE, "moe_shared_experts": 0, "moe_bias_update": 0.1})
    moe = MoE(cfg)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.1)
    x = torch.randn(1, 16, 64)
    plain = moe(x)
    moe.load.zero_()
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 is chosen for every token
    biased = moe(x)
    assert moe.load.tolist()[3] == 16 and moe.load.sum() == 32  # 16 tokens x top-2, counted while training
    with torch.no_grad():
        logits = moe.router(x.reshape(-1, 64))
        probs = logits.softmax(-1)
        for t in range(16):
            first = int(probs[t, :3].argmax())  # the best of the others, and expert 3
            weights = probs[t, [first, 3]] / probs[t, [first, 3]].sum()  # the probabilities, not the biases
            hidden = {e: F.silu(x[0, t] @ moe.experts.w1[e].T) * (x[0, t] @ moe.experts.w3[e].T) for e in (first, 3)}
            expected = sum(w * (hidden[e] @ moe.experts.w2[e].T) for w, e in zip(weights, (first, 3)))
            torch.testing.assert_close(biased[0, t], expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, biased)
    moe.eval()
    moe(x)  # evaluation does not count
    moe.load.copy_(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    max_load = update_expert_bias(moe, cfg)
    assert moe.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 10.1]) and moe.load.sum() == 0
    assert max_load.tolist() == [2.5, 0, 0]  # one a layer: this block is layer 0 of the 3
    moe.load.copy_(torch.tensor([10.0, 2.0, 4.0, 0.0]))
    update_expert_bias(moe, cfg, skip=torch.tensor(True))  # a step that was not applied
    assert moe.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 10.1])


@pytest.mark.parametrize("recompute", ["full"])  # none: the parallel tests' one-process reference
def test_a_moe_model_trains_and_resumes_bit_exactly(stdlib_data, tmp_path, recompute):
    common = [*BIASED, "model.moe_score=sigmoid", "model.moe_groups=2", "model.moe_group_limit=1", "train.steps=6",
              "eval.interval=3", "checkpoint.interval=3", f"parallel.recompute={recompute}"]
    # DeepSeek-V3's routing: sigmoid scores, loss-free balancing, each token's experts from one of two groups
    train(tiny_config(stdlib_data, tmp_path / "whole", *common))
    train(tiny_config(stdlib_data, tmp_path / "split", *common), stop_at_step=3)
    train(tiny_config(stdlib_data, tmp_path / "split", *common))
    whole, split = (read_metrics(tmp_path / name, "train") for name in ("whole", "split"))
    assert [r["loss"] for r in split] == [r["loss"] for r in whole]
    assert whole[-1]["loss"] < whole[0]["loss"]
    # Per block: about 1 when balanced (a little below when the busier experts score lower on
    # average, as group-limited routing can make them), 4 (E) when one takes all.
    assert all(0.95 < r["moe_balance"] < 1.5 for r in whole)
    assert all(1 <= r["moe_max_load"] < 4 for r in whole)


def test_a_compiled_mixture_compiles_its_attention_and_trains_the_losses_of_eager(stdlib_data, tmp_path,
                                                                                  one_process_moe):
    """train.compile: a mixture block's attention is compiled (the routing, which waits on the
    host, and the grouped GEMM, which traces in bf16 only, run eagerly), here under selective
    recomputation, whose eager region around the block replays the compiled attention (its
    matmuls, out= variants inductor calls, computed again; the grouped GEMMs' outputs kept)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    train(tiny_config(stdlib_data, tmp_path / "run", *BIASED, "train.micro_batch=2", "train.steps=4",
                      "eval.interval=0", "checkpoint.interval=2", "train.compile=true", "parallel.recompute=selective"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the attention, compiled
    compiled = read_metrics(tmp_path / "run", "train")
    for key in ("loss", "grad_norm", "moe_max_load", "moe_balance"):
        assert [r[key] for r in compiled] == pytest.approx([r[key] for r in one_process_moe(())], rel=1e-4,
                                                           abs=1e-5)


LAYOUTS = {  # name: (processes, overrides); plain FSDP of a MoE is the non-expert half of this one, and
    # ep 2 alone (each expert on one rank) was checked by hand, not here: one run fewer keeps the suite short.
    # With Muon (AdamW's update is elementwise, Muon's is not): experts split by expert are
    # orthogonalised where they lie, the attention's FSDP shards gathered whole.
    "expert-parallel-fsdp-muon": (4, ["parallel.dp_shard=4", "parallel.ep=2", "parallel.recompute=full",
                                      "train.optimizer=muon"]),
    # Each rank of a tp pair routes its half of the sequences with the whole router, the pair
    # summing its gradients, to experts split over ep x tp (one a rank), sharded by FSDP,
    # selectively recomputed (the all-to-alls and tp's collectives again, the grouped GEMMs'
    # outputs kept), with Muon; each rank holds the bytes the memory model gives it.
    "tensor-expert-and-data-parallel-muon": (4, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2",
                                                 "parallel.recompute=selective", "train.optimizer=muon"]),
    # tp alone: each rank of the pair holds half the experts (2 of 4), the tokens of both halves of
    # the sequences exchanged by all-to-all.
    "tensor-parallel": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    # Each sequence split over 2 cp ranks: the balancing loss counts the whole micro-batch's
    # assignments, and each expert's FSDP group takes in the cp ranks holding it.
    "context-and-expert-parallel": (4, ["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"]),
    # One block a stage: each stage's routers learn their balance without the loss (last stage
    # only), the loads of different blocks meet in one all-reduce. Zero bubble splits each
    # backward into its input and weight halves; the schedule's first step infers shapes.
    "pipeline-and-expert-parallel-zero-bubble": (4, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.pp=2",
                                                     "parallel.pp_schedule=interleaved_zero_bubble",
                                                     "parallel.pp_stages_per_rank=1"]),
    # A dense first block (DeepSeek-V3's), so the first stage holds no mixture block: its rank
    # still takes part in the balancing loss's mean (it hung there, in an all-reduce of one rank).
    "pipeline-with-a-dense-stage": (2, ["parallel.pp=2", "parallel.dp_shard=1", "model.moe_dense_layers=1"]),
}


@pytest.fixture(scope="module")
def one_process_moe(stdlib_data, tmp_path_factory):
    """The one-process run of each model and optimizer of the layouts: (its model.* and
    train.optimizer overrides) -> train records."""
    runs = {}

    def run(overrides: tuple[str, ...]) -> list[dict]:
        if overrides not in runs:
            run_dir = tmp_path_factory.mktemp("moe") / "one"
            train(tiny_config(stdlib_data, run_dir, *BIASED, "train.micro_batch=2", "train.steps=4",
                              "eval.interval=0", "checkpoint.interval=2", *overrides))
            runs[overrides] = read_metrics(run_dir, "train")
        return runs[overrides]
    return run


def _model_and_optimizer(layout: list[str]) -> tuple[str, ...]:
    """The overrides of a layout that change what is trained, not how it is laid out."""
    return tuple(o for o in layout if o.startswith(("train.optimizer", "model.")))


def _moe_common(stdlib_data, root: Path, name: str, layout: list[str]) -> list[str]:
    return [f"data.path={stdlib_data}", f"run.dir={root}", f"run.name={name}", *BIASED, "train.micro_batch=2",
            "train.steps=4", "eval.interval=0", "checkpoint.interval=2", *_model_and_optimizer(layout)]


@pytest.fixture(scope="module")
def moe_layouts(stdlib_data, tmp_path_factory) -> Path:
    """Each of LAYOUTS trained to step 3 (its checkpoint: two updates in the layout, so its
    optimizer state and routing biases carried from one step to the next), those of one size in
    one launch: the directory of their runs, by name."""
    root = tmp_path_factory.mktemp("moe-layouts")
    for processes in sorted({processes for processes, _ in LAYOUTS.values()}):
        launch_runs(root / f"moe-{processes}.json", processes, [
            {"config": str(ROOT / "configs" / "tiny.toml"), "stop_at_step": 3,
             "overrides": [*_moe_common(stdlib_data, root, name, layout), *layout]}
            for name, (size, layout) in LAYOUTS.items() if size == processes])
    return root


@pytest.mark.parametrize("name", LAYOUTS)
def test_parallel_moe_trains_the_losses_and_gradients_of_one_process(stdlib_data, moe_layouts, one_process_moe,
                                                                     name):
    """Adam and Muon are blind to a gradient's scale, so the gradient norms are compared as well as
    the losses: an expert gradient averaged over the wrong number of ranks shows there. Steps 1-3
    are the layout's; its checkpoint (experts split, and sharded too) resumes in one process for
    step 4."""
    _, layout = LAYOUTS[name]
    common = _moe_common(stdlib_data, moe_layouts, name, layout)
    if "parallel.tp=2" in layout:  # the routed experts split over ep x tp, the routers and shared experts whole
        cfg = load_config(ROOT / "configs" / "tiny.toml", [*common, *layout, "model.vocab_size=512"])
        par = cfg.parallel
        estimate = rank_memory(cfg.model, cfg.data.seq_len, cfg.train.micro_batch, bf16=False, fsdp=par.dp_shard,
                               tp=par.tp, ep=par.ep, optimizer=cfg.train.optimizer)
        for rank in read_metrics(moe_layouts / name, "memory")[0]["bytes_by_rank"]:
            assert (estimate.parameters, estimate.gradients, estimate.optimizer) == (
                rank["parameters"], rank["gradients"], rank["optimizer"])
    train(load_config(ROOT / "configs" / "tiny.toml", common))
    records = read_metrics(moe_layouts / name, "train")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    reference = one_process_moe(_model_and_optimizer(layout))
    for key in ("loss", "grad_norm", "moe_max_load", "moe_balance"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in reference], rel=1e-5, abs=1e-6)


def test_what_does_not_take_a_moe_model_yet_says_so(stdlib_data, tmp_path):
    cfg = tiny_config(stdlib_data, tmp_path / "r", *MOE_OVERRIDES, "model.vocab_size=512")
    for overrides, message in ((["parallel.dp_shard=4", "parallel.ep=3"], "parallel.ep = 3 does not divide"),
                               (["parallel.dp_shard=3", "parallel.ep=3"], "moe_experts = 4 is not divisible by")):
        bad = tiny_config(stdlib_data, tmp_path / "r", *MOE_OVERRIDES, "model.vocab_size=512", *overrides,
                          "train.micro_batch=1", "train.global_batch_tokens=768")
        with pytest.raises(ConfigError, match=message):
            check_layout(resolve_layout(bad.parallel, bad.parallel.dp_shard), bad)
    dense = tiny_config(stdlib_data, tmp_path / "r", "model.vocab_size=512", "parallel.dp_shard=2", "parallel.ep=2")
    with pytest.raises(ConfigError, match=r"\(a dense model\); set parallel.ep = 1"):
        check_layout(resolve_layout(dense.parallel, 2), dense)
    assert tiny_config(stdlib_data, tmp_path / "r", *MOE_OVERRIDES, "parallel.recompute=auto").parallel.recompute == "auto"
    with pytest.raises(ConfigError, match="moe_top_k = 5 is more than"):
        load_config(None, ["train.steps=1", "model.moe_experts=4", "model.moe_top_k=5"])
    with pytest.raises(ConfigError, match=r"moe_top_k = 2 \(its default\) is more than"):
        load_config(None, ["train.steps=1", "model.moe_experts=1"])
    with pytest.raises(ConfigError, match="model.moe_top_k set, but model.moe_experts = 0"):
        load_config(None, ["train.steps=1", "model.moe_top_k=1"])
    load_config(None, ["train.steps=1", "model.moe_top_k=2"])  # its default: as a resolved config writes it
    config = tmp_path / "moe.toml"
    config.write_text(cfg.to_toml())
    result = run_cli("plan", str(config), "--gpus", "4", "--json", "--write-config", str(tmp_path / "planned.toml"))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"]["moe_experts"] == 4 and plan["model"]["n_active"] < plan["model"]["n"]
    assert plan["layout"]["layout"]["tp"] == plan["layout"]["layout"]["pp"] == 1  # what a mixture trains with
    planned = load_config(tmp_path / "planned.toml")
    assert planned.model.moe_experts == 4 and planned.parallel.ep == plan["layout"]["layout"]["ep"]
    json.dumps(cfg.model.model_dump())
