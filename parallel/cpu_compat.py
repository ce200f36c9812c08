"""Run megatron-core on CPU (gloo) by redirecting the few CUDA-only calls it makes.

This is the ONE place in rlcli that patches third-party code. It is active only when CUDA
is absent: `enable_cpu_compat()` returns immediately on a GPU machine, and it is idempotent.

What it redirects, and why (megatron-core 0.16 - 0.19 read as ground truth):

* `torch.cuda.current_device()` -> 0. Megatron passes it as a `device=` argument everywhere
  (buffers, collectives' scratch tensors, `.to(...)`); the device mode below maps 0 to cpu.
* `torch.cuda.synchronize()` -> no-op. Called by timers, DDP and checkpointing.
* CUDA RNG state functions -> torch's CPU generator: `torch.cuda.get_rng_state`,
  `set_rng_state`, `manual_seed` and `megatron.core.tensor_parallel.random.
  _get_cuda_rng_state` / `_set_cuda_rng_state` (the latter goes through `torch.cuda._lazy_call`,
  which on a machine without CUDA queues the call forever). On CPU every random op (weight init,
  dropout) draws from the CPU generator, so making "the CUDA generator" BE the CPU generator keeps
  megatron's `CudaRNGStatesTracker.fork()` meaningful: tensor-parallel weight init inside a fork
  draws from the per-TP-rank seeded stream exactly as it would on GPU. The tracker logs a warning
  ("CPU RNG state changed within GPU RNG context") on each fork; it is filtered out here.
* `device="cuda"` / `device=<int>` arguments of torch functions, `Tensor.cuda()`,
  `Tensor.to("cuda")` -> cpu, through a global `torch.overrides.TorchFunctionMode`.
* `Tensor.type()` without arguments reports the CUDA type name (`torch.cuda.FloatTensor`) for
  CPU tensors, because megatron's grad clipping asserts `grad.type() == 'torch.cuda.FloatTensor'`
  and its distributed optimizer dispatches on parameter type names. `Tensor.type("torch.cuda.X")`
  converts to the CPU type.
* `torch.cuda.current_stream()` / `Stream` / `stream()` / `Event` -> inert stand-ins: DDP's
  grad-sync overlap and the distributed optimizer record and wait on streams and events; on CPU
  all work is synchronous, so waiting is a no-op.
* `torch.cuda.nvtx.range_push/range_pop` -> no-op (profiling markers).
* `torch.Tensor.pin_memory()` / `pin_memory=True` -> ignored (pinning needs a CUDA context).
* megatron's activation recomputation (`tensor_parallel.CheckpointFunction.backward`) re-runs
  the forward inside autograd's backward, where torch does not carry torch-function modes over:
  its backward enters the device mode again (else `device="cuda"` in the rerun fails).

Use `device()` for the torch.device that training code should place tensors on.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_enabled = False


def device() -> torch.device:
    """The device training tensors belong on: the current CUDA device, or cpu without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # A bare int device index means the default accelerator (cuda), as in `device=0`.
    return isinstance(value, int) and not isinstance(value, bool)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int16: "torch.cuda.ShortTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to cpu and makes `Tensor.type()` report CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func in (torch.Tensor.pin_memory, torch.Tensor.is_pinned):
            return args[0] if func is torch.Tensor.pin_memory else False
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    tensor = args[0]
    requested = args[1] if len(args) > 1 else kwargs.get("dtype")
    if requested is None:
        name = func(tensor)
        return _CUDA_TYPE_NAMES.get(tensor.dtype, name) if tensor.device.type == "cpu" else name
    if isinstance(requested, str):
        requested = requested.replace("torch.cuda.", "torch.")
    return func(tensor, requested, *args[2:], **{k: v for k, v in kwargs.items() if k != "dtype"})


class _InertStream:
    """Stand-in for torch.cuda.Stream / Event: all CPU work is already synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _InertStream:
        return _InertStream()

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. back into here.
    torch.default_generator.manual_seed(int(seed))


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def enable_cpu_compat() -> None:
    """Install the CPU redirections (see module docstring). No-op with CUDA or when already on."""
    global _enabled
    if _enabled or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as megatron_random

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = _noop
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    megatron_random._get_cuda_rng_state = _cpu_get_rng_state
    megatron_random._set_cuda_rng_state = _cpu_set_rng_state
    logging.getLogger(megatron_random.__name__).addFilter(_DropForkWarning())

    cuda.Stream = _InertStream
    cuda.Event = _InertStream
    cuda.current_stream = lambda *args, **kwargs: _InertStream()
    cuda.default_stream = lambda *args, **kwargs: _InertStream()
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.nvtx.range_push = _noop
    cuda.nvtx.range_pop = _noop

    checkpoint_backward = megatron_random.CheckpointFunction.backward

    def _backward_on_cpu(ctx: Any, *args: Any) -> Any:
        with _CudaToCpuMode():
            return checkpoint_backward(ctx, *args)

    megatron_random.CheckpointFunction.backward = staticmethod(_backward_on_cpu)

    # Entered and never exited (but by `suspended`): the mode stays on this thread's
    # torch-function stack for the life of the process, which is what "run megatron on CPU" means.
    global _mode
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    _enabled = True


_mode: _CudaToCpuMode | None = None


@contextlib.contextmanager
def suspended():
    """Leave the device mode for a block that never calls megatron-core (the rollout engine's
    sampling): under the mode every torch call of that block takes a detour through Python, which
    cost vLLM-CPU about a tenth of its generation time. A no-op on GPU, or when the mode is not the
    innermost one on this thread."""
    if _mode is None or torch.overrides._get_current_function_mode() is not _mode:
        yield
        return
    _mode.__exit__(None, None, None)
    try:
        yield
    finally:
        _mode.__enter__()
