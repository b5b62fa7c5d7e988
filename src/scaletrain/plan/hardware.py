"""Peak dense FLOP/s of common accelerators, by dtype: the denominator of MFU.

Numbers are vendor datasheet peaks *without* 2:4 structured sparsity (datasheets often
print the sparse figure, twice the dense one, with an asterisk). `bf16` is the tensor-core
rate with fp32 accumulation (fp16 is the same on every device listed; V100 and T4, which have
no bf16, list their fp16 rate there, what train.dtype = float16 computes at), `tf32` the
tensor-core rate for fp32 matmuls with TF32 allowed (their fp32 rate where there is none),
`fp32` the plain (non-tensor) rate.
Pure data and string matching: imports no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

T = 1e12

# Canonical name -> {dtype: dense peak FLOP/s}. Source of each row in the comment above it.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 datasheet (SXM5): BF16 1,979 TFLOPS sparse = 989.4 dense; TF32 989 sparse; FP32 67.
    "H100 SXM": {"bf16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T},
    # NVIDIA H100 datasheet (PCIe): BF16 1,513 sparse = 756.5 dense; TF32 756 sparse; FP32 51.
    "H100 PCIe": {"bf16": 756.5 * T, "tf32": 378.0 * T, "fp32": 51.2 * T},
    # NVIDIA H100 datasheet (NVL): BF16 1,671 sparse = 835.5 dense; TF32 835 sparse; FP32 60.
    "H100 NVL": {"bf16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60.0 * T},
    # NVIDIA H200 datasheet (SXM): same GH100 compute as H100 SXM; BF16 1,979 sparse; TF32 989 sparse; FP32 67.
    "H200": {"bf16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T},
    # NVIDIA H200 datasheet (NVL): BF16 1,671 sparse; TF32 835 sparse; FP32 60.
    "H200 NVL": {"bf16": 835.5 * T, "tf32": 417.5 * T, "fp32": 60.0 * T},
    # NVIDIA A100 datasheet (40 GB and 80 GB, SXM and PCIe alike): BF16 312 dense; TF32 156; FP32 19.5.
    "A100": {"bf16": 312.0 * T, "tf32": 156.0 * T, "fp32": 19.5 * T},
    # NVIDIA L4 datasheet: BF16 242 sparse = 121 dense; TF32 120 sparse = 60; FP32 30.3.
    "L4": {"bf16": 121.0 * T, "tf32": 60.0 * T, "fp32": 30.3 * T},
    # NVIDIA L40S datasheet: BF16 362.05 dense (733 sparse); TF32 183 (366 sparse); FP32 91.6.
    "L40S": {"bf16": 362.05 * T, "tf32": 183.0 * T, "fp32": 91.6 * T},
    # NVIDIA A10 datasheet: BF16 125 dense (250 sparse); TF32 62.5; FP32 31.2.
    "A10": {"bf16": 125.0 * T, "tf32": 62.5 * T, "fp32": 31.2 * T},
    # A10G (AWS G5) has no public NVIDIA datasheet; AWS/third-party figures (e.g. Baseten's
    # "A10 vs A10G" comparison) give ~70 TFLOPS BF16 tensor and ~35 TFLOPS FP32. Approximate.
    "A10G": {"bf16": 70.0 * T, "tf32": 35.0 * T, "fp32": 35.0 * T},
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): FP16/BF16 tensor with FP32
    # accumulate 165.2 dense (330.3 sparse); TF32 82.6 dense; FP32 82.6.
    "RTX 4090": {"bf16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T},
    # NVIDIA HGX B200 datasheet, per GPU: FP16/BF16 4.5 PFLOPS sparse = 2.25 dense; TF32 2.2 sparse; FP32 75.
    "B200": {"bf16": 2250.0 * T, "tf32": 1100.0 * T, "fp32": 75.0 * T},
    # NVIDIA GB200 NVL72 datasheet, per GPU: FP16/BF16 5 PFLOPS sparse = 2.5 dense; TF32 2.5 sparse; FP32 80.
    "GB200": {"bf16": 2500.0 * T, "tf32": 1250.0 * T, "fp32": 80.0 * T},
    # AMD Instinct MI300X datasheet: BF16 1,307.4 dense (2,614.9 sparse); TF32 653.7; FP32 matrix 163.4.
    "MI300X": {"bf16": 1307.4 * T, "tf32": 653.7 * T, "fp32": 163.4 * T},
    # NVIDIA V100 datasheet: Tensor (FP16) 125 SXM2, 112 PCIe; FP32 15.7, 14; no BF16, no TF32.
    "V100": {"bf16": 125.0 * T, "tf32": 15.7 * T, "fp32": 15.7 * T},
    "V100 PCIe": {"bf16": 112.0 * T, "tf32": 14.0 * T, "fp32": 14.0 * T},
    # NVIDIA V100S datasheet (PCIe): Tensor (FP16) 130; FP32 16.4.
    "V100S": {"bf16": 130.0 * T, "tf32": 16.4 * T, "fp32": 16.4 * T},
    # NVIDIA T4 datasheet: Mixed precision (FP16/FP32) 65; FP32 8.1; no BF16, no TF32.
    "T4": {"bf16": 65.0 * T, "tf32": 8.1 * T, "fp32": 8.1 * T},
}

# (pattern, canonical name), most specific first: the first pattern found in the lower-cased
# device name wins. Names as torch.cuda.get_device_name() reports them, e.g.
# "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
# "NVIDIA GeForce RTX 4090", "AMD Instinct MI300X". \b keeps "a10" from matching "a100"
# and "l4" from matching "l40s".
_RULES: list[tuple[str, str]] = [
    (r"gb200", "GB200"),
    (r"\bb200", "B200"),
    (r"h200.*nvl", "H200 NVL"),
    (r"h200", "H200"),
    (r"h100.*pcie", "H100 PCIe"),
    (r"h100.*nvl", "H100 NVL"),
    (r"h100", "H100 SXM"),
    (r"a100(?:.*40\s*gb.*pcie|.*pcie.*40\s*gb)", "A100 40GB PCIe"),  # "NVIDIA A100-PCIE-40GB"
    (r"a100.*pcie", "A100 PCIe"),  # "NVIDIA A100 80GB PCIe"
    (r"a100.*40\s*gb", "A100 40GB"),  # "NVIDIA A100-SXM4-40GB"
    (r"a100", "A100"),
    (r"\ba10g\b", "A10G"),
    (r"\ba10\b", "A10"),
    (r"\bl40s\b", "L40S"),
    (r"\bl4\b", "L4"),
    (r"rtx 4090", "RTX 4090"),
    (r"mi300x", "MI300X"),
    (r"v100s", "V100S"),  # "Tesla V100S-PCIE-32GB"
    (r"v100(?:.*16\s*gb.*pcie|.*pcie.*16\s*gb)", "V100 16GB PCIe"),  # "Tesla V100-PCIE-16GB"
    (r"v100.*pcie", "V100 PCIe"),
    (r"v100.*16\s*gb", "V100 16GB"),  # "Tesla V100-SXM2-16GB"
    (r"v100", "V100"),  # "Tesla V100-SXM2-32GB"
    (r"\bt4\b", "T4"),  # "Tesla T4"
]

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "bf16", "float16": "bf16", "half": "bf16",  # same tensor-core rate as bf16 on every listed device
    "tf32": "tf32", "tfloat32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}


# Catalog devices whose peak FLOP/s are another's (the same chip with other memory or board).
_PEAK_OF = {"A100 40GB": "A100", "A100 PCIe": "A100", "A100 40GB PCIe": "A100", "V100 16GB": "V100",
            "V100 16GB PCIe": "V100 PCIe"}


def identify(device_name: str) -> str | None:
    """The canonical name (a key of DEVICES) of a device name, or None if unknown."""
    name = device_name.lower()
    for pattern, canonical in _RULES:
        # A model number stands alone: "h100" is not in "h1000" nor "gh200" in "h200".
        if re.search(rf"(?<![a-z0-9]){pattern}(?!\d)", name):
            return canonical
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of `device_name` (e.g. torch.cuda.get_device_name()) computing in
    `dtype` ("bf16", "fp16", "tf32", "fp32", or torch-style "bfloat16", "torch.float32").
    None for an unknown device (e.g. "cpu"); ValueError for an unknown dtype."""
    key = dtype.lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype {dtype!r} has no peak FLOP/s entry; use one of {', '.join(_DTYPE_ALIASES)}")
    canonical = identify(device_name)
    if canonical is None:
        return None
    return PEAK_FLOPS[_PEAK_OF.get(canonical, canonical)][_DTYPE_ALIASES[key]]


