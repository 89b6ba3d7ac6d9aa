"""The device capability table: peak dense BF16 FLOP/s and memory per GPU part.

One ordered table serves MFU in the trainer and the planner's defaults. Figures are vendor datasheet
peaks (dense, no sparsity) from ../shared/HARDWARE.md; `measured_bf16_tflops` is the best published
GEMM ceiling where one exists. An unknown device gets ``None`` - never a guessed number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    """Capabilities of one GPU part (per device as torch sees it, e.g. one MI250X GCD)."""

    name: str
    """Canonical part name, e.g. ``"H100"``."""
    vendor: str
    """``"nvidia"`` or ``"amd"``."""
    peak_bf16_tflops: float
    """Dense BF16 peak from the datasheet, TFLOP/s."""
    memory_gb: float
    """Device memory in GB (1e9 bytes), as the datasheet states it."""
    measured_bf16_tflops: float | None = None
    """Best published measured BF16 GEMM throughput, TFLOP/s, if known."""
    patterns: tuple[str, ...] = ()
    """Lower-case substrings that identify the part in ``torch.cuda.get_device_name()``."""

    @property
    def peak_bf16_flops(self) -> float:
        return self.peak_bf16_tflops * 1e12

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


# Ordered: more specific patterns first (H200 before H100, MI325X before MI300X).
DEVICE_TABLE: tuple[DeviceSpec, ...] = (
    # B200 and MI355X: vendor launch figures (dense BF16), not yet confirmed by a measured ceiling.
    DeviceSpec("B200", "nvidia", 2250.0, 180.0, None, ("b200",)),
    DeviceSpec("H200", "nvidia", 989.0, 141.0, 795.0, ("h200",)),
    DeviceSpec("H100", "nvidia", 989.0, 80.0, 795.0, ("h100",)),
    DeviceSpec("A100", "nvidia", 312.0, 80.0, 271.0, ("a100",)),
    DeviceSpec("MI355X", "amd", 2500.0, 288.0, None, ("mi355",)),
    DeviceSpec("MI325X", "amd", 1307.0, 256.0, 785.0, ("mi325",)),
    DeviceSpec("MI300X", "amd", 1307.0, 192.0, 782.0, ("mi300x", "mi300")),
    # torch sees one MI250X GCD as one device: half the OAM figures.
    DeviceSpec("MI250X", "amd", 191.5, 64.0, 147.0, ("mi250",)),
)


def lookup(device_name: str) -> DeviceSpec | None:
    """The table entry whose canonical name or pattern matches ``device_name``; None if unknown."""
    key = device_name.lower().replace(" ", "")
    for spec in DEVICE_TABLE:
        if key == spec.name.lower() or any(p in key for p in spec.patterns):
            return spec
    return None


def by_name(name: str) -> DeviceSpec:
    """The entry for a canonical part name; raises ``KeyError`` naming the known parts."""
    spec = lookup(name)
    if spec is None:
        known = ", ".join(s.name for s in DEVICE_TABLE)
        raise KeyError(f"unknown GPU part {name!r}; known parts: {known}")
    return spec
