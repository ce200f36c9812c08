"""What an operator watches each step, under ``system/*`` in metrics.jsonl and TensorBoard: the
process's host memory (RSS) and CPU utilisation, the machine's available memory, and on a GPU the
device memory (allocated, reserved, the step's peak) and NVML's utilisation when ``pynvml`` is
present. Each rank measures itself; ``system_metrics`` summarises over the data-parallel ranks
(memory: the largest rank's; utilisation: the mean). A sample is a few system calls (0.045 ms
on a 2-core Intel Xeon, against steps of seconds), cheap enough to stay on."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil
import torch

# Reduced over ranks by their maximum (the rank closest to running out); the rest by the mean.
_LARGEST_OVER_RANKS = (
    "system/host_rss_gb",
    "system/device_allocated_gb",
    "system/device_reserved_gb",
    "system/device_peak_gb",
)
_GIB = 2**30


class SystemMonitor:
    """One rank's resource figures since the previous ``sample`` (CPU utilisation: the process's
    CPU time over the wall time of the cores it may run on, in percent)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._process = psutil.Process()
        self._clock = clock
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self._last_wall, self._last_cpu = clock(), self._cpu_seconds()

    def _cpu_seconds(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system

    def sample(self) -> dict[str, float]:
        wall, cpu = self._clock(), self._cpu_seconds()
        elapsed = max(wall - self._last_wall, 1e-9)
        busy = (cpu - self._last_cpu) / (elapsed * self._cores)
        self._last_wall, self._last_cpu = wall, cpu
        figures = {
            "system/host_rss_gb": self._process.memory_info().rss / _GIB,
            "system/host_available_gb": psutil.virtual_memory().available / _GIB,
            "system/cpu_util_percent": 100.0 * min(max(busy, 0.0), 1.0),
        }
        if torch.cuda.is_available():
            figures["system/device_allocated_gb"] = torch.cuda.memory_allocated() / _GIB
            figures["system/device_reserved_gb"] = torch.cuda.memory_reserved() / _GIB
            figures["system/device_peak_gb"] = torch.cuda.max_memory_allocated() / _GIB
            torch.cuda.reset_peak_memory_stats()  # the next sample's peak is its own step's
            try:
                figures["system/device_util_percent"] = float(torch.cuda.utilization())
            except Exception:  # noqa: BLE001 (no pynvml / NVML: the figure is left out)
                pass
        return figures


def system_metrics(
    monitor: SystemMonitor,
    largest: Callable[[torch.Tensor], torch.Tensor],
    total: Callable[[torch.Tensor], torch.Tensor],
    ranks: int,
) -> dict[str, float]:
    """This rank's sample summarised over ``ranks`` ranks with the two reductions (a
    ``DataParallelStats``' ``max`` and ``sum``; identities on one rank)."""
    figures = monitor.sample()
    names = sorted(figures)
    values = torch.tensor([figures[name] for name in names], dtype=torch.float64)
    most, summed = largest(values.clone()), total(values.clone())
    return {
        name: (most[i] if name in _LARGEST_OVER_RANKS else summed[i] / ranks).item()
        for i, name in enumerate(names)
    }
