"""Parameter and FLOP accounting (model/flops.py) against the real module, and the peak-FLOP/s table."""

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.config import ModelConfig
from scaletrain.model import flops
from scaletrain.model.llama import Transformer
from scaletrain.plan.hardware import PEAK_FLOPS, device, identify, peak_flops

SHAPES = {
    "mha": {},
    "tied": {"tie_embeddings": True},
    "gqa": {"n_kv_heads": 2},
    "gqa_qk_norm_custom_ffn": {"n_kv_heads": 1, "qk_norm": True, "ffn_dim": 100},
    "tied_qk_norm_wide_heads": {"tie_embeddings": True, "qk_norm": True, "n_heads": 2, "n_layers": 3},
}


def tiny(**overrides) -> ModelConfig:
    shape = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    return ModelConfig(**(shape | overrides))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_param_counts_equal_the_modules_parameters(shape):
    cfg = tiny(**shape)
    model = Transformer(cfg)
    counts = flops.param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == model.tok_embeddings.weight.numel()
    assert counts["non_embedding"] == counts["total"] - counts["embedding"]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matmul_params_are_the_linear_weights_including_the_output_head(shape):
    cfg = tiny(**shape)
    model = Transformer(cfg)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops.matmul_params(cfg) == linears


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_train_flops_per_token_equal_flop_counter_mode_exactly(shape):
    cfg = tiny(**shape)
    model = Transformer(cfg)
    batch, seq = 2, 32
    tokens = torch.randint(0, cfg.vocab, (batch, seq))
    targets = torch.randint(0, cfg.vocab, (batch, seq))
    # FlopCounterMode has no formula for the CPU flash kernel (aten._scaled_dot_product_
    # flash_attention_for_cpu) and would count its attention as 0; the math backend runs
    # attention as two bmm forward and four backward, which it counts.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, targets).backward()
    assert counter.get_total_flops() == flops.train_flops_per_token(cfg, seq) * batch * seq

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens)
    assert counter.get_total_flops() == flops.forward_flops_per_token(cfg, seq) * batch * seq


def test_train_flops_grow_linearly_with_context_by_the_attention_term():
    cfg = tiny()
    attention_per_token_per_position = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert flops.train_flops_per_token(cfg, 33) - flops.train_flops_per_token(cfg, 32) == attention_per_token_per_position
    assert flops.train_flops_per_token(cfg, 0) == 6 * flops.matmul_params(cfg)


def test_flops_module_imports_without_torch():
    code = "import sys, scaletrain.model.flops, scaletrain.plan.hardware; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "device_name, canonical",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GB200", "GB200"),
        ("AMD Instinct MI300X", "MI300X"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("Tesla V100-SXM2-16GB", "V100 16GB"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100-PCIE-16GB", "V100 16GB PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S"),
        ("Tesla T4", "T4"),
    ],
)
def test_device_names_as_torch_reports_them_are_identified(device_name, canonical):
    assert identify(device_name) == canonical
    assert identify(device_name.lower()) == canonical
    assert device(device_name).name == canonical  # the planner's card: memory, bandwidths and power as well


def test_the_a100s_share_their_peaks_and_differ_in_memory_and_board():
    cards = {name: device(name) for name in ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe",
                                             "NVIDIA A100-PCIE-40GB")}
    assert {card.peak["bf16"] for card in cards.values()} == {312e12}
    assert {name: card.memory / 1e9 for name, card in cards.items()} == {
        "NVIDIA A100-SXM4-80GB": 80, "NVIDIA A100-SXM4-40GB": 40, "NVIDIA A100 80GB PCIe": 80, "NVIDIA A100-PCIE-40GB": 40}
    assert cards["NVIDIA A100 80GB PCIe"].intra_node < cards["NVIDIA A100-SXM4-80GB"].intra_node  # PCIe, not NVLink
    assert peak_flops("NVIDIA A100-PCIE-40GB", "bf16") == 312e12


def test_peak_flops_lookup_by_dtype_and_unknown_devices():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "torch.bfloat16") == peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == pytest.approx(19.5e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert peak_flops("cpu", "bf16") is None
    assert peak_flops("NVIDIA GeForce GTX 1080", "fp32") is None
    with pytest.raises(ValueError, match="int8"):
        peak_flops("NVIDIA H200", "int8")


def test_every_device_lists_bf16_tf32_and_fp32_with_tensor_cores_fastest():
    for name, peaks in PEAK_FLOPS.items():
        assert set(peaks) == {"bf16", "tf32", "fp32"}, name
        assert peaks["bf16"] >= peaks["tf32"] >= peaks["fp32"] > 0, name