# -- what the planner needs to know of a device ------------------------------------------------

G = 1e9


@dataclass(frozen=True)
class Device:
    """One accelerator as the planner sees it: dense peak FLOP/s by dtype, memory, memory
    bandwidth, the bandwidth of its links to the other devices of its node and to other nodes
    (bytes/s each way, per device), and its board power."""

    name: str
    peak: dict[str, float]
    memory: float  # bytes
    memory_bandwidth: float  # bytes/s
    intra_node: float  # bytes/s each way, per device, to the devices of its node
    inter_node: float  # bytes/s each way, per device, to other nodes
    watts: float  # maximum board power
    gpus_per_node: int = 8
    bf16: bool = True  # computes in bfloat16; else its 16-bit peak is float16's, whose loss scaling train
    # offers on data-parallel layouts of a dense model only (config.float16_problems)
    float8: bool = True  # trains in float8 (train.float8: torchao's, from compute capability 8.9 on)

    def to_dict(self) -> dict:
        return asdict(self)


# A network interface of 400 Gb/s per GPU (NDR InfiniBand or 400G Ethernet, as in NVIDIA's DGX
# H100/H200/B200 reference designs): 50 GB/s each way. Override with the planner's --inter-node-gbps.
INTER_NODE = 400 / 8 * G
# PCIe per direction: Gen4 x16 ~32 GB/s, Gen5 x16 ~64 GB/s (what PCIe cards without NVLink talk over).
PCIE4, PCIE5 = 32 * G, 64 * G

