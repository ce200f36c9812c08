"""Peak memory of one benchmark phase.

On GPU: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()` (tensors from
torch's caching allocator; memory vLLM takes through its own pool is not in it). On CPU: the
process's resident-set high-water mark (VmHWM), reset at the start of the phase through
/proc/self/clear_refs (Linux >= 4.0); where that is refused, a thread samples the RSS every
10 ms instead. Either way the figure includes what the process already held when the phase
began, which is reported alongside (`start_gb`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

GIB = 2**30


@dataclass
class PhaseMemory:
    start_gb: float = 0.0
    peak_gb: float = 0.0
    source: str = ""  # "cuda_max_memory_allocated" | "rss_hwm" | "rss_sampled"

    def to_dict(self) -> dict:
        return {"start_gb": self.start_gb, "peak_gb": self.peak_gb, "source": self.source}


@contextmanager
def measure_peak_memory() -> Iterator[PhaseMemory]:
    """`with measure_peak_memory() as mem: ...`; mem.peak_gb is filled in on exit."""
    memory = PhaseMemory()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        memory.start_gb = torch.cuda.memory_allocated() / GIB
        memory.source = "cuda_max_memory_allocated"
        yield memory
        torch.cuda.synchronize()
        memory.peak_gb = torch.cuda.max_memory_allocated() / GIB
        return
    process = psutil.Process()
    memory.start_gb = process.memory_info().rss / GIB
    if _reset_rss_high_water_mark():
        memory.source = "rss_hwm"
        yield memory
        memory.peak_gb = _rss_high_water_mark_bytes() / GIB
        return
    memory.source = "rss_sampled"
    with _sample_rss(process) as peak_bytes:
        yield memory
    memory.peak_gb = peak_bytes[0] / GIB


def _reset_rss_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")  # 5: reset the peak resident set size (VmHWM) to the current RSS
        return _rss_high_water_mark_bytes() > 0
    except OSError:
        return False


def _rss_high_water_mark_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        match = re.search(r"VmHWM:\s+(\d+) kB", handle.read())
    return int(match.group(1)) * 1024 if match else 0


@contextmanager
def _sample_rss(process: psutil.Process, interval_s: float = 0.01) -> Iterator[list[int]]:
    peak = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            peak[0] = max(peak[0], process.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], process.memory_info().rss)
