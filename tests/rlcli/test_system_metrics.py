"""``system/*``: this process's figures, sane and summarised over ranks as documented."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from rlcli.run.system_metrics import SystemMonitor, system_metrics


def test_cpu_utilisation_is_cpu_time_over_the_cores_wall_time():
    """Checked against Python's own CPU clock (``time.process_time``, not psutil's /proc
    reading), over a wall time the test sets (a fake clock: no dependence on the machine's
    load): 0.3 s of CPU in 2 s of wall on N cores is 15 / N percent."""
    walls = iter([100.0, 102.0])
    monitor = SystemMonitor(clock=lambda: next(walls))
    started = time.process_time()
    while time.process_time() - started < 0.3:
        sum(i * i for i in range(1000))
    burnt = time.process_time() - started
    figures = monitor.sample()
    cores = len(psutil.Process().cpu_affinity())
    expected = 100 * burnt / (2.0 * cores)
    assert figures["system/cpu_util_percent"] == pytest.approx(expected, abs=100 * 0.03 / cores)
    rss = psutil.Process().memory_info().rss / 2**30
    assert figures["system/host_rss_gb"] == pytest.approx(rss, rel=0.1)
    assert 0 < figures["system/host_available_gb"] <= psutil.virtual_memory().total / 2**30


def test_memory_is_the_largest_rank_and_utilisation_the_mean():
    """Two ranks in small: the other rank's figures are this one's doubled (memory) and zero
    (CPU), so max and sum / 2 can be told apart from any other reduction."""

    class FixedMonitor:
        def sample(self):
            return {"system/host_rss_gb": 3.0, "system/cpu_util_percent": 40.0}

    def largest(values: torch.Tensor) -> torch.Tensor:
        other = torch.tensor([0.0, 6.0], dtype=torch.float64)  # sorted names: cpu, rss
        return torch.maximum(values, other)

    def total(values: torch.Tensor) -> torch.Tensor:
        return values + torch.tensor([0.0, 6.0], dtype=torch.float64)

    summary = system_metrics(FixedMonitor(), largest, total, ranks=2)
    assert summary == {"system/host_rss_gb": 6.0, "system/cpu_util_percent": 20.0}