# Canonical name -> (memory GB, memory bandwidth GB/s, link GB/s each way, max board W), from each
# vendor's datasheet; NVLink figures are the datasheets' totals (both directions) halved.
_SPECS: dict[str, tuple[float, float, float, float]] = {
    "H100 SXM": (80, 3350, 900 / 2, 700),       # HBM3; NVLink 4 900 GB/s
    "H100 PCIe": (80, 2000, PCIE5 / G, 350),    # HBM2e; PCIe Gen5 (an NVLink bridge joins pairs only)
    "H100 NVL": (94, 3900, PCIE5 / G, 400),     # HBM3; NVLink bridge joins pairs only
    "H200": (141, 4800, 900 / 2, 700),          # HBM3e; NVLink 4 900 GB/s
    "H200 NVL": (141, 4800, PCIE5 / G, 600),    # NVLink bridge joins 2 or 4 cards only
    "A100": (80, 2039, 600 / 2, 400),           # 80 GB SXM; NVLink 3 600 GB/s
    "A100 40GB": (40, 1555, 600 / 2, 400),      # 40 GB SXM
    "A100 PCIe": (80, 1935, PCIE4 / G, 300),    # 80 GB PCIe (an NVLink bridge joins pairs only)
    "A100 40GB PCIe": (40, 1555, PCIE4 / G, 250),
    "L4": (24, 300, PCIE4 / G, 72),             # GDDR6, PCIe Gen4
    "L40S": (48, 864, PCIE4 / G, 350),          # GDDR6, PCIe Gen4
    "A10": (24, 600, PCIE4 / G, 150),
    "A10G": (24, 600, PCIE4 / G, 300),          # AWS G5; approximate, as its peaks
    "RTX 4090": (24, 1008, PCIE4 / G, 450),
    "B200": (180, 8000, 1800 / 2, 1000),        # HGX B200 (1,440 GB over 8); NVLink 5 1.8 TB/s
    "GB200": (186, 8000, 1800 / 2, 1200),       # NVL72 (13.4 TB over 72); NVLink 5; ~2.7 kW per 2 GPUs + CPU
    "MI300X": (192, 5300, 896 / 2, 750),        # HBM3; Infinity Fabric 896 GB/s peer-to-peer in total
    "V100": (32, 900, 300 / 2, 300),            # 32 GB SXM2, HBM2; NVLink 2 300 GB/s
    "V100 16GB": (16, 900, 300 / 2, 300),
    "V100 PCIe": (32, 900, 16, 250),            # PCIe Gen3 x16
    "V100 16GB PCIe": (16, 900, 16, 250),
    "V100S": (32, 1134, 16, 250),               # PCIe Gen3 x16
    "T4": (16, 320, 16, 70),                    # GDDR6, PCIe Gen3 x16 (~16 GB/s each way)
}


# Devices without bfloat16 (Volta and Turing): train.dtype = auto computes in float16 there.
_NO_BF16 = ("V100", "V100 16GB", "V100 PCIe", "V100 16GB PCIe", "V100S", "T4")
# Devices of hosts whose network is slower than INTER_NODE assumes: PCIe Gen3 servers, about
# 100 Gb/s (EDR InfiniBand, as NVIDIA's DGX-1) a GPU at most (the same generations).
_INTER_NODE_OF = {name: 12.5 * G for name in _NO_BF16}
# Devices without float8 matmuls (compute capability below 8.9: Volta, Turing, Ampere), where train
# refuses train.float8 (train/float8.py).
_NO_FLOAT8 = (*_NO_BF16, "A100", "A100 40GB", "A100 PCIe", "A100 40GB PCIe", "A10", "A10G")


def _device(name: str) -> Device:
    memory, bandwidth, link, watts = _SPECS[name]
    peaks = PEAK_FLOPS[_PEAK_OF.get(name, name)]
    return Device(name, dict(peaks), memory * G, bandwidth * G, link * G, _INTER_NODE_OF.get(name, INTER_NODE), watts,
                  gpus_per_node=72 if name == "GB200" else 8, bf16=name not in _NO_BF16, float8=name not in _NO_FLOAT8)


