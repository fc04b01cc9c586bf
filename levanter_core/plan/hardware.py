"""The accelerators ``levanter plan`` knows: memory, peak rates and interconnects, each figure
from the vendor's public datasheet or documentation (``sources``).

Conventions, so that one figure means the same on every row:

* ``bf16_tflops``: dense (no structured sparsity) bf16 matrix throughput.
* ``f32_tflops``: what a float32 matrix product reaches at JAX's default precision: TF32 tensor
  cores on NVIDIA GPUs since Ampere, one bf16 pass on TPUs (dense figures).
* ``hbm_gb_s``: memory bandwidth, GB/s (10^9 bytes).
* ``link_gb_s``: what one device can send to its peers at once over the fast interconnect (NVLink,
  TPU ICI), one direction: half of the bidirectional figure the vendors publish.
* ``network_gb_s``: the same across the slower network between nodes or slices (InfiniBand or
  the data-center network), per device, one direction.
* ``node_devices``: how many devices share the fast interconnect (an 8-GPU server; a TPU pod).
"""

from __future__ import annotations

import dataclasses

from levanter_core.errors import ConfigError

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One kind of accelerator, as the plan's roofline sees it."""

    name: str
    memory_bytes: int
    bf16_tflops: float
    f32_tflops: float
    hbm_gb_s: float
    link_gb_s: float
    network_gb_s: float
    node_devices: int
    sources: tuple[str, ...]
    notes: str = ""

    @property
    def backend(self) -> str:
        """JAX's name for the platform (``gpu``, ``tpu``; ``cpu`` for this machine)."""
        return "tpu" if self.name.startswith("Google TPU") else "gpu" if self.name.startswith("NVIDIA") else "cpu"

    def matmul_tflops(self, compute_dtype: str) -> float:
        """Peak matrix throughput for compute in ``compute_dtype`` (``bfloat16``, ``float32``...)."""
        return self.f32_tflops if compute_dtype in ("float32", "f32") else self.bf16_tflops


_NVIDIA_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_NVIDIA_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM column)"
_NVIDIA_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM column)"
_NVIDIA_B200 = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, divided by its 8 GPUs)"
_HDR = "InfiniBand HDR, 200 Gb/s per GPU (one ConnectX-6 per GPU in a DGX A100)"
_NDR = "InfiniBand NDR, 400 Gb/s per GPU (one ConnectX-7 per GPU in a DGX H100/H200/B200)"

ACCELERATORS: dict[str, Accelerator] = {
    "a100-40gb": Accelerator(
        "NVIDIA A100 SXM 40GB",
        40 * 10**9,
        312.0,
        156.0,
        1555.0,
        300.0,
        25.0,
        8,
        (_NVIDIA_A100, _HDR),
        "NVLink 3: 600 GB/s bidirectional",
    ),
    "a100-80gb": Accelerator(
        "NVIDIA A100 SXM 80GB",
        80 * 10**9,
        312.0,
        156.0,
        2039.0,
        300.0,
        25.0,
        8,
        (_NVIDIA_A100, _HDR),
        "NVLink 3: 600 GB/s bidirectional",
    ),
    "h100-80gb": Accelerator(
        "NVIDIA H100 SXM 80GB",
        80 * 10**9,
        989.4,
        494.7,
        3350.0,
        450.0,
        50.0,
        8,
        (_NVIDIA_H100, _NDR),
        "NVLink 4: 900 GB/s bidirectional",
    ),
    "h200": Accelerator(
        "NVIDIA H200 SXM 141GB",
        141 * 10**9,
        989.4,
        494.7,
        4800.0,
        450.0,
        50.0,
        8,
        (_NVIDIA_H200, _NDR),
        "NVLink 4: 900 GB/s bidirectional; the H100's compute",
    ),
    "b200": Accelerator(
        "NVIDIA B200 180GB",
        180 * 10**9,
        2250.0,
        1125.0,
        8000.0,
        900.0,
        50.0,
        8,
        (_NVIDIA_B200, _NDR),
        "NVLink 5: 1.8 TB/s bidirectional",
    ),
    "tpu-v4": Accelerator(
        "Google TPU v4",
        32 * GiB,
        275.0,
        275.0,
        1200.0,
        150.0,
        6.25,
        4096,
        ("https://cloud.google.com/tpu/docs/v4", "ICI 2,400 Gbps per chip (v5p's documentation compares)"),
        "data-center network between slices: assumed 200 Gb/s per host of 4 chips",
    ),
    "tpu-v5e": Accelerator(
        "Google TPU v5e",
        16 * 10**9,
        197.0,
        197.0,
        819.0,
        100.0,
        3.125,
        256,
        (
            "https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, 16 GB at 819 GBps, ICI 1,600 Gbps, "
            "2 x 100 Gbps NICs per host of 8 chips",
        ),
    ),
    "tpu-v5p": Accelerator(
        "Google TPU v5p",
        95 * 10**9,
        459.0,
        459.0,
        2765.0,
        300.0,
        6.25,
        8960,
        ("https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 95 GB at 2,765 GBps, ICI 4,800 Gbps",),
        "data-center network between slices: assumed 200 Gb/s per host of 4 chips",
    ),
    "tpu-v6e": Accelerator(
        "Google TPU v6e (Trillium)",
        32 * 10**9,
        918.0,
        918.0,
        1640.0,
        224.0,
        3.125,
        256,
        ("https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 32 GB at 1,640 GBps, ICI 3,584 Gbps",),
        "data-center network between slices: assumed as v5e's, 2 x 100 Gbps per host of 8 chips",
    ),
}
"""Every accelerator by the name ``--device`` takes."""

_ALIASES = {
    "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "h100": "h100-80gb", "h100-80g": "h100-80gb",
    "h100-sxm": "h100-80gb", "h200-141gb": "h200", "v4": "tpu-v4", "v5e": "tpu-v5e", "v5litepod": "tpu-v5e",
    "v5p": "tpu-v5p", "v6e": "tpu-v6e", "trillium": "tpu-v6e",
}  # fmt: skip


def accelerator(name: str) -> Accelerator:
    """The accelerator called ``name`` (a key of :data:`ACCELERATORS`, or a common alias such as
    ``h100`` or ``v5p``); a :class:`ConfigError` listing the known ones otherwise."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ConfigError(
            f"--device {name!r} is not an accelerator the planner knows; one of {', '.join(ACCELERATORS)}"
        )
    return ACCELERATORS[key]


_DEVICE_KINDS = (
    ("h200", "h200"), ("h100", "h100-80gb"), ("b200", "b200"), ("a100-sxm4-40gb", "a100-40gb"), ("a100", "a100-80gb"),
    ("v6", "tpu-v6e"), ("v5p", "tpu-v5p"), ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v4", "tpu-v4"),
)  # fmt: skip
"""A piece of a JAX ``device_kind`` and the accelerator it names, first match wins."""


def from_device_kind(kind: str) -> Accelerator | None:
    """The accelerator of a JAX device's ``device_kind`` (``NVIDIA H100 80GB HBM3``, ``TPU v5p``...),
    None when the table has no such device (a CPU)."""
    text = kind.lower()
    for needle, key in _DEVICE_KINDS:
        if needle in text:
            return ACCELERATORS[key]
    return None
