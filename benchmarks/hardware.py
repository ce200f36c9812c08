"""What machine the benchmark ran on, and the FLOP/s ceiling it is measured against."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass

import torch

from rlcli.machine import cpu_model

# Dense bf16 tensor-core peak (no sparsity) by device-name fragment, from the vendors' data
# sheets. First match wins, so a name that contains another (GH200 / H200 / H20) comes first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("B100", 1.75e15),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


@dataclass
class Hardware:
    kind: str  # "gpu" or "cpu"
    device_name: str
    num_devices: int
    cpu_cores: int
    host: str
    peak_bf16_flops: float | None  # None when the device is not in PEAK_BF16_FLOPS (CPUs)
    torch_version: str

    def to_dict(self) -> dict:
        return asdict(self)


def peak_bf16_flops(device_name: str) -> float | None:
    """Data-sheet dense bf16 FLOP/s of a GPU named like torch.cuda.get_device_name()."""
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment.lower() in device_name.lower():
            return flops
    return None


def detect_hardware() -> Hardware:
    on_gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if on_gpu else cpu_model()
    return Hardware(
        kind="gpu" if on_gpu else "cpu",
        device_name=name,
        num_devices=torch.cuda.device_count() if on_gpu else 1,
        cpu_cores=len(os.sched_getaffinity(0)),
        host=socket.gethostname().split(".")[0],
        peak_bf16_flops=peak_bf16_flops(name) if on_gpu else None,
        torch_version=torch.__version__,
    )


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (the machine may be shared: say what we ran under)."""
    return [round(value, 2) for value in os.getloadavg()]


@torch.no_grad()
def measure_matmul_flops(
    size: int, dtype: torch.dtype, device: str, min_seconds: float = 3.0, group: int = 4
) -> float:
    """Best FLOP/s of groups of `group` [size, size] @ [size, size] matmuls over `min_seconds`:
    the practical dense compute ceiling of this device, to set the training and rollout numbers
    against. The best group, not the mean: on a shared machine a ceiling must not sink with
    the neighbours' load."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.mm(a, b)  # first call pays for kernel selection / thread pool start
    _synchronize(device)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        group_start = time.perf_counter()
        for _ in range(group):
            torch.mm(a, b)
        _synchronize(device)
        best = min(best, time.perf_counter() - group_start)
    return 2 * size**3 * group / best


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
