"""Optional float8 training on Hopper-class GPUs through torchao (an optional extra:
`pip install 'scaletrain[float8]'`): the blocks' linear layers compute in float8 with dynamic
per-tensor scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"); weights, the
optimizer and checkpoints stay as they are, so a run can switch float8 on or off on resume.
The output head stays in bf16 (its logits feed a float32 softmax). bf16 remains the default."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import ConfigError, float8_problem


def check_float8(device: torch.device, tp: int) -> None:
    """Refuse, in one sentence, a float8 run this machine or layout cannot do."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    capable = capability is not None and capability >= (8, 9)
    where = device.type if capability is None else f"a GPU of compute capability {capability}"
    if (problem := float8_problem(capable, where, tp)) is not None:
        raise ConfigError(problem)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("train.float8 = true needs torchao, which is not installed: "
                          "pip install 'scaletrain[float8]'") from None


def convert_to_float8(model: nn.Module, device: torch.device, tp: int) -> int:
    """Swap model's eligible nn.Linear layers for torchao's Float8Linear in place; returns how many."""
    check_float8(device, tp)
    from torchao.float8 import convert_to_float8_training

    converted = []

    def wanted(module: nn.Module, name: str) -> bool:
        # float8 matmuls need both dimensions divisible by 16.
        # Not the output head, nor a mixture of experts' router (routing decided in float32);
        # routed experts are not nn.Linear and stay in the compute dtype.
        ok = (isinstance(module, nn.Linear) and name.split(".")[-1] not in ("output", "router")
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, module_filter_fn=wanted)
    return len(converted)
