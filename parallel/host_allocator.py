"""Keep freed host memory in the process on CPU training ranks (glibc malloc only).

glibc's malloc hands memory above the heap's top back to the kernel once more than a trim
threshold of it is free, and serves requests above a moving mmap threshold with fresh mappings;
both thresholds start small and are adjusted as the process frees memory. A CPU training step
allocates and frees tensors of tens of MB each micro-batch (logits, their log-softmax, the
embedding gradient); in megatron's step glibc gave back and re-mapped 4,000-12,000 pages a step
at the 25M benchmark shape, every one faulted in and zeroed again on the next use (a few
microseconds each on a VM, tens of ms a step); the plain HF loop on the same batch happened to
fault none. Fixed thresholds (mmap at glibc's 32 MiB maximum, trim at 256 MiB) make the step
fault no pages from its third on.

The cost: up to the trim threshold of freed heap memory stays with the process instead of going
back to the system. GPU ranks are left alone (their large buffers live on the device), and so is
a process whose user already set glibc's malloc variables or preloads another allocator
(jemalloc, tcmalloc), whose settings win.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameter numbers, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # the largest value glibc accepts on 64-bit machines
TRIM_THRESHOLD_BYTES = 256 << 20

USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Fix glibc's trim and mmap thresholds for this process; True when they were set.

    Does nothing (False) when the user set any of ``USER_SETTINGS`` or the C library has no
    ``mallopt`` (musl, macOS)."""
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    # Setting either turns off glibc's own adjustment of both, so both are set.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
