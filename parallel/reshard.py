"""3D weight resharding: Megatron shards (TP x PP x DP) -> full HF tensors for the rollout engine.

Public API (stable):

    iter_inference_buckets(models, mesh, bucket_mb=0) -> Iterator[list[(hf_name, tensor)]]
        Collective: every rank of the job iterates it to the end and gets every bucket.
        bucket_mb <= 0: AUTO_BUCKET_MB, i.e. a small model travels as one bucket per stage.
    sync_weights(models, mesh, engine, bucket_mb=0) -> SyncStats
        Streams the buckets into `engine.load_weights(list)` (any object with that method).
    SyncStats(bytes, seconds, gbps, num_buckets)

How a bucket travels. Every rank builds the same plan: the parameters of each pipeline stage, in
stage order, packed into buckets of at most `bucket_mb` MiB of full (TP-gathered) tensors. A
bucket never splits a Megatron module, so q, k, v and their biases (one `linear_qkv`) and gate
and up (one `linear_fc1`) always arrive in one `load_weights` call: vLLM rebuilds a fused layer
from one call's tensors only. For a bucket of stage s:

1. TP: the ranks of stage s put their shards of the bucket's TP-split parameters into one flat
   buffer and all-gather it in ONE collective over the TP group; the full tensors (shards
   concatenated along each parameter's partition dim, replicated ones as they are) are written
   into one flat buffer of the bucket.
2. PP: that flat buffer is broadcast in ONE collective from stage s to the other stages of the
   pipeline (each data-parallel replica does this in its own groups, in parallel).
3. Every rank cuts the buffer into HF tensors (fused QKV / gate-up split, vocab padding dropped)
   with `parallel.convert.megatron_to_hf`.

A rank holds at most about two buckets beyond its own shards and its engine (the gather buffer
and the flat full buffer, released when the next bucket starts); never the whole model. Without
TP and PP nothing travels: the buckets are views of the parameters themselves (the engine copies).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from parallel import cpu_compat
from parallel.convert.mapping import ParamMapping, megatron_to_hf, param_mappings
from parallel.cpu_compat import device
from parallel.mesh import Mesh

# The default bucket cap. Every bucket costs the engine one load call (vLLM: an RPC, a prefix
# cache reset), so fewer buckets are faster; a rank holds about two buckets beyond its shards, so
# the cap bounds that memory for large models (a 7B model in bf16 is about 28 buckets).
AUTO_BUCKET_MB = 512


class WeightConsumer(Protocol):
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None: ...


@dataclass(frozen=True)
class SyncStats:
    bytes: int  # bytes of HF tensors handed to the engine on this rank
    seconds: float
    gbps: float  # bytes / seconds / 1e9
    num_buckets: int


@dataclass(frozen=True)
class _Entry:
    """One exported Megatron parameter, as every rank of the pipeline sees it."""

    global_name: str
    local_shape: tuple[int, ...]  # the shard on one TP rank
    partition_dim: int | None  # None: replicated across TP
    dtype: torch.dtype

    def full_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.local_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= tp
        return tuple(shape)

    def full_numel(self, tp: int) -> int:
        return math.prod(self.full_shape(tp))


@dataclass(frozen=True)
class _Bucket:
    stage: int
    entries: tuple[_Entry, ...]
    dtype: torch.dtype


def _module_of(global_name: str) -> str:
    return global_name.rpartition(".")[0]


def _plan(mesh: Mesh, entries: list[_Entry], bucket_bytes: int) -> list[_Bucket]:
    """Buckets of every stage, identical on every rank (entries are exchanged over PP)."""
    per_stage = [entries]
    if mesh.pp > 1:
        per_stage = [None] * mesh.pp
        dist.all_gather_object(per_stage, entries, group=mesh.pp_group)
    buckets = []
    for stage, stage_entries in enumerate(per_stage):
        # Modules (consecutive entries with the same prefix) are the unit of packing.
        modules: list[list[_Entry]] = []
        for entry in stage_entries:
            if modules and _module_of(modules[-1][-1].global_name) == _module_of(entry.global_name):
                modules[-1].append(entry)
            else:
                modules.append([entry])
        current: list[_Entry] = []
        current_bytes = 0
        for module in modules:
            dtype = module[0].dtype
            size = sum(e.full_numel(mesh.tp) for e in module) * dtype.itemsize
            if current and (current_bytes + size > bucket_bytes or current[0].dtype != dtype):
                buckets.append(_Bucket(stage, tuple(current), current[0].dtype))
                current, current_bytes = [], 0
            current += module
            current_bytes += size
        if current:
            buckets.append(_Bucket(stage, tuple(current), current[0].dtype))
    return buckets


def _gather_full(bucket: _Bucket, by_name: dict[str, ParamMapping], mesh: Mesh) -> torch.Tensor:
    """On the bucket's own stage: the bucket's full tensors, flattened back to back."""
    tp = mesh.tp
    sharded = [e for e in bucket.entries if e.partition_dim is not None and tp > 1]
    gathered = None
    if sharded:
        local = torch.cat([by_name[e.global_name].param.detach().reshape(-1) for e in sharded])
        gathered = torch.empty(tp * local.numel(), dtype=local.dtype, device=local.device)
        # One collective straight into one flat buffer (NCCL's native all-gather; a list of
        # outputs would cost NCCL an extra copy). gloo takes this flat form too.
        dist.all_gather_into_tensor(gathered, local, group=mesh.tp_group)
        gathered = gathered.view(tp, local.numel())
    total = sum(e.full_numel(tp) for e in bucket.entries)
    flat = torch.empty(total, dtype=bucket.dtype, device=device())
    offset, shard_offset = 0, 0
    for entry in bucket.entries:
        numel = entry.full_numel(tp)
        out = flat[offset : offset + numel].view(entry.full_shape(tp))
        if entry.partition_dim is not None and tp > 1:
            shard_numel = math.prod(entry.local_shape)
            shards = gathered[:, shard_offset : shard_offset + shard_numel]
            torch.cat([s.view(entry.local_shape) for s in shards], dim=entry.partition_dim, out=out)
            shard_offset += shard_numel
        else:
            out.copy_(by_name[entry.global_name].param.detach())
        offset += numel
    return flat


@torch.no_grad()
def iter_inference_buckets(
    models: Sequence[torch.nn.Module], mesh: Mesh, bucket_mb: float = 0
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every rank gets every bucket of full HF tensors (module docstring); collective.

    Tensors are on `cpu_compat.device()` in the model's dtype; each bucket's tensors share one
    buffer, freed when the caller drops them (at TP1 x PP1: views of the parameters; copy them
    before the next optimizer step if they must be kept).
    """
    chunks = unwrap_model(list(models))  # megatron DDP / Float16Module wrappers
    hf_config: Any = chunks[0].hf_config
    mappings = [
        m for m in param_mappings(chunks, hf_config, mesh.tp, mesh.tp_rank) if not m.skip_export
    ]
    by_name = {m.global_name: m for m in mappings}
    entries = [
        _Entry(m.global_name, tuple(m.param.shape), m.partition_dim, m.param.dtype)
        for m in mappings
    ]
    bucket_bytes = max(1, int((bucket_mb if bucket_mb > 0 else AUTO_BUCKET_MB) * 2**20))
    for bucket in _plan(mesh, entries, bucket_bytes):
        if mesh.pp == 1 and all(e.partition_dim is None or mesh.tp == 1 for e in bucket.entries):
            # Nothing to gather or send: the parameters themselves (views, no copy; every
            # engine copies what it loads), which saves one pass over the model's bytes.
            yield [
                item
                for e in bucket.entries
                for item in megatron_to_hf(
                    hf_config, mesh.tp, e.global_name, by_name[e.global_name].param.detach()
                )
            ]
            continue
        if bucket.stage == mesh.pp_rank:
            flat = _gather_full(bucket, by_name, mesh)
        else:
            total = sum(e.full_numel(mesh.tp) for e in bucket.entries)
            flat = torch.empty(total, dtype=bucket.dtype, device=device())
        if mesh.pp > 1:
            source = dist.get_global_rank(mesh.pp_group, bucket.stage)
            dist.broadcast(flat, src=source, group=mesh.pp_group)
        hf_tensors = []
        offset = 0
        for entry in bucket.entries:
            numel = entry.full_numel(mesh.tp)
            full = flat[offset : offset + numel].view(entry.full_shape(mesh.tp))
            hf_tensors += megatron_to_hf(hf_config, mesh.tp, entry.global_name, full)
            offset += numel
        yield hf_tensors


def sync_weights(
    models: Sequence[torch.nn.Module], mesh: Mesh, engine: WeightConsumer, bucket_mb: float = 0
) -> SyncStats:
    """Stream the model into `engine.load_weights`, one bucket per call (collective)."""
    start = time.perf_counter()
    num_bytes, num_buckets = 0, 0
    # Gathering is plain torch and collectives, loading is the engine's: nothing here calls
    # megatron-core, and under the CPU device mode vLLM's per-layer reload took a detour through
    # Python for every torch call (a third of a CPU sync).
    with cpu_compat.suspended():
        for bucket in iter_inference_buckets(models, mesh, bucket_mb):
            engine.load_weights(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return SyncStats(num_bytes, seconds, num_bytes / max(seconds, 1e-9) / 1e9, num_buckets)