DEVICES: dict[str, Device] = {name: _device(name) for name in _SPECS}


def device(name: str) -> Device:
    """The catalog's Device for a name: a key of DEVICES (any case) or a device name as
    torch.cuda.get_device_name() gives it; ValueError naming the known ones otherwise."""
    for key, spec in DEVICES.items():
        if key.lower() == name.strip().lower():
            return spec
    canonical = identify(name)
    if canonical is None:
        import difflib

        near = difflib.get_close_matches(name.strip().upper(), [key.upper() for key in DEVICES], n=1, cutoff=0.6)
        guess = f"did you mean {next(k for k in DEVICES if k.upper() == near[0])!r}? " if near else ""
        raise ValueError(f"no device {name!r} in the catalog; {guess}use one of {', '.join(DEVICES)}, or describe it "
                         "in a JSON file (plan --hardware FILE)")
    return DEVICES[canonical]


def device_from_dict(data: dict, base: Device | None = None) -> Device:
    """A Device from a JSON object (plan --hardware FILE): the Device fields, with memory in GB,
    bandwidths in GB/s and peaks in TFLOP/s, e.g. {"name": "X", "peak_tflops": {"bf16": 400},
    "memory_gb": 64, "memory_bandwidth_gbs": 2000, "intra_node_gbs": 300, "inter_node_gbs": 25,
    "watts": 500, "gpus_per_node": 8, "bf16": true, "float8": true}; fields missing are taken from
    `base` ("bf16": false for a device without bfloat16, whose bf16 peak is then its float16 one and
    which needs an fp32 peak too; "float8": false for one without float8 matmuls). A name the
    catalog knows sets both unless given."""
    units = {"memory_gb": ("memory", G), "memory_bandwidth_gbs": ("memory_bandwidth", G),
             "intra_node_gbs": ("intra_node", G), "inter_node_gbs": ("inter_node", G), "watts": ("watts", 1)}
    known = {"name", "peak_tflops", "gpus_per_node", "bf16", "float8", *units}
    if not isinstance(data, dict):
        raise ValueError(f"a device description is a JSON object of {', '.join(sorted(known))}, not {data!r}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown device field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}")

    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"device field {key} = {value!r} must be a positive number")
        return float(value)

    fields = base.to_dict() if base is not None else {}
    for key, (field, scale) in units.items():
        if key in data:
            fields[field] = number(key, data[key]) * scale
    if "peak_tflops" in data:
        peaks = data["peak_tflops"]
        if not isinstance(peaks, dict) or not peaks:
            raise ValueError(f"device field peak_tflops = {peaks!r} must map dtypes to TFLOP/s, e.g. {{\"bf16\": 400}}")
        fields["peak"] = {**fields.get("peak", {}),
                          **{dtype: number(f"peak_tflops.{dtype}", value) * T for dtype, value in peaks.items()}}
        if "bf16" not in fields["peak"]:
            raise ValueError("device field peak_tflops needs a bf16 entry (the planner's default compute dtype)")
    if "gpus_per_node" in data:
        count = data["gpus_per_node"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"device field gpus_per_node = {count!r} must be a whole number of at least 1")
        fields["gpus_per_node"] = count
    known_as = identify(str(data["name"])) if "name" in data else None
    if "name" in data:
        fields["name"] = str(data["name"])
    if known_as is not None:  # (a V100, T4 or A100 described by hand: the catalog's flags, unless given below)
        fields.update(bf16=DEVICES[known_as].bf16, float8=DEVICES[known_as].float8)
    for flag, what in (("bf16", "computes in bfloat16"), ("float8", "trains in float8, from compute capability 8.9")):
        if flag in data:
            if not isinstance(data[flag], bool):
                raise ValueError(f"device field {flag} = {data[flag]!r} must be true or false (whether it {what})")
            fields[flag] = data[flag]
    if data.get("bf16") is False and "float8" not in data and known_as is None:
        fields["float8"] = False  # (a device without bfloat16 predates float8 matmuls)
    if not fields.get("bf16", True) and "fp32" not in fields.get("peak", {}):
        raise ValueError("a device without bf16 needs an fp32 entry in peak_tflops: layouts float16's loss scaling "
                         "does not reach train in float32 there")
    keys = {"name": "name", "peak": "peak_tflops", "watts": "watts", **{f: k for k, (f, _) in units.items()}}
    missing = [key for field, key in keys.items() if field not in fields]
    if missing:
        raise ValueError(f"the device description lacks {', '.join(missing)}; give them, or start from a "
                         "catalog device (plan --gpu NAME) and change only what differs")
    return Device(**fields)
