"""Move Megatron training state to pinned host memory between phases, and back.

Colocated with vLLM, the actor's weights, gradient buffers and optimizer state sit idle on the
GPU while the engine generates. `Offloader` frees that device memory for real and brings it back
bit-identical:

    offloader = Offloader(models, optimizer)          # models: DDP-wrapped or plain chunks
    stats = offloader.reserve(params=True, grads=True, optimizer=True)  # at build time: pinning
    stats = offloader.offload(params=True, grads=True, optimizer=True, discard_grads=True)
    ...                                               # vLLM generates in the freed memory
    stats = offloader.onload(params=True)             # before log-probs
    stats = offloader.onload(grads=True, optimizer=True)  # before the update
    stats.bytes, stats.seconds                        # what moved, wall time incl. the sync
    stats.allocated_bytes, stats.allocation_seconds   # pinned host memory allocated in the call

    ref = Offloader(ref_models)                       # a frozen reference model: params only

How memory is freed: every tensor involved is backed by a torch storage; the offloader copies the
storage's bytes into a preallocated pinned host buffer and shrinks the storage to 0 bytes
(`UntypedStorage.resize_(0)`, as megatron's own `_ParamAndGradBuffer.offload_to_cpu` and FSDP
do). Onload regrows the storage and copies the bytes back. The tensor objects never change, so
every view into a storage stays valid: `param.data` views into DDP's `param_data` buffer (with
the distributed optimizer), `param.main_grad` and bucket views into `grad_data`, the distributed
optimizer's fp32 shards. Storages are grouped, not tensors, so a view shared by several tensors
moves once.

What each kind covers (storages on the training device only):
  * params: the chunks' parameters (with the distributed optimizer these are views into DDP's
    contiguous `param_data` buffers, which therefore move whole);
  * grads: DDP's `grad_data` buffers (`buffers` and `expert_parallel_buffers` of megatron-core
    0.16 - 0.19's DistributedDataParallel);
  * optimizer: the inner torch optimizers' parameters (fp32 master weights of the fp16 / bf16 /
    distributed optimizers) and their state (Adam's exp_avg, exp_avg_sq), of every optimizer in
    a ChainedOptimizer, minus storages already counted as params or grads (an fp32 model's
    optimizer steps the model's own parameters).

Host buffers: one pinned buffer per kind, allocated once and reused by every later offload.
Allocating (page-locking) gigabytes of pinned memory takes seconds, far longer than the copy
into it (about 5 s against a 0.16 s copy for the 0.5B actor's state on an H200), so `reserve`
allocates them up front, at build time, timed, and the first offload is a copy like every other
one. It sizes the optimizer's buffer for the state Adam creates at its first step (exp_avg and
exp_avg_sq, each like its parameter). A buffer an offload finds too small is allocated again in
that call, and its stats say so (`allocated_bytes`, `allocation_seconds`).

On CUDA the copies are non_blocking from / to pinned memory with one synchronize per call, and
`torch.cuda.empty_cache()` returns the freed blocks to the driver (vLLM sizes its KV cache from
the free memory the driver reports). On CPU the same bookkeeping runs: storages really shrink to
0 and regrow, with the host buffer on the same device.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.utils import unwrap_model

from parallel.optim import sub_optimizers

KINDS = ("params", "grads", "optimizer")
_ALIGN = 512  # bytes: keep each storage's slice of the host buffer DMA-friendly


@dataclass
class TransferStats:
    """What one offload / onload / reserve call moved: bytes copied (freed-only grads count 0)
    and the wall time including the final synchronize; and the pinned host memory it allocated
    (``reserve``: all of it; an offload: only a buffer that had to grow) and the seconds that
    took (part of ``seconds``)."""

    bytes: int = 0
    seconds: float = 0.0
    allocated_bytes: int = 0
    allocation_seconds: float = 0.0


@dataclass
class _Moved:
    storages: list[torch.UntypedStorage]
    sizes: list[int]  # bytes of each storage before it was freed
    offsets: list[int]  # where its bytes sit in the host buffer (-1: freed without a copy)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (any dtype, any view layout)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloader:
    """Offload / onload the params, gradient buffers and optimizer state of one model.

    `models`: the chunk list (DDP-wrapped for training, plain for a frozen reference model);
    `optimizer`: the megatron optimizer built over them, or None.
    """

    def __init__(self, models: Iterable[torch.nn.Module], optimizer: Any = None) -> None:
        self.models = list(models)
        self.optimizer = optimizer
        self.device = next(p.device for m in self.models for p in m.parameters())
        self._host: dict[str, torch.Tensor] = {}
        self._moved: dict[str, _Moved] = {}

    # -- which storages belong to which kind ---------------------------------------------

    def _param_tensors(self) -> list[torch.Tensor]:
        return [p.data for m in self.models for p in unwrap_model(m).parameters()]

    def _grad_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for model in self.models:
            for buffer in [
                *getattr(model, "buffers", []),
                *getattr(model, "expert_parallel_buffers", []),
            ]:
                if getattr(buffer, "grad_data", None) is not None:
                    tensors.append(buffer.grad_data)
        return tensors

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for sub in sub_optimizers(self.optimizer) if self.optimizer is not None else []:
            inner = getattr(sub, "optimizer", None)
            if inner is None:  # a stub optimizer (a rank without parameters)
                continue
            for group in inner.param_groups:
                tensors.extend(p.data for p in group["params"])
            for state in inner.state.values():
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return tensors

    def _storages(self, kind: str) -> list[torch.UntypedStorage]:
        owned_elsewhere: set[int] = set()
        if kind == "optimizer":
            for tensor in self._param_tensors() + self._grad_tensors():
                owned_elsewhere.add(tensor.untyped_storage().data_ptr())
        tensors = {
            "params": self._param_tensors,
            "grads": self._grad_tensors,
            "optimizer": self._optimizer_tensors,
        }[kind]()
        seen, storages = set(), []
        for tensor in tensors:
            if tensor.device != self.device:  # e.g. Adam's `step` counter kept on the host
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen or key in owned_elsewhere:
                continue
            seen.add(key)
            storages.append(storage)
        return storages

    # -- moving ---------------------------------------------------------------------------

    def is_offloaded(self, kind: str) -> bool:
        """Whether ``kind`` is on the host now (offloaded and not yet onloaded)."""
        return kind in self._moved

    def reserve(
        self, *, params: bool = False, grads: bool = False, optimizer: bool = False
    ) -> TransferStats:
        """Allocate the chosen kinds' pinned host buffers now (module docstring): the bytes
        allocated and the seconds it took; kinds whose buffer is already large enough cost 0."""
        start = time.perf_counter()
        stats = TransferStats()
        for kind, wanted in zip(KINDS, (params, grads, optimizer), strict=True):
            if not wanted:
                continue
            nbytes = sum(_aligned(s.nbytes()) for s in self._storages(kind))
            if kind == "optimizer":
                nbytes += self._adam_state_to_come()
            self._host_buffer(kind, nbytes, stats)
        stats.seconds = time.perf_counter() - start
        return stats

    def _adam_state_to_come(self) -> int:
        """Host bytes of the Adam moments not created yet: exp_avg and exp_avg_sq, each like its
        parameter, for every optimizer parameter on the device without state (plus one
        alignment slot for a per-parameter step counter, which some fused Adams keep there)."""
        total = 0
        for sub in sub_optimizers(self.optimizer) if self.optimizer is not None else []:
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                for param in group["params"]:
                    if param.device == self.device and not inner.state.get(param):
                        total += 2 * _aligned(param.numel() * param.element_size()) + _ALIGN
        return total

    def offload(
        self,
        *,
        params: bool = False,
        grads: bool = False,
        optimizer: bool = False,
        discard_grads: bool = False,
    ) -> TransferStats:
        """Free the chosen kinds' device memory, keeping their bytes in pinned host buffers.
        `discard_grads`: free the gradient buffers without copying them (onload then zeroes
        them), for when the next use starts by zeroing gradients anyway. Kinds already offloaded
        are skipped."""
        start = time.perf_counter()
        stats = TransferStats()
        for kind, wanted in zip(KINDS, (params, grads, optimizer), strict=True):
            if wanted and kind not in self._moved:
                copy = not (kind == "grads" and discard_grads)
                stats.bytes += self._offload_kind(kind, copy=copy, stats=stats)
        self._synchronize()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        stats.seconds = time.perf_counter() - start
        return stats

    def onload(
        self, *, params: bool = False, grads: bool = False, optimizer: bool = False
    ) -> TransferStats:
        """Bring the chosen kinds back to the device; kinds not offloaded are skipped."""
        start = time.perf_counter()
        moved = 0
        for kind, wanted in zip(KINDS, (params, grads, optimizer), strict=True):
            if wanted and kind in self._moved:
                moved += self._onload_kind(kind)
        self._synchronize()
        return TransferStats(moved, time.perf_counter() - start)

    def _host_buffer(self, kind: str, nbytes: int, stats: TransferStats) -> torch.Tensor:
        """The kind's pinned host buffer of at least ``nbytes``: the one allocated before, or a
        new one (counted in ``stats``) when there is none or it is too small."""
        buffer = self._host.get(kind)
        if buffer is None or buffer.numel() < nbytes:
            start = time.perf_counter()
            self._host.pop(kind, None)  # the old buffer goes before the larger one is pinned
            pin = self.device.type == "cuda"
            buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
            self._host[kind] = buffer
            stats.allocated_bytes += nbytes
            stats.allocation_seconds += time.perf_counter() - start
        return buffer

    def _offload_kind(self, kind: str, *, copy: bool, stats: TransferStats) -> int:
        storages = self._storages(kind)
        sizes = [s.nbytes() for s in storages]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total if copy else -1)
            total += _aligned(size)
        if copy and storages:
            host = self._host_buffer(kind, total, stats)
            for storage, size, offset in zip(storages, sizes, offsets, strict=True):
                host[offset : offset + size].copy_(_byte_view(storage), non_blocking=True)
            # the device -> host copies must land before the device memory is reused
            self._synchronize()
        for storage in storages:
            storage.resize_(0)
        self._moved[kind] = _Moved(storages, sizes, offsets)
        return sum(sizes) if copy else 0

    def _onload_kind(self, kind: str) -> int:
        record = self._moved.pop(kind)
        host = self._host.get(kind)
        moved = 0
        for storage, size, offset in zip(
            record.storages, record.sizes, record.offsets, strict=True
        ):
            storage.resize_(size)
            if offset < 0:
                _byte_view(storage).zero_()
            else:
                _byte_view(storage).copy_(host[offset : offset + size], non_blocking=True)
                moved += size
        return moved

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
