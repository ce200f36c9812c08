"""glibc's thresholds on CPU ranks: a step's freed buffers are reused, not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from parallel.host_allocator import USER_SETTINGS

# After a first 16 MB buffer is freed glibc's own thresholds are 16 MB (mmap) and 32 MB (trim).
# A "step" then takes three 16 MB buffers from the heap, writes them and frees them: 48 MB free
# at the heap's top exceed the trim threshold, go back to the kernel, and the next step faults
# every page in again. malloc is called through ctypes so that no other allocation lands
# between the buffers.
STEPS = """
import ctypes, resource, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
from parallel.host_allocator import keep_freed_memory
print("set", keep_freed_memory() if sys.argv[1] == "keep" else False)
SIZE = 16 << 20
libc.free(libc.malloc(SIZE))
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [libc.malloc(SIZE) for _ in range(3)]
    for buffer in buffers:
        libc.memset(buffer, 1, SIZE)
    for buffer in buffers:
        libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("later_steps", min(faults[1:]), max(faults[1:]))
"""
PAGES_PER_STEP = 3 * (16 << 20) // 4096


def run_steps(mode: str, **env: str) -> tuple[str, int, int]:
    """(whether the thresholds were set, fewest and most page faults of steps 2-4)."""
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    proc = subprocess.run(
        [sys.executable, "-c", STEPS, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
        check=True,
    )
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    fewest, most = out["later_steps"].split()
    return out["set"], int(fewest), int(most)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_step_memory_is_reused_instead_of_faulted_again() -> None:
    default_set, default_fewest, _ = run_steps("default")
    kept_set, _, kept_most = run_steps("keep")
    assert (default_set, kept_set) == ("False", "True")
    assert default_fewest > PAGES_PER_STEP // 2, (
        "glibc's defaults no longer trim: the test shows nothing"
    )
    assert kept_most < PAGES_PER_STEP // 100, kept_most


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_user_allocator_settings_win() -> None:
    setting, fewest, _ = run_steps("keep", MALLOC_TRIM_THRESHOLD_="0")
    assert setting == "False"
    assert fewest > PAGES_PER_STEP // 2  # the user's trim threshold 0 still trims
